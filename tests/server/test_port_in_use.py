"""A server whose port is taken says so at once, in one line, and starts no engine: the
port is bound before the engine's start (a minute, or two compiling), not after it.

Oracle: the process's exit status and its stderr. No engine started: the log has none of
vLLM's engine lines, which any engine start writes (the model is not even loaded)."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile

import pytest

from app.main import PORT_UNAVAILABLE_EXIT
from tests.harness.servers import REPO, engine_env, free_port

pytestmark = pytest.mark.server


def test_a_busy_port_fails_before_the_engine_starts() -> None:
    port = free_port()
    with socket.socket() as taken, tempfile.TemporaryDirectory() as state_dir:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        env = {
            **engine_env(),
            "STREAMSESS_PORT": str(port),
            "STREAMSESS_HOST": "127.0.0.1",
            "STREAMSESS_STATE_DIR": state_dir,
            "STREAMSESS_MODEL_PRESET": "tiny",
        }
        done = subprocess.run(
            [sys.executable, "-m", "app.main"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
        )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == PORT_UNAVAILABLE_EXIT, done.stderr[-3000:]
    assert f"cannot listen on 127.0.0.1:{port}" in lines[-1] and "in use" in lines[-1].lower(), lines[-1]
    assert "EngineCore" not in done.stderr and "Initializing" not in done.stderr, done.stderr[-3000:]
