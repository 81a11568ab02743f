"""One real server process, at the default log level, for what only a process shows.

- Log hygiene: after sessions and completions whose texts are distinctive, the
  server's whole log (ours, vLLM's, uvicorn's) holds no prompt text, no output text
  and no API key.
- A dead engine, for real: the EngineCore process is killed. Every route that needs
  the engine answers 503 engine_dead in the OpenAI shape, /health answers 503, and
  then the server exits with status 3, so a supervisor (compose's restart policy)
  restarts it; the durable session is there again after.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from tests.harness.servers import RunningServer, app_server, free_port
from tests.http.test_errors import assert_openai_error

pytestmark = pytest.mark.server

KEY = "sk-hygiene-0123456789abcdef"
PROMPT_MARKER = "zebra quartz marmalade"


@dataclass
class LoggedServer:
    server: RunningServer
    log: Path
    settings: dict[str, str]
    port: int


@pytest.fixture(scope="module")
def logged_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoggedServer]:
    workdir = tmp_path_factory.mktemp("process")
    port = free_port()
    settings = {
        "state_dir": str(workdir / "state"),
        "api_keys": KEY,
        "kv_cache_gib": "0.25",
        "cpu_tier_gib": "0.5",
        "max_num_seqs": "8",
        "engine_dead_exit_delay_s": "8",
    }
    log = workdir / "server.log"
    with app_server("process", log, settings, port=port) as server:
        yield LoggedServer(server, log, {**settings, "state_dir": str(workdir / "state")}, port)


def client(server: RunningServer) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_the_log_holds_no_prompt_output_or_key(logged_server: LoggedServer) -> None:
    outputs = []
    with client(logged_server.server) as http:
        session_id = http.post("/v1/sessions", json={"defaults": {"temperature": 0, "ignore_eos": True}}).json()["id"]
        reply = http.post(f"/v1/sessions/{session_id}/chunks", json={"input": f"{PROMPT_MARKER} one", "max_tokens": 12})
        assert reply.status_code == 200, reply.text
        outputs.append(reply.json()["output"]["text"])
        completion = http.post(
            "/v1/completions",
            json={"model": "embedded-tiny", "prompt": f"{PROMPT_MARKER} two", "max_tokens": 12, "temperature": 0},
        )
        assert completion.status_code == 200, completion.text
        outputs.append(completion.json()["choices"][0]["text"])
        assert http.post(f"/v1/sessions/{session_id}/park").status_code == 200
        assert http.delete(f"/v1/sessions/{session_id}").status_code == 200
        # A bad key is refused without being echoed.
        refused = httpx.post(
            f"{logged_server.server.base_url}/v1/sessions", headers={"Authorization": "Bearer sk-wrong-key-987654"}
        )
        assert refused.status_code == 401
    log = logged_server.log.read_text(errors="replace")
    assert "POST /v1/sessions" in log  # the log is the real one, at its default level
    for secret in (PROMPT_MARKER, KEY, "sk-wrong-key-987654", *(o.strip() for o in outputs if len(o.strip()) >= 8)):
        assert secret not in log, f"the server logged {secret!r}"


def test_a_killed_engine_gives_503s_then_the_server_exits_to_be_restarted(logged_server: LoggedServer) -> None:
    server = logged_server.server
    with client(server) as http:
        session_id = http.post("/v1/sessions", json={"defaults": {"temperature": 0}}).json()["id"]
        assert (
            http.post(f"/v1/sessions/{session_id}/chunks", json={"input": [1, 2, 3], "max_tokens": 2}).status_code
            == 200
        )
        engines = [child.pid for child in psutil.Process(server.process.pid).children()]
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
            503,
            "engine_dead",
        )
        assert server.process.wait(timeout=120) == 3
    assert "the engine has died" in logged_server.log.read_text(errors="replace")

    restarted_log = logged_server.log.with_name("restarted.log")
    with (
        app_server("restarted", restarted_log, logged_server.settings, port=logged_server.port) as again,
        client(again) as http,
    ):
        state = http.get(f"/v1/sessions/{session_id}").json()
        assert (state["status"], state["num_chunks"]) == ("parked", 1)
        assert http.post(f"/v1/sessions/{session_id}/chunks", json={"input": [4], "max_tokens": 1}).status_code == 200
