"""docs/benchmarks.md's tables are the result files' (benchmarks/report.py makes them): a
result rerun, or a table edited by hand, without `python -m benchmarks.report` fails here."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest

import benchmarks.report as report
from benchmarks.report import PAGE, PLOTS, plots, render_page


def test_the_benchmarks_page_shows_the_result_files() -> None:
    text = PAGE.read_text()
    assert text == render_page(text), "docs/benchmarks.md is stale: run python -m benchmarks.report"


def test_the_page_shows_every_plot_as_its_result_file_has_it() -> None:
    for plot in plots(PAGE.read_text()):
        assert filecmp.cmp(plot, PLOTS / plot.name, shallow=False), f"{plot.name}: run python -m benchmarks.report"


def test_a_changed_result_makes_the_page_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the check above reads the result files, not the page."""
    for result in report.RESULTS.glob("*.json"):
        (tmp_path / result.name).write_text(result.read_text())
    changed = json.loads((tmp_path / "resume.json").read_text())
    changed["summary"]["last_turn_ttft_s"]["ours-sse"] = 9.99
    (tmp_path / "resume.json").write_text(json.dumps(changed))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    text = PAGE.read_text()
    rendered = render_page(text)
    assert "| 9.99 |" in rendered and text != rendered
