"""Static checks of the Dockerfiles and compose file with real parsers (no Docker
engine runs here): BuildKit's own Dockerfile parser (the `dockerfile` package) and
docker-compose's validator (Debian's docker-compose, installed by scripts/test)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import dockerfile
import pytest
import yaml

DOCKER = Path(__file__).resolve().parents[2] / "docker"
COMPOSE = DOCKER / "compose.yaml"

requires_compose = pytest.mark.skipif(
    shutil.which("docker-compose") is None,
    reason="docker-compose (Debian package) is not installed; scripts/test installs it when run as root",
)


def commands(path: Path) -> list[dockerfile.Command]:
    return list(dockerfile.parse_file(str(path)))


def healthcheck_probe(command: list[str]) -> list[str]:
    """The probe's argv (after HEALTHCHECK's options and CMD): no argument with a space,
    since podman's Docker-compatible API splits them there (found by the container check)."""
    argv = command[command.index("CMD") + 1 :] if "CMD" in command else command
    argv = [part.strip('[]", ') for part in argv] if argv and argv[0].startswith("[") else argv
    assert not any(" " in part for part in argv), argv
    return argv


def test_healthcheck_probe_answers_from_the_port(monkeypatch: pytest.MonkeyPatch) -> None:
    from app.http.healthcheck import main

    monkeypatch.setenv("STREAMSESS_PORT", "1")  # nothing listens there
    assert main([]) == 1


def test_cpu_dockerfile() -> None:
    parsed = commands(DOCKER / "Dockerfile.cpu")
    by_cmd = [c.cmd for c in parsed]
    args = {c.value[0].split("=")[0]: c.value[0] for c in parsed if c.cmd == "ARG"}
    assert (
        args["BASE_IMAGE"] == "BASE_IMAGE=python:3.11-slim"
    )  # the public default; scripts/container-check builds on Debian
    assert next(c for c in parsed if c.cmd == "FROM").value[0] == "${BASE_IMAGE}"
    runs = " ".join(" ".join(c.value) for c in parsed if c.cmd == "RUN")
    assert "scripts/bootstrap.sh" in runs  # the README's install
    assert "ensure_model('smollm2-135m-instruct')" in runs  # the default model, converted at build time
    users = [c.value[0] for c in parsed if c.cmd == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert by_cmd.index("USER") < by_cmd.index("ENTRYPOINT")
    healthcheck = next(c for c in parsed if c.cmd == "HEALTHCHECK")
    assert healthcheck_probe(list(healthcheck.value)) == ["python", "-m", "app.http.healthcheck"]
    assert next(c for c in parsed if c.cmd == "ENTRYPOINT").value == ("python", "-m", "app.main")


def test_cuda_dockerfile() -> None:
    parsed = commands(DOCKER / "Dockerfile.cuda")
    args = {c.value[0].split("=")[0]: c.value[0] for c in parsed if c.cmd == "ARG"}
    assert "vllm/vllm-openai:v0.33" in args["VLLM_IMAGE"]
    assert any(c.cmd == "FROM" and c.value[0] == "${VLLM_IMAGE}" for c in parsed)
    assert [c.value[0] for c in parsed if c.cmd == "USER"][-1] == "app"
    assert any(c.cmd == "HEALTHCHECK" for c in parsed)


def test_broken_dockerfile_is_caught(tmp_path: Path) -> None:
    broken = tmp_path / "Dockerfile"
    # A key with no value: the parser refuses it ("ENV must have two arguments").
    broken.write_text((DOCKER / "Dockerfile.cpu").read_text().replace("WORKDIR /srv/streamsess", "ENV WORKDIR"))
    with pytest.raises(dockerfile.GoParseError):
        dockerfile.parse_file(str(broken))


def compose(*args: str, env: dict[str, str] | None = None, file: Path = COMPOSE) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSESS_")}
    environment.update(env or {})
    return subprocess.run(
        ["docker-compose", "-f", str(file), *args], capture_output=True, text=True, env=environment, timeout=60
    )


@requires_compose
def test_compose_file_is_valid() -> None:
    env = {"STREAMSESS_API_KEYS": "key"}
    assert compose("config", "-q", env=env).returncode == 0
    rendered = yaml.safe_load(compose("config", env=env).stdout)
    services = rendered["services"]
    # The default profile is the one server; the others join with their profile.
    assert [name for name, spec in services.items() if not spec.get("profiles")] == ["server"]
    assert {name: spec.get("profiles") for name, spec in services.items() if spec.get("profiles")} == {
        "replica-2": ["scale"],
        "postgres": ["scale"],
        "proxy": ["scale"],
        "prometheus": ["metrics"],
        "grafana": ["metrics"],
        "server-gpu": ["gpu"],
    }
    server = services["server"]
    assert healthcheck_probe(server["healthcheck"]["test"][1:]) == ["python", "-m", "app.http.healthcheck"]
    assert server["environment"]["STREAMSESS_API_KEYS"] == "key"
    targets = {v["target"] if isinstance(v, dict) else v.split(":")[1] for v in server["volumes"]}
    assert targets == {"/models", "/var/lib/streamsess"}
    assert set(rendered["volumes"]) == {"models", "state", "state-2", "pgdata"}
    # The proxy's configuration names both replicas by their compose service names.
    assert any(
        v.endswith("/usr/local/etc/haproxy/haproxy.cfg:ro")
        or (isinstance(v, dict) and v["target"] == "/usr/local/etc/haproxy/haproxy.cfg")
        for v in services["proxy"]["volumes"]
    )
    haproxy_cfg = (DOCKER / "haproxy" / "haproxy.cfg").read_text()
    assert {"server server server:8000", "server replica-2 replica-2:8000"} <= {
        line.strip() for line in haproxy_cfg.splitlines()
    }
    # A stop drains before it exits: compose waits longer than the default drain.
    from app.settings import Settings

    grace = server["stop_grace_period"]
    assert float(str(grace).rstrip("s")) > Settings.model_fields["drain_timeout_s"].default, grace
    # Sessions are durable by default (SQLite in the state volume); the scale
    # profile's replicas share the database named by STREAMSESS_STORE_URL.
    assert server["environment"]["STREAMSESS_STATE_DIR"] == "/var/lib/streamsess"
    shared = {"STREAMSESS_API_KEYS": "key", "STREAMSESS_STORE_URL": "postgresql://streamsess:pw@postgres/streamsess"}
    scaled = yaml.safe_load(compose("--profile", "scale", "config", env=shared).stdout)["services"]
    assert {scaled[name]["environment"]["STREAMSESS_STORE_URL"] for name in ("server", "replica-2")} == {
        shared["STREAMSESS_STORE_URL"]
    }
    assert "postgres" in scaled["replica-2"]["depends_on"]


@requires_compose
def test_compose_fails_fast_without_api_keys() -> None:
    result = compose("config", "-q")
    assert result.returncode != 0
    assert "STREAMSESS_API_KEYS" in result.stderr


@requires_compose
def test_broken_compose_file_is_caught(tmp_path: Path) -> None:
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace("  server:\n", "  server:\n    restart_policy_typo: always\n", 1))
    assert compose("config", "-q", env={"STREAMSESS_API_KEYS": "key"}, file=broken).returncode != 0
