"""The `openrl` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def _deployment_options(parser: argparse.ArgumentParser) -> None:
    """Where the deployment's state lives; the same for every command that touches it."""
    parser.add_argument("--data-dir", type=Path, default=None, help="log, store and blobs (default ./.data)")
    parser.add_argument("--database-url", default=None, help="the event store (default: SQLite in the data dir)")
    parser.add_argument("--bus", choices=("embedded", "kafka"), default=None, help="the event log (default embedded)")
    parser.add_argument("--kafka-bootstrap", default=None, help="Kafka bootstrap servers when --bus kafka")


def _http_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="listen port (default 8000)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="openrl", description="OpenRL: a self-hosted Tinker-compatible training service"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="every role in one process: gateway, projector, trainer, sampler")
    _http_options(serve)
    _deployment_options(serve)
    serve.add_argument("--model", action="append", default=None, help="a base model to serve (repeatable; default all)")
    serve.add_argument(
        "--sampler-engine", dest="sampler_engine", choices=("torch", "vllm"), default=None,
        help="sampling engine (default torch; vllm needs `make vllm`)",
    )  # fmt: skip

    gateway = commands.add_parser("gateway", help="the Tinker HTTP API alone (distributed deployment)")
    _http_options(gateway)
    _deployment_options(gateway)
    gateway.add_argument(
        "--model", action="append", default=None, help="a base model to accept (repeatable; default all)"
    )
    for role in ("trainer", "sampler"):
        worker = commands.add_parser(role, help=f"a {role} worker alone (distributed deployment)")
        _deployment_options(worker)
        worker.add_argument(
            "--base-model", action="append", default=None, help="base models it serves (repeatable; default all)"
        )
        if role == "trainer":
            worker.add_argument(
                "--kind",
                choices=("lora", "full", "all"),
                default="all",
                help="LoRA runs, full fine-tuning runs, or both",
            )
            worker.add_argument("--model-id", default=None, help="serve this one run only (a per-run trainer)")
        else:
            worker.add_argument(
                "--engine", dest="sampler_engine", choices=("torch", "vllm"), default=None,
                help="sampling engine (default torch; vllm needs `make vllm`)",
            )  # fmt: skip
    projector = commands.add_parser("projector", help="the projector alone: stores worker events and wakes long-polls")
    _deployment_options(projector)
    audit = commands.add_parser(
        "audit", help="the audit log alone: one JSON line per event in <data-dir>/audit/<tenant>.jsonl (or --show them)"
    )
    _deployment_options(audit)
    audit.add_argument("--show", action="store_true", help="print a tenant's audit entries instead of recording")
    audit.add_argument("--tenant", default=None, help="with --show: whose entries (required)")
    audit.add_argument("--type", dest="audit_type", default=None, help="with --show: a fragment of the event type")
    audit.add_argument("-n", "--lines", type=int, default=0, help="with --show: only the last N entries (0: all)")
    metrics = commands.add_parser("metrics", help="Prometheus /metrics of requests, latencies, queue depths and tokens")
    _deployment_options(metrics)
    metrics.add_argument(
        "--host",
        dest="metrics_host",
        default=None,
        help="listen address of /metrics (default 127.0.0.1; setting metrics_host)",
    )
    metrics.add_argument("--port", dest="metrics_port", type=int, default=None, help="listen port (default 9464)")

    prepare = commands.add_parser("models", help="list the model catalogue and build its local files")
    prepare.add_argument("--prepare", action="store_true", help="materialise every model now (else on first use)")

    replay = commands.add_parser(
        "replay", help="rebuild every projection from the events and diff it against the live one"
    )
    _deployment_options(replay)
    replay.add_argument(
        "--into", default=None, help="database to rebuild into (default: a fresh temporary SQLite file)"
    )
    replay.add_argument(
        "--from-log",
        action="store_true",
        help="read the events from the log (Kafka) instead of the store; the diff is against the live store, so run it on a quiet deployment (an event landing meanwhile, e.g. a session heartbeat, shows as a difference)",
    )
    replay.add_argument(
        "--from-offset", type=int, default=0,
        help="with --from-log: start at this offset in every partition (into a restored backup given by --into)",
    )  # fmt: skip

    events = commands.add_parser("events", help="inspect the event stream")
    events_commands = events.add_subparsers(dest="events_command", required=True)
    tail = events_commands.add_parser("tail", help="print events as readable lines")
    _deployment_options(tail)
    tail.add_argument("--tenant", default=None)
    tail.add_argument("--model", default=None, help="a model id or sampling session id")
    tail.add_argument("--type", default=None, help="a fragment of the event type, e.g. forward_backward or failed")
    tail.add_argument("-n", "--lines", type=int, default=20, help="history lines to print first (0: all)")
    tail.add_argument("-f", "--follow", action="store_true", help="keep printing new events from the log")

    from functions import cli_runs
    from functions.deploy import cli as kubernetes_cli
    from functions.timeslicer import cli as timeslicer_cli

    timeslicer_cli.add_parser(commands)
    kubernetes_cli.add_commands(commands)  # deploy, scheduler, function
    cli_runs.add_commands(commands)  # runs, checkpoints, sessions: a client of a running server

    args = parser.parse_args(argv)
    if args.command in cli_runs.COMMANDS:
        return cli_runs.run(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("kafka", "alembic"):  # their INFO lines drown ours
        logging.getLogger(chatty).setLevel(logging.WARNING)
    if args.command == "timeslicer":
        return timeslicer_cli.run(args)
    if args.command in kubernetes_cli.COMMANDS:
        return kubernetes_cli.run(args)
    from openrl_core.settings import Settings

    flags = {
        "host": "host", "port": "port", "data_dir": "data_dir", "models": "model",
        "database_url": "database_url", "bus": "bus", "kafka_bootstrap": "kafka_bootstrap",
        "sampler_engine": "sampler_engine",
    }  # fmt: skip
    overrides = {field: getattr(args, flag) for field, flag in flags.items() if getattr(args, flag, None) is not None}
    settings = Settings(**overrides)
    logging.getLogger().setLevel(settings.log_level)
    if args.command == "metrics":
        flagged = {
            name: getattr(args, name) for name in ("metrics_host", "metrics_port") if getattr(args, name) is not None
        }
        settings = Settings(**overrides, **flagged)
    if args.command == "audit" and args.show:
        return _show_audit(settings, args)
    if args.command in ("audit", "metrics"):
        from functions.serve import Node

        node = Node(settings, (args.command,))
        where = (
            f" on http://{settings.metrics_host}:{settings.metrics_port}/metrics" if args.command == "metrics" else ""
        )
        print(f"openrl: {args.command} of every tenant's events{where}", flush=True)
        node.serve_forever()
        return 0
    if args.command in ("serve", "gateway", "projector", "trainer", "sampler"):
        from functions.serve import ROLES, Node

        roles = ROLES if args.command == "serve" else (args.command,)
        if "sampler" in roles and settings.sampler_engine == "vllm":
            from functions.sampler.vllm_engine import VllmEnvMissing, vllm_python

            try:
                vllm_python(settings.vllm_env)
            except VllmEnvMissing as exc:
                print(f"openrl {args.command}: {exc.detail}", file=sys.stderr)
                return 2
        kind = getattr(args, "kind", "all")
        node = Node(
            settings, roles, base_models=getattr(args, "base_model", None),
            trainer_kinds=("lora", "full") if kind == "all" else (kind,), only_model=getattr(args, "model_id", None),
        )  # fmt: skip
        where = f" on http://{settings.host}:{settings.port}" if node.app is not None else ""
        print(f"openrl: {', '.join(roles)} for {', '.join(node.runtime.catalog.names())}{where}", flush=True)
        node.serve_forever()
        return 0
    if args.command == "replay":
        return _replay(settings, args.into, args.from_log, args.from_offset)
    if args.command == "events":
        return _tail(settings, args)
    if args.command == "models":
        from functions.compute.models import ModelDirectory
        from openrl_core.catalog import Catalog

        catalog = Catalog.from_names(settings.models or None, settings.local_models, settings.model_aliases)
        directory = ModelDirectory(catalog, settings.model_cache)
        for name in directory.catalog.names():
            line = name
            if args.prepare:
                files = directory.files(name)
                line += f"  {files.arch}  vocab={files.vocab_size}  {files.path}"
            print(line)
        return 0
    return 2


def _replay(settings, into: str | None, from_log: bool = False, from_offset: int = 0) -> int:
    import tempfile

    from eventing.replay import ReplayReport, diff, read_log, rebuild_from_events, replay
    from eventing.store.event_store import EventStore
    from eventing.store.kept import close_kept
    from eventing.store.queries import Projections
    from functions.runtime import Runtime

    live = Runtime(settings)
    with tempfile.TemporaryDirectory() as scratch:
        from eventing.store import database

        engine = database.make_engine(into or f"sqlite:///{scratch}/replay.db")
        database.upgrade(engine)
        target, rebuilt = EventStore(engine, live.codec), Projections(engine)
        if from_log:
            events = read_log(live.bus, live.codec, from_offset)
            stored, seconds = rebuild_from_events(events, target)
            print(f"read {len(events)} events from the log, {stored} of them new to the target")
            report = ReplayReport(len(events), seconds, diff(live.projections, rebuilt))
        else:
            report = replay(live.store, live.projections, target, rebuilt)
        close_kept(engine)
        engine.dispose()
    live.close()
    print(f"replayed {report.events} events in {report.seconds:.2f} s ({report.events_per_second:.0f} events/s)")
    for line in report.differences[:50]:
        print("  " + line)
    print("projections match" if not report.differences else f"{len(report.differences)} differences")
    return 0 if not report.differences else 1


def _show_audit(settings, args) -> int:
    from functions.audit import read_entries
    from functions.audit.consumer import audit_dir

    if not args.tenant:
        print("openrl audit --show needs --tenant", file=sys.stderr)
        return 2
    from openrl_core.errors import InvalidRequest

    try:
        for entry in read_entries(audit_dir(settings), args.tenant, type_contains=args.audit_type, last=args.lines):
            print(json.dumps(entry, ensure_ascii=False), flush=True)
    except InvalidRequest as exc:
        print(f"openrl audit: {exc.detail}", file=sys.stderr)
        return 2
    return 0


def _tail(settings, args) -> int:
    from eventing.tail import EventFilter, describe, follow, history
    from functions.runtime import Runtime

    runtime = Runtime(settings)
    wanted = EventFilter(tenant=args.tenant, model=args.model, type_contains=args.type)
    for event in history(runtime.store, wanted, args.lines):
        print(describe(event), flush=True)
    if args.follow:
        try:
            for event in follow(runtime.bus, runtime.codec, wanted):
                print(describe(event), flush=True)
        except KeyboardInterrupt:
            pass
    runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
