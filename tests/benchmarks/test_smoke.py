"""Every benchmark runs at a tiny size (--quick), so the scripts keep working.

These check that each script runs end to end and writes complete results; they
assert no timings (timings are measured and recorded in docs/benchmarks.md). All the
quick runs happen in one process, ``python -m benchmarks.smoke``, which shares
engines and servers between benchmarks with the same settings (started once for the
module); each test then checks its own benchmark's result. All but one:
benchmarks.llama_cpp builds llama.cpp from source first (about 6 minutes on 2 cores),
more than the suite spends on any benchmark; it is run by hand (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("benchmarks")
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.smoke", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out, json.loads((out / "smoke.json").read_text())


def run_quick(module: str, quick_runs: tuple[Path, dict]) -> dict:
    out, index = quick_runs
    entry = index[module]
    assert "error" not in entry, entry["error"]
    written = Path(entry["result"])
    assert written.parent == out and written.with_suffix(".png").stat().st_size > 10_000
    return dict(json.loads(written.read_text()))


def test_resume_quick(quick_runs: tuple[Path, dict]) -> None:
    result = run_quick("resume", quick_runs)
    assert set(result["per_turn"]) == {"in-process", "ours-sse", "ours-ws", "vllm-prefix-on"}
    assert all(len(turns) == 3 for turns in result["per_turn"].values())
    assert result["summary"]["http_overhead_ttft_ratio_max"] > 0


def test_tier_reuse_quick(quick_runs: tuple[Path, dict]) -> None:
    result = run_quick("tier_reuse", quick_runs)
    (row,) = result["rows"]
    # The measured run really loaded from the CPU tier.
    assert row["cpu_tier_tokens"] >= 224 and row["tier_load_gbps"] > 0
    assert result["host_memcpy_gbps"] > 0


def test_concurrency_quick(quick_runs: tuple[Path, dict]) -> None:
    result = run_quick("concurrency", quick_runs)
    assert set(result["results"]) == {"ours-sse", "vllm-prefix-on"}
    for side in result["results"].values():
        assert set(side) == {"1", "2"} and all(run["generated_tokens"] > 0 for run in side.values())


def test_capacity_quick(quick_runs: tuple[Path, dict]) -> None:
    result = run_quick("capacity", quick_runs)
    assert result["errors"] == {}
    assert result["chunks_answered"] == 2 * 40 + 4
    parks = {k: v for k, v in result["metrics_at_end"].items() if k.startswith("streamsess_session_parks_total")}
    assert sum(parks.values()) > 0, result["metrics_at_end"]


def test_park_resume_quick(quick_runs: tuple[Path, dict]) -> None:
    result = run_quick("park_resume", quick_runs)
    (row,) = result["rows"]
    # The measured resume really loaded the parked session from the CPU tier.
    assert row["cpu_tier_tokens"] >= 224 and row["tier_vs_never_parked"] > 0


def test_store_quick(quick_runs: tuple[Path, dict]) -> None:
    result = run_quick("store", quick_runs)
    assert {"none", "sqlite"} <= set(result["per_chunk"])
    assert all(row["p50_s"] > 0 for row in result["per_chunk"].values())
    (row,) = result["resume"].values()
    # Each side was what it says: a tier hit, and after the restart a recompute.
    assert row["sources"]["cpu_tier"]["cpu_tier_tokens"] >= 96
    restarted = row["sources"]["restart_recompute"]
    assert restarted["cpu_tier_tokens"] == 0 and restarted["computed_tokens"] >= 96


def test_transport_quick(quick_runs: tuple[Path, dict]) -> None:
    result = run_quick("transport", quick_runs)
    assert set(result["per_side"]) == {
        "in-process",
        "in-server",
        "rest",
        "sse",
        "websocket",
        "websocket-deflate",
        "rest-httpx",
        "sse-httpx",
        "rest-bare",
        "sse-bare",
        "websocket-bare",
    }
    assert all(len(samples) == 8 for samples in result["samples_ms"].values())
    # Each side's own CPU was counted, and the bare hop's beside ours.
    assert all(row["client_cpu_ms_per_chunk"] > 0 for row in result["per_side"].values())
    for floor in ("in_process", "in_server"):
        assert result["per_side"]["rest"][f"p50_over_{floor}_and_bare_hop_ms"] is not None
    # The floor inside the server ran on its engine and counted the server's CPU.
    assert result["per_side"]["in-server"]["server_cpu_ms_per_chunk"] > 0


def test_transport_paired_quick(quick_runs: tuple[Path, dict]) -> None:
    result = run_quick("transport_paired", quick_runs)
    assert set(result["per_side"]) == {"rest", "sse", "websocket"}
    # Every measured chunk of every side was paired with the floor's around it.
    assert all(len(gaps) == 8 for gaps in result["gaps_ms"].values())
    assert result["floor_p50_ms"] > 0


def test_chunk_timeline_quick(quick_runs: tuple[Path, dict]) -> None:
    result = run_quick("chunk_timeline", quick_runs)
    # Every stamp was found along every chunk's path, in the server and the floor alike
    # (a stamp that stopped firing, or fired out of order, leaves a segment empty: NaN).
    assert len(result["rest_us"]) == 14 and len(result["floor_us"]) == 7
    for segments in (result["rest_us"], result["floor_us"]):
        assert all(value == value for value in segments.values()), segments
    assert result["rest_us"]["add1->engine"] > 0 and result["floor_us"]["add1->engine"] > 0


def test_idle_hop_quick(quick_runs: tuple[Path, dict]) -> None:
    result = run_quick("idle_hop", quick_runs)
    for side in ("rest", "websocket"):
        hops = result["hop_p50_ms"][side]
        assert set(hops) == {"0", "4"}
        # The server's wait was taken off each round trip: what is left is a hop, not the wait.
        assert all(0 < hop < 4 for hop in hops.values()), hops


def test_soak_quick(quick_runs: tuple[Path, dict]) -> None:
    result = run_quick("soak", quick_runs)
    summary = result["summary"]
    assert summary["errors"] == 0, result["errors_sample"]
    assert summary["chunks"] > 0 and summary["sessions_left_open"] == 0, result["sessions_left_open"]
    assert all(row["rss_mb"] > 0 for row in result["windows"])


def test_models_quick(quick_runs: tuple[Path, dict]) -> None:
    result = run_quick("models", quick_runs)
    (row,) = result["rows"]
    assert (row["preset"], row["dtype"]) == ("tiny", "float32")
    assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0


def test_moved_resume_quick(quick_runs: tuple[Path, dict]) -> None:
    """The moved session read its context from the files the other engine wrote; the
    own-replica resume from its CPU tier; the recompute nothing (timings not asserted)."""
    usage = run_quick("moved_resume", quick_runs)["contexts"]["128"]["usage"]
    assert usage["moved_disk"]["disk_tier_tokens"] > 0 and usage["moved_disk"]["cpu_tier_tokens"] == 0, usage
    assert usage["own_cpu_tier"]["cpu_tier_tokens"] > 0, usage
    assert usage["moved_recompute"]["cached_tokens"] == 0, usage


def test_disk_index_quick(quick_runs: tuple[Path, dict]) -> None:
    result = run_quick("disk_index", quick_runs)
    assert result["settings"]["files"] == 2000
    assert all(result[key] > 0 for key in ("ready_s", "first_hit_s", "walk_s", "warm_walk_s"))


def test_admission_quick(quick_runs: tuple[Path, dict]) -> None:
    result = run_quick("admission", quick_runs)
    assert set(result["per_open_sessions"]) == {"10", "1000"}
    assert all(
        row["every_session_us"] > 0 and row["device_holders_us"] > 0 for row in result["per_open_sessions"].values()
    )


def own_process_quick(tmp_path: Path, module: str) -> dict:
    """A quick run in a process of its own, where the smoke run's pool does not fit: the
    benchmark restarts replicas (cluster: the pool would keep a stopped server), sets its
    servers' environment (cpu_decode's LD_PRELOAD) or runs vLLM's tool on an event loop
    of its own (vllm_bench)."""
    result = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / f"{module}-quick.png").stat().st_size > 10_000
    return dict(json.loads((tmp_path / f"{module}-quick.json").read_text()))


def test_cluster_quick(tmp_path: Path) -> None:
    written = own_process_quick(tmp_path, "cluster")
    sides = written["sides"]
    assert set(sides) == {"ours-keyed", "ours-old-routing", "ours-old-configuration", "vllm-least-busy"}
    settings = written["settings"]
    for side in sides.values():
        assert side["turns"] == settings["agents"] * settings["turns"]  # every turn answered
        assert len(side["per_turn"]) == settings["turns"] and side["computed_per_turn"] > 0
    # Our replicas drain and exit cleanly when restarted.
    assert all(
        sides[side]["restarted_exit_status"] == 0
        for side in ("ours-keyed", "ours-old-routing", "ours-old-configuration")
    )


def test_cpu_decode_quick(tmp_path: Path) -> None:
    result = own_process_quick(tmp_path, "cpu_decode")
    assert set(result["rounds"]) == {"eager", "eager+packed"}
    assert all(
        len(rounds) == 2 and all(r["decode_tokens_per_s"] > 0 for r in rounds) for rounds in result["rounds"].values()
    )
    assert result["summary"]["eager"]["ratio_to_eager"] == 1.0


def test_cpu_linear_quick(tmp_path: Path) -> None:
    result = own_process_quick(tmp_path, "cpu_linear")
    kernels = {key.rsplit(" ", 1)[1] for key in result["summary"]}
    assert {"onednn", "aten"} <= kernels and ("packed" in kernels) == ("avx512f" in result["machine"]["cpu_flags"])
    assert all(row["layers_ms"] > 0 and row["head_ms"] > 0 for row in result["summary"].values())


def test_vllm_bench_quick(tmp_path: Path) -> None:
    result = own_process_quick(tmp_path, "vllm_bench")
    (key,) = result["summary"]
    assert key == "chat@inf" and result["summary"][key]["failed"] == {"ours": 0, "vllm-serve": 0}
    assert all(run[key]["completed"] == 4 and run[key]["output_throughput"] > 0 for run in result["runs"].values())
