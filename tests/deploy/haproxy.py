"""The repo's HAProxy configuration (docker/haproxy/haproxy.cfg), run for real on
loopback: Debian's haproxy, with the replicas' loopback addresses in place of
compose's service names, checked by ``haproxy -c`` before it starts."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.common import free_port

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "docker" / "haproxy" / "haproxy.cfg"
# The rule that routes every request naming a conversation by its key.
AFFINITY_RULE = "use_backend by_conversation if { var(txn.key) -m found }"
# The configuration this one replaced (nginx's): only the session API's own paths
# were hashed, by their session id; everything else went to the least busy replica.
SESSION_PATHS_ONLY = "use_backend by_conversation if { var(txn.key) -m found } { path_beg /v1/sessions }"

needs_haproxy = pytest.mark.skipif(
    shutil.which("haproxy") is None,
    reason="haproxy (Debian package haproxy) is not installed; scripts/test installs it when run as root",
)


def render(servers: dict[str, int], workdir: Path, *, affinity: bool = True) -> Path:
    """The config with ``servers`` (name: loopback port) in each backend; without
    ``affinity``, with the old routing (the negative control)."""
    lines, in_servers = [], False
    for line in CONFIG.read_text().splitlines():
        if line.strip().startswith("server "):
            if not in_servers:
                lines += [f"    server {name} 127.0.0.1:{port}" for name, port in servers.items()]
            in_servers = True
            continue
        in_servers = False
        lines.append(line)
    text = "\n".join(lines) + "\n"
    assert AFFINITY_RULE in text
    if not affinity:
        text = text.replace(AFFINITY_RULE, SESSION_PATHS_ONLY)
    path = workdir / ("haproxy.cfg" if affinity else "haproxy-session-paths-only.cfg")
    path.write_text(text)
    return path


def check(config: Path, bind: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["haproxy", "-c", "-f", str(config)], capture_output=True, text=True,
                          env={**os.environ, "STREAMSESS_PROXY_BIND": bind})


@contextlib.contextmanager
def running(servers: dict[str, int], workdir: Path, *, affinity: bool = True) -> Iterator[str]:
    """HAProxy in front of ``servers``; yields its base URL once it answers /health."""
    config = render(servers, workdir, affinity=affinity)
    port = free_port()
    bind = f"127.0.0.1:{port}"
    checked = check(config, bind)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    log = open(workdir / f"haproxy-{port}.log", "wb")
    process = subprocess.Popen(["haproxy", "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "STREAMSESS_PROXY_BIND": bind})
    try:
        url = f"http://{bind}"
        deadline = time.monotonic() + 10
        while True:
            assert process.poll() is None, (workdir / f"haproxy-{port}.log").read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "haproxy never answered /health within 10 s"
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
