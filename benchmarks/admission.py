"""What admission's device estimate costs a chunk as open sessions grow, against the walk
it replaced.

Every chunk's admission estimates what the device holds (``DeviceCapacity.load``):
our sessions' reservations plus vLLM's request states for every other request. It
walked every open session; it now walks the registry's ``device_holders``, the
sessions whose ``device_tokens`` are not 0 (kept by each session as its count
changes). Here: ``--on-device`` sessions hold the device and the rest are parked (as
on a server with many idle sessions), real ``StreamingSession`` objects, and as many
engine request states as sessions on the device; per count of open sessions, the
median time of one estimate both ways, and their ratio. No engine: the estimate reads
only the API process's state.

    python -m benchmarks.admission            # 10 to 10,000 open sessions, 32 on the device
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from types import SimpleNamespace
from typing import Any

from app.protocol import SessionDefaults
from app.sessions.admission import DeviceCapacity, DeviceLoad
from app.sessions.session import StreamingSession
from benchmarks.common import finish, pyplot

REPEATS = 200


def sessions_and_engine(open_sessions: int, on_device: int) -> tuple[dict[str, StreamingSession], Any]:
    holders: set[StreamingSession] = set()
    held = {}
    for index in range(open_sessions):
        session = StreamingSession(
            f"sess_{index}", "owner", "model", None, SessionDefaults(), {}, 4096, device_holders=holders
        )
        session.device_tokens = 700 if index < on_device else 0  # the rest parked
        held[session.id] = session
    states = {
        name: SimpleNamespace(external_req_id=name, request_id=name, prompt_len=700, max_tokens_param=16)
        for name in list(held)[:on_device]
    }
    return held, SimpleNamespace(output_processor=SimpleNamespace(request_states=states))


def median_us(estimate: Any) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter_ns()
        estimate()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def measure(open_sessions: int, on_device: int) -> dict[str, float]:
    capacity = DeviceCapacity(slots=256, blocks=100_000, block_size=16)
    held, engine = sessions_and_engine(open_sessions, on_device)
    holders = next(iter(held.values())).device_holders

    # The walk before, over every open session (it built a set of their ids as well, so
    # it cost a little more than this).
    def every_session() -> DeviceLoad:
        return capacity.load(engine, [s for s in held.values() if s.device_tokens], held)

    def device_holders() -> DeviceLoad:
        return capacity.load(engine, holders, held)

    assert every_session() == device_holders()  # the same estimate, whichever walk
    before, after = median_us(every_session), median_us(device_holders)
    return {"every_session_us": before, "device_holders_us": after, "ratio": before / after}


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 4))
    counts = [int(n) for n in result["per_open_sessions"]]
    for key, label in (("every_session_us", "every open session (before)"), ("device_holders_us", "device holders")):
        axis.plot(counts, [row[key] for row in result["per_open_sessions"].values()], marker="o", label=label)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel(f"open sessions ({result['settings']['on_device']} on the device, the rest parked)")
    axis.set_ylabel("one admission estimate, median (us)")
    axis.grid(True, alpha=0.3)
    axis.legend()
    return figure


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--open-sessions", type=int, nargs="+", default=[10, 100, 1000, 10_000])
    parser.add_argument("--on-device", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true", help="small counts (the test suite's smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.open_sessions, args.on_device = [10, 1000], 8
        return "admission-quick", args
    return "admission", args


async def run(name: str, args: argparse.Namespace) -> None:
    result = {
        "settings": {"on_device": args.on_device, "repeats": REPEATS},
        "per_open_sessions": {str(n): measure(n, min(args.on_device, n)) for n in args.open_sessions},
    }
    finish(name, result, args.out, plot)
    for count, row in result["per_open_sessions"].items():
        print(
            f"{count} open: every session {row['every_session_us']:.1f} us, device holders "
            f"{row['device_holders_us']:.1f} us ({row['ratio']:.1f}x)"
        )


def main() -> None:
    asyncio.run(run(*parse_args()))


if __name__ == "__main__":
    main()
