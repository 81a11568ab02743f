"""The layering rules, checked on the source (an ``ast`` walk, nothing imported):

- session logic (``app/sessions`` but its transports) reaches, through every module of
  ours it imports, neither FastAPI nor Starlette, nor the engine's builder or the server;
- ``connectors/`` (loaded by vLLM's own processes by module path) imports nothing of ``app``;
- no file in ``app/`` is over 600 lines (those over 400 are named in the test's output).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SESSION_TRANSPORTS = {"app.api.sessions.rest", "app.api.sessions.websocket", "app.api.sessions.connection"}
FORBIDDEN_IN_SESSION_LOGIC = ("fastapi", "starlette", "app.engine", "app.main", "app.http.errors", "app.http.middleware")


def module_path(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def imports_of(module: str) -> set[str]:
    path = module_path(module)
    assert path is not None, module
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if module_path(f"{node.module}.{alias.name}") is not None)
    return found


def reached_from(module: str) -> dict[str, str]:
    """Every module reached from ``module`` through ours, with the one that imports it."""
    seen: dict[str, str] = {}
    stack = [module]
    while stack:
        current = stack.pop()
        for imported in imports_of(current):
            if imported in seen:
                continue
            seen[imported] = current
            if imported.split(".")[0] in ("app", "connectors", "clients") and module_path(imported):
                stack.append(imported)
    return seen


def session_logic_modules() -> list[str]:
    return sorted(f"app.sessions.{p.stem}" for p in (REPO / "app" / "sessions").glob("*.py")
                  if f"app.sessions.{p.stem}" not in SESSION_TRANSPORTS and p.stem != "__init__")


def test_session_logic_imports_no_web_framework_nor_the_engine_builder() -> None:
    modules = session_logic_modules()
    assert {"app.sessions.service", "app.sessions.run", "app.sessions.registry"} <= set(modules)
    for module in modules:
        reached = reached_from(module)
        bad = {m: via for m, via in reached.items() if m.startswith(FORBIDDEN_IN_SESSION_LOGIC)}
        assert not bad, f"{module} reaches {bad} (module: imported by)"


def test_connectors_import_nothing_of_the_app() -> None:
    for path in (REPO / "connectors").glob("*.py"):
        reached = reached_from(f"connectors.{path.stem}")
        assert not [m for m in reached if m == "app" or m.startswith("app.")], path


def test_the_check_sees_a_forbidden_import() -> None:
    """Negative control: a transport does import FastAPI, and the walk finds it."""
    assert "fastapi" in reached_from("app.api.sessions.rest")


def test_no_file_in_app_is_over_600_lines() -> None:
    """A file a newcomer can hold in mind. Past 400 lines a file is named (a place to
    look for a responsibility to split out); past 600 the test fails. A hard 400 made
    files be cut to fit rather than by responsibility."""
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in (REPO / "app").rglob("*.py")}
    print("over 400 lines:", {name: n for name, n in sizes.items() if n > 400})
    assert {name: n for name, n in sizes.items() if n > 600} == {}
