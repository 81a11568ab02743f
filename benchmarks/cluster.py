"""Benchmark: agents on two replicas behind HAProxy, one replica restarted midway.

AGENTS agents each hold a TURNS-turn conversation with a tool-like pause between turns,
streamed, through a proxy in front of two replicas; when half the turns are done, one
replica gets SIGTERM and starts again. Per turn: the prompt tokens the replica computed,
what the turn added to the context (its input and the template's framing), and the
time to first token. Three sides, one after the other, on the same engine settings:

- ours-keyed: our server, two replicas sharing PostgreSQL; Responses chains
  (``previous_response_id``); HAProxy routing by each conversation's key
  (docker/haproxy/haproxy.cfg as shipped);
- ours-old-routing: the same, HAProxy hashing only the session API's paths (the rule
  before the key): a chain's turns go to the least busy replica;
- ours-old-configuration: that routing on replicas with a disk tier each, not shared
  (the deployment before either): a turn on another replica recomputes its history;
- vllm-least-busy: two ``vllm serve`` servers with prefix caching behind HAProxy sending
  every request to the least busy one, each agent re-sending its whole conversation
  on /v1/chat/completions (what a client of a stateless server does).

    python -m benchmarks.cluster                 # bench model, 16 agents x 12 turns
    python -m benchmarks.cluster --quick         # tiny model, the smoke run's size

Writes benchmarks/results/cluster.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    API_HEADERS,
    EngineSetup,
    RunningServer,
    app_server,
    benchmark_parser,
    finish,
    our_settings,
    plot_ttft_per_turn,
    quick_engine,
    vllm_server,
    word_text,
)
from tests.harness.haproxy import Restartable, Routing, haproxy, start_together
from tests.harness.postgres import postgres_server

SIDES: dict[str, tuple[str, Routing]] = {
    "ours-keyed": ("ours", "keyed"),
    "ours-old-routing": ("ours", "session-paths"),
    "ours-old-configuration": ("ours", "session-paths"),
    "vllm-least-busy": ("vllm", "least-busy"),
}


class Progress:
    """Turns done by every agent; ``halfway`` is set at half of them."""

    def __init__(self, total: int) -> None:
        self.done, self.total = 0, total
        self.halfway = asyncio.Event()

    def step(self) -> None:
        self.done += 1
        if self.done >= self.total // 2:
            self.halfway.set()


class Agent:
    """One conversation: its turns' texts, and what each turn measured."""

    def __init__(self, texts: list[str], stateful: bool) -> None:
        self.texts, self.stateful = texts, stateful
        self.turns: list[dict[str, float]] = []
        self.previous: str | None = None  # ours: the chain's latest response
        self.messages: list[dict[str, str]] = []  # vLLM: the whole conversation, re-sent
        self.retries = 0
        self.errors: list[str] = []
        self.replicas: list[str] = []  # who answered each turn (X-Replica; vLLM's servers send none)

    async def turn(self, http: httpx.AsyncClient, model: str, text: str, gen: int) -> None:
        before = self.turns[-1] if self.turns else None
        start = time.perf_counter()
        first: float | None = None
        if self.stateful:
            body: dict[str, Any] = {
                "model": model,
                "input": text,
                "max_output_tokens": gen,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "previous_response_id": self.previous,
            }
            path = "/v1/responses"
        else:
            self.messages.append({"role": "user", "content": text})
            body = {
                "model": model,
                "messages": self.messages,
                "max_tokens": gen,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            path = "/v1/chat/completions"
        reply, usage = [], {}
        async with http.stream("POST", path, json=body) as stream:
            if stream.status_code != 200:
                raise RuntimeError(f"{stream.status_code}: {(await stream.aread())[:300]!r}")
            replica = stream.headers.get("x-replica", "")
            async for line in stream.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if self.stateful:
                    if event["type"] == "response.output_text.delta" and first is None:
                        first = time.perf_counter() - start
                    if event["type"] in ("response.completed", "response.incomplete"):
                        self.previous = event["response"]["id"]
                        details = event["response"]["usage"]
                        usage = {
                            "prompt": details["input_tokens"],
                            "output": details["output_tokens"],
                            "computed": details["input_tokens_details"]["computed_tokens"],
                        }
                else:
                    for choice in event.get("choices") or []:
                        piece = choice["delta"].get("content") or ""
                        if piece and first is None:
                            first = time.perf_counter() - start
                        reply.append(piece)
                    if event.get("usage"):
                        details = event["usage"]
                        cached = (details.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                        usage = {
                            "prompt": details["prompt_tokens"],
                            "output": details["completion_tokens"],
                            "computed": details["prompt_tokens"] - cached,
                        }
        if not self.stateful:
            self.messages.append({"role": "assistant", "content": "".join(reply)})
        if not usage:  # cut short (a replica stopping): sent again
            raise RuntimeError("the stream ended without usage")
        added = usage["prompt"] - (before["prompt"] + before["output"] if before else 0)
        self.turns.append(
            {
                "ttft_s": first if first is not None else time.perf_counter() - start,
                "prompt": usage["prompt"],
                "output": usage["output"],
                "computed": usage["computed"],
                "added": added,
                "moved": float(bool(self.replicas) and replica != self.replicas[-1]),
            }
        )
        self.replicas.append(replica)

    async def run(self, base_url: str, model: str, gen: int, pause_s: float, progress: Progress) -> None:
        async with httpx.AsyncClient(base_url=base_url, headers=API_HEADERS, timeout=600) as http:
            for text in self.texts:
                while True:
                    try:
                        await self.turn(http, model, text, gen)
                        break
                    except (RuntimeError, httpx.TransportError) as exc:
                        # A replica going away mid-turn: sent again (ours undid it; vLLM's has no state).
                        self.retries += 1
                        self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                        if not self.stateful:
                            self.messages.pop()
                        await asyncio.sleep(0.5)
                progress.step()
                await asyncio.sleep(pause_s)


async def run_side(
    label: str,
    base_url: str,
    model: str,
    restarted: Restartable,
    args: argparse.Namespace,
    conversations: list[list[str]],
) -> dict[str, Any]:
    agents = [Agent(texts, stateful=label.startswith("ours")) for texts in conversations]
    progress = Progress(len(agents) * args.turns)
    tasks = [asyncio.create_task(agent.run(base_url, model, args.gen, args.pause, progress)) for agent in agents]
    await progress.halfway.wait()
    restart_started = time.perf_counter()
    status = await asyncio.to_thread(restarted.sigterm_and_wait)
    await asyncio.to_thread(restarted.start)
    restart_s = time.perf_counter() - restart_started
    await asyncio.gather(*tasks)
    return summarize(agents, args.turns, {"restart_s": restart_s, "restarted_exit_status": status})


def summarize(agents: list[Agent], turns: int, extra: dict[str, Any]) -> dict[str, Any]:
    later = [turn for agent in agents for turn in agent.turns[1:]]
    last = [agent.turns[-1]["ttft_s"] for agent in agents]
    return {
        **extra,
        "retries": sum(agent.retries for agent in agents),
        "errors": sorted({error for agent in agents for error in agent.errors}),
        "turns_on_another_replica": sum(t["moved"] for t in later),
        "turns": len(later) + len(agents),
        "computed_per_turn": statistics.mean(t["computed"] for t in later),
        "added_per_turn": statistics.mean(t["added"] for t in later),
        "computed_over_added": sum(t["computed"] for t in later) / sum(t["added"] for t in later),
        "ttft_p50_s": percentile([t["ttft_s"] for t in later], 50),
        "ttft_p99_s": percentile([t["ttft_s"] for t in later], 99),
        f"turn_{turns}_ttft_p50_s": percentile(last, 50),
        f"turn_{turns}_ttft_p99_s": percentile(last, 99),
        "per_turn": [
            {
                key: statistics.median(agent.turns[i][key] for agent in agents)
                for key in ("ttft_s", "prompt", "computed", "added")
            }
            for i in range(turns)
        ],
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def replica_settings(setup: EngineSetup, name: str, store_url: str, shared_tier: Path | None) -> dict[str, str]:
    # A state directory of its own: a replica restarted keeps its instance (and is never a
    # pooled server of the smoke run, which a restart would stop under the pool).
    settings = {
        **our_settings(setup),
        "replica_name": name,
        "replica_id": name,
        "store_url": store_url,
        "shared_store_required": "true",
        "state_dir": tempfile.mkdtemp(prefix=f"streamsess-{name}-"),
    }
    settings |= {"disk_tier_gib": "4", "cache_salt_secret": "cluster-bench-secret"}
    if shared_tier is not None:  # a conversation moved by the restart resumes from the other's files
        settings |= {"disk_tier_dir": str(shared_tier), "disk_tier_shared": "true"}
    return settings  # else a disk tier of its own, in its state directory


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    setup = EngineSetup(
        preset=args.preset, kv_cache_gib=args.kv_cache_gib, cpu_tier_gib=args.cpu_tier_gib, dtype=args.dtype
    )
    rng = random.Random(args.seed)

    def text() -> str:
        return word_text(rng, args.chunk)

    model = f"embedded-{setup.preset}"
    workdir = Path(tempfile.mkdtemp(prefix="streamsess-cluster-"))
    log_dir = Path(args.out) / "logs"
    sides: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        database = stack.enter_context(postgres_server())

        def our_replica(name: str, shared_tier: bool) -> Restartable:
            settings = replica_settings(setup, name, database.url, workdir / "shared-tier" if shared_tier else None)

            def starting(port: int, start: int) -> contextlib.AbstractContextManager[RunningServer]:
                return app_server(name, log_dir / f"cluster-{name}-{start}.log", settings, port=port, model=model)

            return Restartable(name, starting)

        # One pair of replicas a configuration, the other pair stopped: they never share the CPUs.
        configurations: list[tuple[bool, tuple[str, ...]]] = [
            (bool(args.shared_tier), ("ours-keyed", "ours-old-routing"))
        ]
        if args.old_configuration:
            configurations.append((False, ("ours-old-configuration",)))
        for shared, labels in configurations:
            with contextlib.ExitStack() as pair:
                names = ("replica-a", "replica-b") if shared else ("replica-c", "replica-d")  # ids not reused
                ours = [our_replica(name, shared) for name in names]
                start_together(pair, ours)
                for label in labels:
                    conversations = [[text() for _ in range(args.turns)] for _ in range(args.agents)]
                    with haproxy({r.name: r.port for r in ours}, workdir, SIDES[label][1]) as proxy:
                        sides[label] = await run_side(label, proxy, model, ours[1], args, conversations)
                    print(label, {k: v for k, v in sides[label].items() if k != "per_turn"}, flush=True)
    if not args.skip_vllm:  # the peer: two vLLM servers, a client re-sending its history
        with contextlib.ExitStack() as stack:

            def vllm_peer(name: str) -> Restartable:
                def starting(port: int, start: int) -> contextlib.AbstractContextManager[RunningServer]:
                    return vllm_server(
                        setup,
                        log_dir,
                        prefix_caching=True,
                        extra_args=["--enable-prompt-tokens-details"],
                        label=f"cluster-{name}-{start}",
                        port=port,
                    )

                return Restartable(name, starting)

            peers = [vllm_peer(name) for name in ("vllm-a", "vllm-b")]
            start_together(stack, peers)
            conversations = [[text() for _ in range(args.turns)] for _ in range(args.agents)]
            with haproxy({p.name: p.port for p in peers}, workdir, "least-busy", check_path="/health") as proxy:
                sides["vllm-least-busy"] = await run_side(
                    "vllm-least-busy", proxy, model, peers[1], args, conversations
                )
            print("vllm-least-busy", {k: v for k, v in sides["vllm-least-busy"].items() if k != "per_turn"}, flush=True)
    last = f"turn_{args.turns}_ttft_p50_s"
    return {
        "settings": {
            **setup.describe(),
            "agents": args.agents,
            "turns": args.turns,
            "chunk_tokens": args.chunk,
            "gen_tokens": args.gen,
            "pause_s": args.pause,
            "seed": args.seed,
            "shared_disk_tier": args.shared_tier,
            "restart": "replica 2 of 2 gets SIGTERM and starts again when half the turns are done",
        },
        "summary": {
            "computed_over_added": {side: result["computed_over_added"] for side, result in sides.items()},
            last: {side: result[last] for side, result in sides.items()},
            f"turn_{args.turns}_ttft_p99_s": {
                side: result[f"turn_{args.turns}_ttft_p99_s"] for side, result in sides.items()
            },
            "keyed_vs_old_routing_last_turn_ttft_p50": sides["ours-keyed"][last] / sides["ours-old-routing"][last],
            "keyed_vs_old_configuration_last_turn_ttft_p50": sides["ours-keyed"][last]
            / sides["ours-old-configuration"][last]
            if "ours-old-configuration" in sides
            else None,
            "keyed_vs_vllm_last_turn_ttft_p50": sides["ours-keyed"][last] / sides["vllm-least-busy"][last]
            if "vllm-least-busy" in sides
            else None,
        },
        "sides": sides,
    }


def plot(result: dict[str, Any]) -> Any:
    settings = result["settings"]
    return plot_ttft_per_turn(
        {side: data["per_turn"] for side, data in result["sides"].items()},
        f"{settings['agents']} agents x {settings['turns']} turns, 2 replicas, one restarted midway\n"
        f"({settings['model_preset']} model; TTFT median over agents)",
    )


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    parser = benchmark_parser(__doc__, kv_cache_gib=1.0)
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--chunk", type=int, default=64, help="new tokens per turn, about")
    parser.add_argument("--gen", type=int, default=16, help="tokens generated per turn")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds between an agent's turns (its tool)")
    parser.add_argument(
        "--shared-tier",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="our replicas share a disk tier (disk_tier_shared), so a conversation the restart "
        "moves resumes from the other's files",
    )
    parser.add_argument(
        "--old-configuration",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the deployment before the key and the shared tier (ours-old-configuration)",
    )
    parser.add_argument("--skip-vllm", action="store_true", help="our sides only")
    args = parser.parse_args(argv)
    name = "cluster"
    if args.quick:
        quick_engine(args)
        args.dtype, args.agents, args.turns, args.chunk, args.gen, args.pause = "float32", 4, 4, 16, 4, 0.1
        name = "cluster-quick"
    return name, args


async def run(name: str, args: argparse.Namespace) -> None:
    finish(name, await measure(args), args.out, plot)


def main() -> None:
    asyncio.run(run(*parse_args()))


if __name__ == "__main__":
    main()
