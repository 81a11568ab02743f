"""docker/compose.yaml as it runs here, with one change: the images no registry here can
give. The CPU image is the one the check built (compose's ``build:`` is dropped: podman
builds it with the machine's pip settings, ``Podman.build``); PostgreSQL, HAProxy and
Prometheus are stand-ins built from Debian's packages with the interface compose.yaml
uses (``standins/``). Networks, service names, published ports, volumes, healthchecks,
dependencies, restart policies, grace periods and the environment are compose.yaml's.

Healthchecks: podman runs them from systemd timers, which these machines lack; a ticker
runs each container's own healthcheck every few seconds instead, so ``depends_on:
service_healthy`` waits as it does under Docker."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.containers.podman import Podman
from tests.harness.servers import free_port

__all__ = ["API_KEY", "ROOT", "Compose", "free_port", "render"]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker" / "compose.yaml"
STANDINS = Path(__file__).resolve().parent / "standins"
API_KEY = "container-check-key"
HEALTH_TICK_S = 3.0


def render(path: Path, images: dict[str, str]) -> dict[str, Any]:
    """compose.yaml with ``images`` (public name -> the image built here), written beside
    the original's folders (its relative mounts, ``./haproxy`` and ``./prometheus``)."""
    spec = yaml.safe_load(COMPOSE.read_text())
    for service in spec["services"].values():
        if service.get("image") in images:
            service["image"] = images[service["image"]]
            service.pop("build", None)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return spec


class Compose:
    """``docker-compose`` (Debian's 1.29) on podman's Docker-compatible API."""

    def __init__(self, podman: Podman, file: Path, project: str, env: dict[str, str] | None = None):
        self.podman, self.file, self.project = podman, file, project
        self.env = {
            **podman.env,
            "DOCKER_HOST": podman.start_service(),
            "STREAMSESS_API_KEYS": API_KEY,
            "COMPOSE_PROJECT_NAME": project,
            **(env or {}),
        }
        self._ticking = threading.Event()
        self._ticker: threading.Thread | None = None

    def __call__(self, *args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["docker-compose", "-f", str(self.file), *args],
            env=self.env,
            text=True,
            capture_output=True,
            timeout=timeout,
        )
        if check and result.returncode:
            raise RuntimeError(f"docker-compose {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
        return result

    def __enter__(self) -> Compose:
        self._ticking.set()
        self._ticker = threading.Thread(target=self._tick, name="healthchecks", daemon=True)
        self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ticking.clear()
        if self._ticker is not None:
            self._ticker.join(timeout=30)
        self("down", "-v", "--timeout", "60", check=False, timeout=300)

    def _tick(self) -> None:
        while self._ticking.is_set():
            listed = self.podman(
                "ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}", check=False
            )
            for container in listed.stdout.split():
                self.podman("healthcheck", "run", container, check=False, timeout=60)
            time.sleep(HEALTH_TICK_S)

    def container(self, service: str) -> str:
        return self("ps", "-q", service).stdout.strip()

    def inspect(self, service: str) -> dict[str, Any]:
        container = self.container(service)
        found = self.podman("inspect", container, "--format", "json", check=False) if container else None
        return json.loads(found.stdout)[0] if found is not None and found.returncode == 0 else {}

    def health(self, service: str) -> str:
        return str(self.inspect(service).get("State", {}).get("Health", {}).get("Status", ""))

    def logs(self, service: str, tail: int = 60) -> str:
        result = self("logs", "--no-color", "--tail", str(tail), service, check=False)
        return result.stdout + result.stderr

    def wait_ready(self, service: str, port: int, timeout_s: float = 300) -> float:
        """Until the replica answers ``/ready`` on ``port``; seconds. Fails at once, with
        its logs, when its container stops or restarts (a server that cannot start never will)."""
        start = time.monotonic()
        restarts = self.inspect(service).get("RestartCount", 0)
        while time.monotonic() - start < timeout_s:
            found = self.inspect(service)
            state = found.get("State", {})
            if found and (not state.get("Running") or state.get("Restarting") or found["RestartCount"] > restarts):
                raise RuntimeError(
                    f"{service} stopped (exit code {state.get('ExitCode')}, restarted "
                    f"{found['RestartCount'] - restarts} times):\n{self.logs(service)}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as answer:
                    if answer.status == 200:
                        return time.monotonic() - start
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{service} not ready after {timeout_s:.0f} s:\n{self.logs(service)}")

    def wait_healthy(self, services: list[str], timeout_s: float = 300) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if all(self.health(service) == "healthy" for service in services):
                return time.monotonic() - start
            time.sleep(1)
        states = {service: self.health(service) for service in services}
        raise RuntimeError(
            f"not healthy after {timeout_s:.0f} s: {states}\n"
            + "\n".join(self.logs(service) for service, state in states.items() if state != "healthy")
        )

    def healthcheck(self, service: str) -> bool:
        """The container's healthcheck (compose's, else the image's), run now."""
        return self.podman("healthcheck", "run", self.container(service), check=False).returncode == 0
