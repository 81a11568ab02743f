"""docker/compose.yaml as it runs here: the same services, images and environment,
with what this machine's podman needs instead of a bridge network (``Podman``):

- every service on the host's network (``network_mode: host``), so published ports
  go and each replica listens on a port of its own (``STREAMSESS_PORT``);
- the images the check built, for the services it builds (compose's ``build:`` is
  dropped: podman builds them with the machine's pip settings, ``Podman.build``).

Nothing else changes: volumes, healthchecks, restart policies, grace periods and the
environment are compose.yaml's own."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.containers.podman import Podman

COMPOSE = Path(__file__).resolve().parents[2] / "docker" / "compose.yaml"
API_KEY = "container-check-key"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def render(path: Path, profiles: set[str], images: dict[str, str], ports: dict[str, int]) -> dict[str, Any]:
    """compose.yaml's services of ``profiles`` (and those of no profile), for this host."""
    spec = yaml.safe_load(COMPOSE.read_text())
    services = {}
    for name, service in spec["services"].items():
        if set(service.get("profiles", ())) - profiles and service.get("profiles"):
            continue
        service = dict(service)
        service.pop("ports", None)
        service.pop("build", None)
        service["network_mode"] = "host"
        if name in images:
            service["image"] = images[name]
        if name in ports:
            service["environment"] = {**service.get("environment", {}), "STREAMSESS_PORT": str(ports[name])}
        services[name] = service
    spec["services"] = services
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return spec


class Compose:
    """``docker-compose`` (Debian's 1.29) on podman's Docker-compatible API."""

    def __init__(self, podman: Podman, file: Path, project: str):
        self.podman, self.file, self.project = podman, file, project
        self.env = {**podman.env, "DOCKER_HOST": podman.start_service(), "STREAMSESS_API_KEYS": API_KEY,
                    "COMPOSE_PROJECT_NAME": project}

    def __call__(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(["docker-compose", "-f", str(self.file), *args], env=self.env, text=True,
                                capture_output=True, timeout=timeout)
        if check and result.returncode:
            raise RuntimeError(f"docker-compose {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
        return result

    def container(self, service: str) -> str:
        return self("ps", "-q", service).stdout.strip()

    def inspect(self, service: str) -> dict[str, Any]:
        found = self.podman("inspect", self.container(service), "--format", "json", check=False)
        return json.loads(found.stdout)[0] if found.returncode == 0 else {}

    def logs(self, service: str, tail: int = 60) -> str:
        result = self("logs", "--no-color", "--tail", str(tail), service, check=False)
        return result.stdout + result.stderr

    def wait_ready(self, service: str, port: int, timeout_s: float = 300) -> float:
        """Until the replica answers ``/ready``; seconds. Fails at once, with its logs,
        when its container stops or restarts (a server that cannot start never will)."""
        start = time.monotonic()
        restarts = self.inspect(service).get("RestartCount", 0)
        while time.monotonic() - start < timeout_s:
            found = self.inspect(service)
            state = found.get("State", {})
            if found and (not state.get("Running") or state.get("Restarting") or found["RestartCount"] > restarts):
                raise RuntimeError(f"{service} stopped (exit code {state.get('ExitCode')}, restarted "
                                   f"{found['RestartCount'] - restarts} times):\n{self.logs(service)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as answer:
                    if answer.status == 200:
                        return time.monotonic() - start
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{service} not ready after {timeout_s:.0f} s:\n{self.logs(service)}")

    def healthcheck(self, service: str) -> bool:
        """The image's and compose's healthcheck, run now (podman runs healthchecks from
        systemd timers, which these machines do not have)."""
        return self.podman("healthcheck", "run", self.container(service), check=False).returncode == 0

    def down(self) -> None:
        self("down", "-v", "--timeout", "60", check=False, timeout=300)


def environment_port(service: dict[str, Any]) -> int:
    return int(service["environment"]["STREAMSESS_PORT"])


def keep_logs(compose: Compose, services: list[str], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for service in services:
        (directory / f"{service}.log").write_text(compose.logs(service, tail=400))
    os.sync()
