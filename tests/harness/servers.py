"""Servers in fresh processes, as a user starts them: ours (``python -m app.main``) with
STREAMSESS_* settings, and any other command (vLLM's server, for the benchmarks),
healthy before they are handed over and stopped with every process they started.
Within ``pooled()`` (the benchmarks' smoke run), servers and engines with the same
settings are shared."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

REPO = Path(__file__).resolve().parents[2]
# VLLM_CPU_NUM_OF_RESERVED_CPU on every side of every comparison, unless the caller's
# environment sets it (a benchmark that gives each side more model threads).
RESERVED_CPUS = "1"
T = TypeVar("T")


def engine_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSESS_")}
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", RESERVED_CPUS)
    return env


# Servers listen on ports below the kernel's ephemeral range: a server binds its port 20 to
# 60 s after it is picked (once its engine has started), and a port from the ephemeral range
# could meanwhile be taken by any outgoing connection, a test client's or another worker's
# (seen: a cluster-benchmark replica exited on "address already in use"). A system RNG: a
# test that seeds ``random`` must not make two workers pick the same ports.
PORTS_BELOW_EPHEMERAL = 12_000
_ports = random.SystemRandom()


def ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    low = ephemeral_ports()[0]
    for _ in range(100):
        port = _ports.randrange(max(1024, low - PORTS_BELOW_EPHEMERAL), low)
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.bind(("127.0.0.1", port))
            return port
    with socket.socket() as sock:  # the range is crowded: any free port
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RunningServer:
    name: str
    base_url: str
    model: str
    process: subprocess.Popen[bytes]


def wait_healthy(server: RunningServer, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.process.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise TimeoutError(f"{server.name} did not become healthy")


def wait_answering(
    process: subprocess.Popen[bytes], url: str, timeout_s: float, log: Path, interval_s: float = 0.1
) -> None:
    """Until ``url`` answers 200 (a proxy, Prometheus); fails at once, with the process's
    log, if the process exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, log.read_text()
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, f"{url} did not answer within {timeout_s:.0f} s"
        time.sleep(interval_s)


@contextlib.contextmanager
def serve(
    name: str, command: list[str], env: dict[str, str], port: int, model: str, log: Path, key: Any = None
) -> Iterator[RunningServer]:
    """A server in a fresh process (its own process group), healthy before it is
    yielded and stopped with everything it started afterwards; or, in a pool, the
    pool's server of the same ``key`` (what the server is, less its port and paths)."""
    if _POOL is not None and key is not None:
        yield _POOL.server(key, lambda: serve(name, command, env, port, model, log))
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=out, start_new_session=True)
        server = RunningServer(name, f"http://127.0.0.1:{port}", model, process)
        try:
            wait_healthy(server)
            yield server
        finally:
            stop_group(process)


def enter_together(stack: contextlib.ExitStack, managers: list[contextlib.AbstractContextManager[T]]) -> list[T]:
    """Enter ``managers`` side by side, each in a thread, and leave them with ``stack``.
    For servers: most of a start is one process importing torch and vLLM, so two
    servers on 2 cores start in little more than the time of one."""
    with concurrent.futures.ThreadPoolExecutor(len(managers)) as pool:
        futures = [pool.submit(manager.__enter__) for manager in managers]
    for manager, future in zip(managers, futures):
        if future.exception() is None:
            stack.push(manager.__exit__)
    return [future.result() for future in futures]  # the first failure raises; the stack leaves the rest


STOP_TIMEOUT_S = 60


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's group and wait for it; a server that does not stop within
    ``STOP_TIMEOUT_S`` is killed and the hang is raised, never hidden."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise RuntimeError(f"process {process.pid} ignored SIGTERM for {STOP_TIMEOUT_S} s and was killed") from None
    finally:
        # Engine processes the server spawned die with their group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def app_server(
    name: str,
    log: Path,
    settings: dict[str, str],
    port: int | None = None,
    model: str = "embedded-tiny",
    command: list[str] | None = None,
) -> contextlib.AbstractContextManager[RunningServer]:
    """``python -m app.main`` (or ``command``) in a fresh process; ``settings`` are its STREAMSESS_*
    values (name: value), and nothing else of the caller's STREAMSESS_ environment;
    it serves the preset ``model`` names (``embedded-tiny`` by default) unless they say.
    Its sessions go to a fresh state directory unless ``state_dir`` or
    ``store_url`` is given."""
    key = ("app", model, tuple(command or ()), tuple(sorted(settings.items()))) if "state_dir" not in settings else None
    port = port or free_port()
    settings = dict(settings)
    if "model" not in settings:
        settings.setdefault("model_preset", model.removeprefix("embedded-"))
    if "state_dir" not in settings and "store_url" not in settings:
        settings["state_dir"] = tempfile.mkdtemp(prefix=f"streamsess-{name}-state-")
    env = engine_env()
    env.update({f"STREAMSESS_{key.upper()}": value for key, value in {"port": str(port), **settings}.items()})
    return serve(name, command or [sys.executable, "-m", "app.main"], env, port, model, log, key)


class Pool:
    """Engines and servers that the benchmarks run by one process share when their
    settings are the same (``python -m benchmarks.smoke`` runs every --quick run so):
    each is started on first use and kept; at most ``keep`` engines and ``keep``
    servers stay up (the least recently used is stopped first), and the rest stop
    when the pool closes. Outside a pool every benchmark starts and stops its own."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.engines: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self.servers: collections.OrderedDict[Any, tuple[RunningServer, contextlib.ExitStack]] = (
            collections.OrderedDict()
        )

    def engine(self, key: str, build: Callable[[], Any]) -> Any:
        if key not in self.engines:
            if len(self.engines) >= self.keep:
                stop_engine(self.engines.popitem(last=False)[1])
            self.engines[key] = build()
        self.engines.move_to_end(key)
        return self.engines[key]

    def server(self, key: Any, start: Callable[[], contextlib.AbstractContextManager[RunningServer]]) -> RunningServer:
        if key not in self.servers:
            if len(self.servers) >= self.keep:
                self.servers.popitem(last=False)[1][1].close()
            stack = contextlib.ExitStack()
            self.servers[key] = (stack.enter_context(start()), stack)
        self.servers.move_to_end(key)
        return self.servers[key][0]

    def close(self) -> None:
        while self.servers:
            self.servers.popitem()[1][1].close()
        while self.engines:
            stop_engine(self.engines.popitem()[1])


_POOL: Pool | None = None


@contextlib.contextmanager
def pooled(keep: int = 2) -> Iterator[Pool]:
    """Within the block, engines and servers with the same settings are shared."""
    global _POOL
    _POOL = Pool(keep)
    try:
        yield _POOL
    finally:
        pool, _POOL = _POOL, None
        pool.close()


def current_pool() -> Pool | None:
    return _POOL


def stop_engine(engine: Any) -> None:
    from app.engine import shutdown_engine

    shutdown_engine(engine)
