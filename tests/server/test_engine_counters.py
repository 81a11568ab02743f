"""vLLM's own counters count a session's chunks (connectors/streaming_stats.py), from one
real server process: after a session's chunks, ``/metrics`` has grown by the prompt
tokens they computed, the tokens they generated, and one finished request each.

Oracle: the chunks' own usage, as the server answered it (``computed_tokens`` is what
the chunk's prefill computed: the scheduler's figure for a new request, the chunk's new
tokens on a live one), against vLLM's counters read before and after. Negative
control: the same run with the plugin left out of ``VLLM_PLUGINS`` must disagree
(vLLM 0.32 counts a streaming-input request's prompt once, and none of its chunks as
requests), so this test can fail."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.servers import app_server

pytestmark = pytest.mark.server

CHUNKS = [
    "The meeting opened with the budget",
    " then moved on to hiring plans for the spring",
    " and closed with questions",
    " from the floor about the new office",
    " and its lease",
]
# Every general plugin this project installs but the one under test.
WITHOUT_STATS_PLUGIN = "streamsess_cpu_platform,streamsess_streaming_grammar"


def counters(http: httpx.Client) -> dict[str, float]:
    """vLLM's counters that a chunk should move, summed over their labels but one."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_by_source_total":
                key = f"prompt_{sample.labels['source']}"
            elif sample.name in (
                "vllm:prompt_tokens_total",
                "vllm:generation_tokens_total",
                "vllm:request_success_total",
                "vllm:e2e_request_latency_seconds_count",
            ):
                key = sample.name.removeprefix("vllm:")
            else:
                continue
            found[key] = found.get(key, 0.0) + sample.value
    return found


@pytest.mark.parametrize("plugin", [True, False], ids=["counted", "negative-control-unpatched"])
def test_session_chunks_move_vllms_counters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plugin: bool) -> None:
    if not plugin:
        monkeypatch.setenv("VLLM_PLUGINS", WITHOUT_STATS_PLUGIN)
    with app_server(f"counters-{plugin}", tmp_path / "server.log", {}) as server:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            session = http.post("/v1/sessions", json={"defaults": {"max_tokens": 3, "temperature": 0}}).json()["id"]
            before = counters(http)
            usages = []
            for text in CHUNKS:
                answer = http.post(f"/v1/sessions/{session}/chunks", json={"input": text})
                assert answer.status_code == 200, answer.text
                usages.append(answer.json()["usage"])
            generated = sum(usage["completion_tokens"] for usage in usages)
            # vLLM records an iteration's statistics just after it hands the outputs on,
            # so the last answer can reach us first: all are recorded together, and the
            # generation counter (right with or without the plugin) says when.
            deadline = time.monotonic() + 10
            while (after := counters(http))["generation_tokens_total"] - before[
                "generation_tokens_total"
            ] < generated and time.monotonic() < deadline:
                time.sleep(0.1)
    grown = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    computed = sum(usage["prompt_tokens_details"]["computed_tokens"] for usage in usages)
    first_cached = usages[0]["prompt_tokens"] - usages[0]["prompt_tokens_details"]["computed_tokens"]
    seen = (
        f"server {grown}; chunks computed {computed} prompt tokens (the first had {first_cached} cached), "
        f"generated {generated}, {len(CHUNKS)} chunks"
    )
    print(f"\n{seen}")
    assert grown["generation_tokens_total"] == generated, seen  # right with or without the plugin
    counted = (
        grown["prompt_local_compute"] == computed
        and grown["prompt_tokens_total"] == computed + first_cached
        and grown["request_success_total"] == len(CHUNKS)
        and grown["e2e_request_latency_seconds_count"] == len(CHUNKS)
    )
    assert counted is plugin, seen
