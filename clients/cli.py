"""streamsess: a command-line client for streaming-input sessions.

    streamsess run transcript.txt        # each line is a chunk; answers stream to stdout
    tail -f live.txt | streamsess run    # a live transcript, chunk by chunk
    streamsess list | show ID | transcript ID | close ID

Per-chunk figures (time to first token, tokens, where the prompt's KV came from)
and progress go to stderr, so stdout holds only the model's answers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any

from clients._common import API_KEY_ENV, BASE_URL_ENV, ChunkReply
from clients.errors import StreamsessError
from clients.sync_client import Session, SessionsClient


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamsess", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", help=f"server URL (default ${BASE_URL_ENV} or http://127.0.0.1:8000)")
    parser.add_argument("--api-key", help=f"bearer key (default ${API_KEY_ENV})")
    parser.add_argument("--timeout", type=float, default=None, help="seconds to wait for the server")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="send each line of a file or stdin as a chunk")
    run.add_argument("file", nargs="?", help="input file (default: stdin)")
    run.add_argument("--session", help="continue this session instead of opening one")
    run.add_argument("--transport", choices=("rest", "websocket"), default="rest")
    run.add_argument("--max-tokens", type=int, default=32, help="tokens to generate after each chunk")
    run.add_argument("--temperature", type=float, default=None)
    run.add_argument("--keep", action="store_true", help="leave the session open at the end (always so with --session)")
    run.add_argument("--quiet", action="store_true", help="no per-chunk figures on stderr")

    commands.add_parser("list", help="list your open sessions")
    for name, text in (
        ("show", "a session's state"),
        ("transcript", "a session's context"),
        ("close", "close a session"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("session_id")
    return parser


def chunks_from(lines: Iterable[str]) -> Iterator[str]:
    for line in lines:
        text = line.rstrip("\n")
        if text.strip():
            yield text + "\n"


def describe_reply(reply: ChunkReply, position: str, ttft_s: float | None, elapsed_s: float) -> str:
    details = reply.usage.prompt_tokens_details
    ttft = f"{ttft_s * 1000:.0f} ms" if ttft_s is not None else "-"
    rate = len(reply.token_ids) / elapsed_s if elapsed_s > 0 else 0.0
    return (
        f"[{position}] ttft {ttft}, {len(reply.token_ids)} tokens ({rate:.0f} tok/s) | "
        f"prompt {reply.usage.prompt_tokens}: device {details.device_tokens}, "
        f"cpu tier {details.cpu_tier_tokens}, computed {details.computed_tokens}"
    )


def run_session(
    session: Session, chunks: Iterable[str], total: int | None, args: argparse.Namespace, out: IO[str], err: IO[str]
) -> int:
    options: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    started = time.monotonic()
    count = 0
    for count, chunk in enumerate(chunks, start=1):
        sent = time.monotonic()
        first: float | None = None
        for delta in session.stream(chunk, **options):
            if first is None:
                first = time.monotonic() - sent
            out.write(delta.text)
            out.flush()
        out.write("\n")
        out.flush()
        reply = session.last_reply
        if reply is not None and not args.quiet:
            position = f"{count}/{total} {100 * count / total:.0f}%" if total else str(count)
            err.write(describe_reply(reply, position, first, time.monotonic() - sent) + "\n")
            err.flush()
    if not args.quiet:
        err.write(f"{count} chunks in {time.monotonic() - started:.1f}s, session {session.id}\n")
    return 0


def main(argv: list[str] | None = None, out: IO[str] = sys.stdout, err: IO[str] = sys.stderr) -> int:
    args = build_parser().parse_args(argv)
    try:
        with SessionsClient(args.base_url, args.api_key, timeout=args.timeout) as client:
            if args.command == "list":
                for info in client.sessions.list():
                    out.write(f"{info.id}\t{info.status}\t{info.num_chunks} chunks\t{info.num_tokens} tokens\n")
                return 0
            if args.command == "show":
                out.write(client.sessions.retrieve(args.session_id).model_dump_json(indent=2) + "\n")
                return 0
            if args.command == "transcript":
                out.write(client.sessions.transcript(args.session_id).text + "\n")
                return 0
            if args.command == "close":
                client.sessions.delete(args.session_id)
                out.write(json.dumps({"id": args.session_id, "deleted": True}) + "\n")
                return 0
            total = None
            if args.file:
                with open(args.file, encoding="utf-8") as handle:
                    lines = handle.readlines()
                total = sum(1 for _ in chunks_from(lines))
                source: Iterable[str] = lines
            else:
                source = sys.stdin
            if args.session:
                session = client.sessions.attach(args.session, transport=args.transport)
            else:
                session = client.sessions.create(transport=args.transport)
            try:
                return run_session(session, chunks_from(source), total, args, out, err)
            finally:
                # A session we opened closes with us; one we attached to is the caller's.
                if args.keep or args.session:
                    err.write(f"session {session.id} left open\n")
                else:
                    session.close()
    except StreamsessError as exc:
        err.write(f"streamsess: error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130


def entry_point() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry_point()
