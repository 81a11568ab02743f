"""The container check's fixtures: podman set up for this machine, the Debian base
image, and the CPU image built from docker/Dockerfile.cpu (layers cached by podman
between runs: a run that changed no dependency rebuilds only the code layers)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.containers.compose import COMPOSE, STANDINS
from tests.containers.podman import Podman, missing_tools

ROOT = Path(__file__).resolve().parents[2]
CPU_IMAGE = "localhost/streaming-sessions:cpu"
# Outside the repo and kept between runs: podman's own storage holds the layers.
WORKDIR = Path(os.environ.get("STREAMSESS_CONTAINER_WORKDIR", "/var/tmp/streamsess-container-check"))


@pytest.fixture(scope="session")
def podman() -> Iterator[Podman]:
    missing = missing_tools()
    if missing:
        pytest.fail(
            f"the container check needs {', '.join(missing)}: scripts/container-check installs them "
            "(Debian packages, as root)"
        )
    runner = Podman(WORKDIR)
    try:
        yield runner
    finally:
        runner.stop_service()


@pytest.fixture(scope="session")
def cpu_image(podman: Podman) -> str:
    base = podman.base_image()
    seconds = podman.build(
        CPU_IMAGE, ROOT / "docker" / "Dockerfile.cpu", ROOT, {"BASE_IMAGE": base}, log=WORKDIR / "build-cpu.log"
    )
    print(f"\nbuilt {CPU_IMAGE} on {base} in {seconds:.0f} s (log: {WORKDIR / 'build-cpu.log'})")
    return CPU_IMAGE


@pytest.fixture(scope="session")
def standin_images(podman: Podman) -> dict[str, str]:
    """compose.yaml's public images (no registry is reachable) -> stand-ins built here."""
    public = {service.get("image") for service in yaml.safe_load(COMPOSE.read_text())["services"].values()}
    images = {}
    for name in ("postgres", "haproxy", "prometheus"):
        original = next(image for image in public if image and image.split("/")[-1].startswith(name))
        tag = f"localhost/streamsess-standin-{name}:latest"
        podman.build(tag, STANDINS / f"{name}.Dockerfile", STANDINS, {"BASE_IMAGE": podman.base_image()})
        images[original] = tag
    return images
