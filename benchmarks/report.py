"""The benchmarks page's tables, made from the result files.

Each ``<!-- results NAME -->`` … ``<!-- /results -->`` block of docs/benchmarks.md is made
from ``benchmarks/results/NAME.json``: when, at which commit, on which CPU and by which
command the result was made, then its figures (the parts of the result ``PARTS`` names).
The plot beside a result (``NAME.png``) is copied to ``docs/results/`` for the page.
``tests/docs/test_benchmark_tables.py`` fails when the page and the result files differ.

    python -m benchmarks.report          # rewrites the blocks and copies the plots
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, RESULTS

PAGE = REPO / "docs" / "benchmarks.md"
PLOTS = REPO / "docs" / "results"

# Which parts of each result the page shows (in order); a result not named shows its "summary".
PARTS: dict[str, tuple[str, ...]] = {
    "models": ("rows",),
    "resume": ("summary",),
    "tier_reuse": ("rows",),
    "tier_reuse-float32": ("rows",),
    "concurrency": ("ratios",),
    "concurrency-disk-tier": ("ratios",),
    "park_resume": ("rows",),
    "capacity": ("chunks_answered", "phase1_seconds", "completion_on_full_device_s", "errors", "latency_s"),
    "many_sessions": ("results", "ratios_vs_vllm"),
    "store": ("per_chunk", "resume"),
    "transport_paired": ("floor_p50_ms", "per_side"),
    "chunk_timeline": ("rest_us", "floor_us"),
    "idle_hop": ("hop_p50_ms",),
    "admission": ("per_open_sessions",),
}
# Fields for another page than this one: per-source breakdowns, failure counts (every
# recorded run had none), a profiler's functions.
LEFT_OUT = {"sources", "usage", "failed"}
LEFT_OUT_PREFIX = "profile"

BLOCK = re.compile(r"<!-- results (?P<name>[\w.-]+) -->\n.*?<!-- /results -->", re.DOTALL)


def render_block(name: str) -> str:
    result = json.loads((RESULTS / f"{name}.json").read_text())
    lines = [f"<!-- results {name} -->", provenance(name, result), ""]
    parts = {part: result[part] for part in PARTS.get(name, ("summary",))}
    scalars = {part: value for part, value in parts.items() if not isinstance(value, (dict, list)) or value == {}}
    if scalars:
        lines += table("", scalars)
    for part, value in parts.items():
        if part not in scalars:
            lines += table("" if part in ("summary", "rows") else part, value)
    return "\n".join(lines).rstrip() + "\n<!-- /results -->"


def provenance(name: str, result: dict[str, Any]) -> str:
    run, machine = result["run"], result["machine"]
    flags = " ".join(machine.get("cpu_flags") or []) or "flags not recorded"
    return (
        f"*{run['date']}, commit `{run['commit']}`, {machine.get('cpu_model') or 'CPU not recorded'} "
        f"(`{flags}`), {machine['cpus']} cores: `{run['command']}` "
        f"(`benchmarks/results/{name}.json`)*"
    )


def table(title: str, value: Any) -> list[str]:
    """One part of a result as a markdown table: rows of a mapping of mappings, rows of a
    list of mappings, or a mapping of scalars (or one scalar) as name and value."""
    heading = f"**{words(title)}**" if title else ""
    if isinstance(value, list) and value and all(isinstance(row, dict) for row in value):
        rows = [flatten(row) for row in value]
        columns = union(rows)
        head = [heading, ""] if heading else []
        return [*head, *markdown(columns, [[row.get(c) for c in columns] for row in rows]), ""]
    if isinstance(value, dict):
        scalars = {k: v for k, v in value.items() if not (isinstance(v, dict) and v) and k not in LEFT_OUT}
        nested = {k: flatten(v) for k, v in value.items() if isinstance(v, dict) and v and k not in LEFT_OUT}
        out = [heading, ""] if heading else []
        if nested:
            columns = union(nested.values())
            out += [
                *markdown(["", *columns], [[words(k), *(row.get(c) for c in columns)] for k, row in nested.items()]),
                "",
            ]
        if scalars:
            out += [*markdown(["", "value"], [[words(k), "none" if v == {} else v] for k, v in scalars.items()]), ""]
        return out
    return [*markdown(["", "value"], [[words(title), value]]), ""]


def words(name: str) -> str:
    return name.replace("_", " ")


def flatten(row: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in row.items():
        if key in LEFT_OUT or key.startswith(LEFT_OUT_PREFIX):
            continue
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key} "))
        elif not isinstance(value, list):
            flat[f"{prefix}{key}"] = value
    return flat


def union(rows: Any) -> list[str]:
    return list(dict.fromkeys(column for row in rows for column in row))


def markdown(columns: list[str], rows: list[list[Any]]) -> list[str]:
    header = "| " + " | ".join(words(str(c)) for c in columns) + " |"
    align = "| " + " | ".join("---" if i == 0 else "---:" for i in range(len(columns))) + " |"
    return [header, align, *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows)]


def cell(value: Any) -> str:
    """Three significant figures, thousands grouped; text as it is."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value).replace("|", "\\|")
    if isinstance(value, int) or abs(value) >= 100:
        return f"{round(value):,}"
    return f"{value:.3g}"


def render_page(text: str) -> str:
    return BLOCK.sub(lambda match: render_block(match["name"]), text)


def plots(text: str) -> list[Path]:
    """The plots the page shows that a result file has beside it."""
    names = re.findall(r"\]\(results/([\w.-]+\.png)\)", text)
    return [RESULTS / name for name in names if (RESULTS / name).exists()]


def main() -> None:
    text = PAGE.read_text()
    PAGE.write_text(render_page(text))
    for plot in plots(text):
        shutil.copyfile(plot, PLOTS / plot.name)
    print(PAGE)


if __name__ == "__main__":
    main()
