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

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from openrl_core.settings import Settings

    overrides = {
        key: value
        for key, value in {"host": getattr(args, "host", None), "port": getattr(args, "port", None),
                           "data_dir": getattr(args, "data_dir", None), "models": getattr(args, "model", None)}.items()
        if value is not None
    }  # fmt: skip
    settings = Settings(**overrides)
    if args.command == "serve":
        from functions.serve import EmbeddedServer

        server = EmbeddedServer(settings)
        print(f"openrl: serving {', '.join(server.runtime.catalog.names())} on http://{settings.host}:{settings.port}", flush=True)
        server.serve_forever()
        return 0
    if args.command == "models":
        from functions.compute.models import ModelDirectory
        from openrl_core.catalog import Catalog

        directory = ModelDirectory(Catalog.from_names(settings.models or None, settings.local_models), settings.model_cache)
        for name in directory.catalog.names():
            line = name
            if args.prepare:
                files = directory.files(name)
                line += f"  {files.arch}  vocab={files.vocab_size}  {files.path}"
            print(line)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
