"""Write a new Alembic revision by autogenerating against a scratch SQLite database.

Usage: python -m eventing.store.revision "message"
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from alembic import command

from eventing.store.database import alembic_config, make_engine, upgrade


def main() -> None:
    message = sys.argv[1] if len(sys.argv) > 1 else "change"
    with tempfile.TemporaryDirectory() as scratch:
        engine = make_engine(f"sqlite:///{Path(scratch) / 'scratch.db'}")
        upgrade(engine)
        command.revision(alembic_config(engine), message=message, autogenerate=True)


if __name__ == "__main__":
    main()
