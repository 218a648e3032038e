"""The Kubernetes commands of the `openrl` CLI: `deploy` (and `deploy status|delete`), `scheduler`, `function`.

`functions/cli.py` calls `add_commands` to register them and `run` to execute one; they
live here so the deployment's flags stay beside the code that uses them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

COMMANDS = ("deploy", "scheduler", "function")
# The functions served under the Knative Functions Python runtime, by the name `openrl function` takes.
FUNCTIONS = {
    "gateway": "functions.gateway.app",
    "audit": "functions.audit",
    "metrics": "functions.metrics",
    "projector": "functions.projector",
    "dead-letters": "functions.deadletters",
}


def add_commands(commands) -> None:
    deploy = commands.add_parser(
        "deploy", help="render the Kubernetes manifests and apply them (or --dry-run to print)"
    )
    deploy.add_argument("action", nargs="?", choices=("apply", "status", "delete"), default="apply",
                        help="apply (default), status: what is deployed and whether it is ready, delete: remove it")  # fmt: skip
    deploy.add_argument("--namespace", default="openrl")
    deploy.add_argument("--image", default=None, help="the OpenRL image, e.g. registry.example/openrl:0.1.0")
    deploy.add_argument("--base-model", action="append", default=None, help="a base model to serve (repeatable)")
    deploy.add_argument("--overlay", action="append", default=None,
                        help="single-node, distributed (default) or gpu; plus topics (repeatable)")  # fmt: skip
    deploy.add_argument("--tenant", action="append", default=None,
                        help="a tenant whose topics the audit and metrics KafkaSources read (default: OPENRL_API_KEYS's)")  # fmt: skip
    deploy.add_argument("--kafka-bootstrap", default=None, help="Kafka bootstrap servers as the cluster reaches them")
    deploy.add_argument(
        "--kafka-cluster", default=None, help="Strimzi cluster name for --overlay topics (default kafka)"
    )
    deploy.add_argument(
        "--external-database", action="store_true", help="no in-cluster PostgreSQL: use the Secret's URL"
    )
    deploy.add_argument("--scheduler-policy", default=None, help="binpack (default) or spread")
    deploy.add_argument(
        "--manifests", type=Path, default=None, help="the knative/ directory (default: this checkout's)"
    )
    deploy.add_argument("--dry-run", action="store_true", help="print the manifests as YAML; talk to no cluster")
    deploy.add_argument("--wait", type=float, default=0, metavar="SECONDS",
                        help="after applying, wait this long for every Knative Service to be Ready")  # fmt: skip
    deploy.add_argument("--kubeconfig", default=None)
    deploy.add_argument("--context", default=None)

    scheduler = commands.add_parser(
        "scheduler", help="place and scale trainer/sampler StatefulSets (runs in the cluster)"
    )
    scheduler.add_argument(
        "--templates", type=Path, default=Path("/etc/openrl/workers"), help="worker templates directory"
    )
    scheduler.add_argument("--once", action="store_true", help="reconcile once and print what changed")
    scheduler.add_argument("--kubeconfig", default=None)

    function = commands.add_parser("function", help="serve one function under the Knative Functions Python runtime")
    function.add_argument("name", choices=sorted(FUNCTIONS))


def run(args: argparse.Namespace) -> int:
    from functions.deploy.errors import ClusterError, DeployConfigError

    try:
        if args.command == "deploy":
            return _deploy(args)
        if args.command == "scheduler":
            return _scheduler(args)
        if args.command == "function":
            return _function(args.name)
    except (DeployConfigError, ClusterError) as exc:
        print(f"openrl {args.command}: {exc.detail}", file=sys.stderr)
        return 2
    return 2


def _deploy(args) -> int:
    from functions.deploy import apply as applying
    from functions.deploy.config import checked
    from functions.deploy.kube import KubernetesApi
    from functions.deploy.render import render

    if args.action in ("status", "delete"):
        api = KubernetesApi.connect(args.kubeconfig, args.context)
        if args.action == "status":
            rows = applying.status(api, args.namespace)
            for kind, name, state in rows:
                print(f"{kind:22} {name:48} {state}")
            print(f"{len(rows)} object(s) of OpenRL in namespace {args.namespace}")
        else:
            for change in applying.delete(api, args.namespace):
                print(change)
        return 0
    config = checked(
        image=args.image, namespace=args.namespace, base_models=args.base_model, overlays=args.overlay,
        tenants=args.tenant, kafka_bootstrap=args.kafka_bootstrap, kafka_cluster=args.kafka_cluster,
        external_database=args.external_database or None, scheduler_policy=args.scheduler_policy or "binpack",
        manifests=args.manifests,
    )  # fmt: skip
    objects = render(config)
    if args.dry_run:
        sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
        return 0
    api = KubernetesApi.connect(args.kubeconfig, args.context)
    applying.preflight(api, config)
    for change in applying.apply(api, objects):
        print(change)
    if args.wait > 0:
        from functions.deploy.knative import KnativeServing

        serving = KnativeServing(api.client, config.namespace)
        for obj in objects:
            if obj["apiVersion"].startswith("serving.knative.dev/"):
                serving.wait_ready(obj["metadata"]["name"], timeout=args.wait)
                print(f"ready     KnativeService/{obj['metadata']['name']}")
    return 0


def _scheduler(args) -> int:
    from functions.deploy.kube import KubernetesApi
    from functions.scheduler.controller import Scheduler
    from openrl_core.settings import Settings

    settings = Settings()
    scheduler = Scheduler.from_settings(settings, KubernetesApi.connect(args.kubeconfig), args.templates)
    if args.once:
        for line in scheduler.reconcile().lines():
            print(line)
        scheduler.close()
        return 0
    scheduler.serve_forever()
    return 0


def _function(name: str) -> int:
    import importlib

    from func_python.http import serve

    # func-python serves `new` itself: start(os.environ) on startup, /health/liveness and
    # /health/readiness from alive()/ready(), everything else to handle().
    return serve(importlib.import_module(FUNCTIONS[name]).new) or 0
