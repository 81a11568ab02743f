"""Replicas behind the repo's HAProxy (docker/haproxy/haproxy.cfg), on loopback: the
cluster benchmark's and the deploy tests' harness. Debian's haproxy runs the repo's own
configuration with the replicas' loopback ports in place of compose's service names,
checked by ``haproxy -c`` before it starts."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from tests.harness.servers import REPO, RunningServer, enter_together, free_port, wait_answering

HAPROXY_CONFIG = REPO / "docker" / "haproxy" / "haproxy.cfg"
# The rule that routes every request naming a conversation by its key.
AFFINITY_RULE = "use_backend by_conversation if { var(txn.key) -m found }"
# How the proxy may route: by each conversation's key (the configuration as shipped);
# by the session API's paths only (the nginx configuration it replaced); or every
# request to the least busy replica (a stateless peer's proxy).
Routing = Literal["keyed", "session-paths", "least-busy"]
RULES: dict[str, str] = {
    "keyed": AFFINITY_RULE,
    "session-paths": AFFINITY_RULE + " { path_beg /v1/sessions }",
    "least-busy": "",
}


def with_servers(config: str, servers: dict[str, str]) -> str:
    """The configuration with ``servers`` (name: address) in place of each backend's."""
    lines, in_servers = [], False
    for line in config.splitlines():
        if line.strip().startswith("server "):
            if not in_servers:
                lines += [f"    server {name} {address}" for name, address in servers.items()]
            in_servers = True
            continue
        in_servers = False
        lines.append(line)
    return "\n".join(lines) + "\n"


def render_haproxy(
    servers: dict[str, int], workdir: Path, routing: Routing = "keyed", check_path: str = "/ready"
) -> Path:
    """The shipped config with ``servers`` (name: loopback port) in each backend, routed
    as ``routing`` says, its health checks on ``check_path`` (vLLM's server has no /ready)."""
    text = with_servers(HAPROXY_CONFIG.read_text(), {name: f"127.0.0.1:{port}" for name, port in servers.items()})
    assert AFFINITY_RULE in text and "option httpchk GET /ready" in text
    text = text.replace(AFFINITY_RULE, RULES[routing]).replace("GET /ready", f"GET {check_path}")
    path = workdir / f"haproxy-{routing}-{free_port()}.cfg"
    path.write_text(text)
    return path


def check_haproxy(config: Path, bind: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["haproxy", "-c", "-f", str(config)],
        capture_output=True,
        text=True,
        env={**os.environ, "STREAMSESS_PROXY_BIND": bind},
    )


@contextlib.contextmanager
def haproxy(
    servers: dict[str, int], workdir: Path, routing: Routing = "keyed", check_path: str = "/ready"
) -> Iterator[str]:
    """HAProxy in front of ``servers``; yields its base URL once it answers."""
    config = render_haproxy(servers, workdir, routing, check_path)
    port = free_port()
    bind = f"127.0.0.1:{port}"
    checked = check_haproxy(config, bind)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    log_path = workdir / f"haproxy-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            ["haproxy", "-db", "-f", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "STREAMSESS_PROXY_BIND": bind},
        )
        try:
            url = f"http://{bind}"
            wait_answering(process, f"{url}/health", 10, log_path)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


class Restartable:
    """A server that stops as a container runtime stops it (SIGTERM to its process
    alone, then a wait) and starts again on the same port. ``starting(port, n)`` makes
    the n-th start's context manager."""

    def __init__(self, name: str, starting: Callable[[int, int], contextlib.AbstractContextManager[RunningServer]]):
        self.name, self.port = name, free_port()
        self._starting = starting
        self.starts = 0
        self._stack = contextlib.ExitStack()
        self.server: RunningServer | None = None

    def starting(self) -> contextlib.AbstractContextManager[RunningServer]:
        self.starts += 1
        return self._starting(self.port, self.starts)

    def started(self, server: RunningServer) -> None:
        """A start entered elsewhere (beside others' starts), stopped by whoever entered it."""
        self.server = server

    def start(self) -> None:
        self._stack = contextlib.ExitStack()
        self.server = self._stack.enter_context(self.starting())

    def sigterm_and_wait(self, timeout_s: float = 60) -> int:
        """Its exit status; a server still running ``timeout_s`` after the signal is
        killed (its status then -9: vLLM's own server was seen to hang after its shutdown)."""
        assert self.server is not None
        self.server.process.send_signal(signal.SIGTERM)
        try:
            status = self.server.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            status = self.server.process.wait()
        self._stack.close()
        return status

    def kill(self) -> None:
        """``kill -9`` of its whole process group (the engine too)."""
        assert self.server is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.server.process.pid, signal.SIGKILL)

    def close(self) -> None:
        self._stack.close()


def start_together(stack: contextlib.ExitStack, servers: list[Restartable]) -> None:
    """Start ``servers`` side by side (benchmarks.common.enter_together); ``stack``
    stops them, whichever start each is at by then."""
    for server in servers:
        stack.callback(server.close)
    for server, running in zip(servers, enter_together(stack, [s.starting() for s in servers])):
        server.started(running)
