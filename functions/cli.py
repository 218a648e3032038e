"""The `openrl` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="openrl", description="OpenRL: a self-hosted Tinker-compatible training service")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the embedded server (gateway, trainer, sampler, projector)")
    serve.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="listen port (default 8000)")
    serve.add_argument("--data-dir", type=Path, default=None, help="event log, store and blobs (default ./.data)")
    serve.add_argument("--model", action="append", default=None, help="a base model to serve (repeatable; default all)")

    prepare = commands.add_parser("models", help="list the model catalogue and build its local files")
    prepare.add_argument("--prepare", action="store_true", help="materialise every model now (else on first use)")

    replay = commands.add_parser("replay", help="rebuild every projection from the events and diff it against the live one")
    replay.add_argument("--data-dir", type=Path, default=None, help="the deployment's data dir (default ./.data)")
    replay.add_argument("--database-url", default=None, help="the live event store (default: SQLite in the data dir)")
    replay.add_argument("--into", default=None, help="database to rebuild into (default: a fresh temporary SQLite file)")

    events = commands.add_parser("events", help="inspect the event stream")
    events_commands = events.add_subparsers(dest="events_command", required=True)
    tail = events_commands.add_parser("tail", help="print events as readable lines")
    tail.add_argument("--data-dir", type=Path, default=None)
    tail.add_argument("--database-url", default=None)
    tail.add_argument("--tenant", default=None)
    tail.add_argument("--model", default=None, help="a model id or sampling session id")
    tail.add_argument("--type", default=None, help="a fragment of the event type, e.g. forward_backward or failed")
    tail.add_argument("-n", "--lines", type=int, default=20, help="history lines to print first (0: all)")
    tail.add_argument("-f", "--follow", action="store_true", help="keep printing new events from the log")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from openrl_core.settings import Settings

    overrides = {
        key: value
        for key, value in {"host": getattr(args, "host", None), "port": getattr(args, "port", None),
                           "data_dir": getattr(args, "data_dir", None), "models": getattr(args, "model", None),
                           "database_url": getattr(args, "database_url", None)}.items()
        if value is not None
    }  # fmt: skip
    settings = Settings(**overrides)
    if args.command == "serve":
        from functions.serve import EmbeddedServer

        server = EmbeddedServer(settings)
        print(f"openrl: serving {', '.join(server.runtime.catalog.names())} on http://{settings.host}:{settings.port}", flush=True)
        server.serve_forever()
        return 0
    if args.command == "replay":
        return _replay(settings, args.into)
    if args.command == "events":
        return _tail(settings, args)
    if args.command == "models":
        from functions.compute.models import ModelDirectory
        from openrl_core.catalog import Catalog

        directory = ModelDirectory(Catalog.from_names(settings.models or None, settings.local_models, settings.model_aliases), settings.model_cache)
        for name in directory.catalog.names():
            line = name
            if args.prepare:
                files = directory.files(name)
                line += f"  {files.arch}  vocab={files.vocab_size}  {files.path}"
            print(line)
        return 0
    return 2


def _replay(settings, into: str | None) -> int:
    import tempfile

    from eventing.replay import replay
    from eventing.store.event_store import EventStore
    from eventing.store.queries import Projections
    from functions.runtime import Runtime

    live = Runtime(settings)
    with tempfile.TemporaryDirectory() as scratch:
        from eventing.store import database

        engine = database.make_engine(into or f"sqlite:///{scratch}/replay.db")
        database.upgrade(engine)
        report = replay(live.store, live.projections, EventStore(engine, live.codec), Projections(engine))
        engine.dispose()
    live.close()
    print(f"replayed {report.events} events in {report.seconds:.2f} s ({report.events_per_second:.0f} events/s)")
    for line in report.differences[:50]:
        print("  " + line)
    print("projections match" if not report.differences else f"{len(report.differences)} differences")
    return 0 if not report.differences else 1


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
