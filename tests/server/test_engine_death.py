"""A dead engine, for real: the EngineCore process of a running server is killed.

Every route that needs the engine answers 503 engine_dead in the OpenAI shape,
/health answers 503, and then the server exits with status 3, so a supervisor
(compose's restart policy) restarts it; the durable session is there again after.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.common import app_server, free_port
from tests.server.test_errors import assert_openai_error

pytestmark = pytest.mark.server


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def test_a_killed_engine_gives_503s_then_the_server_exits_to_be_restarted(tmp_path: Path) -> None:
    port = free_port()
    settings = {"state_dir": str(tmp_path / "state"), "kv_cache_gib": "0.25", "cpu_tier_gib": "0.5",
                "max_num_seqs": "8", "engine_dead_exit_delay_s": "20", "log_level": "info"}
    with app_server("dying", tmp_path / "dying.log", settings, port=port) as server, \
            httpx.Client(base_url=server.base_url, timeout=30) as http:
        session_id = http.post("/v1/sessions", json={"defaults": {"temperature": 0}}).json()["id"]
        assert http.post(f"/v1/sessions/{session_id}/chunks", json={"input": [1, 2, 3], "max_tokens": 2}).status_code == 200
        engines = children(server.process.pid)
        assert engines, "the server has no engine process"
        for pid in engines:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while http.get("/health").status_code != 503:
            assert time.monotonic() < deadline, "health never noticed the dead engine"
            time.sleep(0.2)
        assert_openai_error(http.post("/v1/sessions"), 503, "engine_dead")
        assert_openai_error(
            http.post(f"/v1/sessions/{session_id}/chunks", json={"input": [4], "max_tokens": 1}), 503, "engine_dead"
        )
        assert_openai_error(
            http.post("/v1/completions", json={"model": "embedded-tiny", "prompt": [1], "max_tokens": 1}),
            503, "engine_dead",
        )
        assert server.process.wait(timeout=120) == 3
    log = (tmp_path / "dying.log").read_text(errors="replace")
    assert "the engine has died" in log

    with app_server("restarted", tmp_path / "restarted.log", settings, port=port) as server, \
            httpx.Client(base_url=server.base_url, timeout=30) as http:
        state = http.get(f"/v1/sessions/{session_id}").json()
        assert (state["status"], state["num_chunks"]) == ("parked", 1)
        assert http.post(f"/v1/sessions/{session_id}/chunks", json={"input": [4], "max_tokens": 1}).status_code == 200
