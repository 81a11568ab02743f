"""The CUDA image as far as a CPU machine allows. Its base (``vllm/vllm-openai``) cannot be
pulled here and there is no GPU, so it is not built; what can be checked is that its
Python layer resolves: this package with the ``cuda`` extra (vLLM's CUDA build), in a
fresh environment, by pip itself (``--dry-run``: metadata only, nothing installed).
Oracle: pip's own installation report."""

from __future__ import annotations

import json
import shutil
import subprocess
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def project_copy(where: Path) -> Path:
    """What pip builds the package's metadata from, copied: setuptools writes its
    ``*.egg-info`` into the source tree, and one left in the checkout shadows the
    editable install's entry points for any process started there."""
    where.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, where / name)
    for package in ("app", "connectors", "clients"):
        shutil.copytree(ROOT / package, where / package, ignore=shutil.ignore_patterns("__pycache__"))
    return where


def test_the_cuda_python_layer_resolves(tmp_path: Path) -> None:
    project = project_copy(tmp_path / "project")
    venv.create(tmp_path / "env", with_pip=True)
    pip = tmp_path / "env" / "bin" / "pip"
    report = tmp_path / "report.json"
    resolved = subprocess.run(
        [str(pip), "install", "--dry-run", "--quiet", "--report", str(report), f"{project}[cuda]"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert resolved.returncode == 0, resolved.stderr[-3000:]
    versions = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    print(f"\nthe cuda extra resolves to {len(versions)} packages: vllm {versions['vllm']}, torch {versions['torch']}")
    assert versions["vllm"].startswith("0.33."), versions["vllm"]  # pyproject's pin: vllm>=0.33,<0.34
    assert "+cpu" not in versions["torch"] and "streaming-sessions" in versions
