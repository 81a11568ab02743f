"""docs/configuration.md, made from ``app.settings.Settings``: every setting, its
environment variable and command-line flag, its default and its description, grouped as
the settings file groups them. ``tests/docs/test_config_reference.py`` fails when the page
and the code differ.

    python -m tests.docs.config_reference      # writes docs/configuration.md
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from app.settings import Settings

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "configuration.md"
SOURCE = REPO / "app" / "settings.py"

HEAD = """# Configuration

Every setting of the server, made from `app/settings.py` by
`python -m tests.docs.config_reference` (a test fails when this page and the code differ).
Each is read, first to last: a command-line flag (`./scripts/serve --port 9000`), an
environment variable (`STREAMSESS_PORT=9000`), a `.env` file in the working directory,
then the default. An empty variable counts as unset. Lists take JSON or commas
(`STREAMSESS_API_KEYS=key-1,key-2`); `engine_args` takes a JSON object of vLLM engine
arguments (`STREAMSESS_ENGINE_ARGS='{"max_num_batched_tokens": 4096}'`).
"""


def groups() -> dict[str, str]:
    """Each setting's group: the ``# --- name ---`` comment above it in the settings file."""
    found, group = {}, "other"
    for line in SOURCE.read_text().splitlines():
        if heading := re.match(r"\s+# --- (.+?) -+$", line):
            group = heading.group(1)
        elif field := re.match(r"    (\w+):", line):
            found[field.group(1)] = group
    return found


def shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, list | dict):
        return f"`{json.dumps(value)}`" if value else "empty"
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def render() -> str:
    of_field = groups()
    sections: dict[str, list[str]] = {}
    for name, field in Settings.model_fields.items():
        default = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
        description = " ".join((field.description or "").split()).replace("|", "\\|")
        flag = "--" + name.replace("_", "-")
        sections.setdefault(of_field.get(name, "other"), []).append(
            f"| `{name}` | `STREAMSESS_{name.upper()}`, `{flag}` | {shown(default)} | {description} |"
        )
    parts = [HEAD]
    for group, rows in sections.items():
        parts.append(
            f"\n## {group[0].upper()}{group[1:]}\n\n| setting | variable, flag | default | what it does |\n"
            "| --- | --- | --- | --- |\n" + "\n".join(rows) + "\n"
        )
    return "".join(parts)


if __name__ == "__main__":
    PAGE.write_text(render())
    print(PAGE)
