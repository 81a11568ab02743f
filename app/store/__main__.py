"""``python -m app.store migrate [URL]``: bring the session store's schema to the newest
version, then exit: the database migration as a step of its own (a Kubernetes Job before
a rollout). Each replica also migrates at its start, under PostgreSQL's advisory lock, so
the step is for operators who want the schema change to fail before any replica moves.
URL: ``STREAMSESS_STORE_URL`` when omitted."""

from __future__ import annotations

import argparse
import asyncio
import os

from app.store.sql import SQLSessionStore


async def migrate(url: str) -> None:
    store = SQLSessionStore(url)
    try:
        await store.start()  # migrates to the newest version
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.store", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("migrate", help="bring the store's schema to the newest version")
    command.add_argument(
        "url",
        nargs="?",
        default=os.environ.get("STREAMSESS_STORE_URL") or None,
        help="sqlite:///path or postgresql://user:password@host/db",
    )
    args = parser.parse_args(argv)
    if not args.url:
        parser.error("no store URL: give one or set STREAMSESS_STORE_URL")
    asyncio.run(migrate(args.url))
    print("session store: schema at the newest version")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
