"""The layers as folders, checked on the source (an ``ast`` walk, nothing imported).

``app/`` is five layers, each a place in the tree:

- platform: the top-level modules (settings, errors, wire types, metrics, engine, limits,
  cache salts, provenance, routing keys) and ``store/``, ``tools/``, ``models/``;
- ``sessions/``: the session domain, on the platform alone;
- ``http/``: the edge, on the platform alone (it knows no API and no session);
- ``vllm_routes/``: vLLM's own routes as hosted here, on the platform and the edge;
- ``api/``: our APIs, on all of the above;
- ``main.py`` and ``wiring.py``: the composition root, on everything.

A module imports its own layer and those below it, nothing else; ``protocol.py`` (the
shared wire types) imports no app module but ``errors``; the session domain reaches no
web framework through any module of ours; ``connectors/`` (loaded by vLLM's processes
by module path) imports nothing of ``app``. No exceptions are listed here: a new import
against the layers fails, and is fixed where it is, not whitelisted.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "app"

# The top-level modules of app/, by name: a new one is a choice of layer, made here.
PLATFORM_MODULES = {
    "settings",
    "errors",
    "protocol",
    "metrics",
    "engine",
    "limits",
    "cache_salt",
    "provenance",
    "routing",
}
ROOT_MODULES = {"main", "wiring"}
PLATFORM_PACKAGES = {"store", "tools", "models"}
# What each layer may import of ours beside itself.
MAY_IMPORT: dict[str, set[str]] = {
    "platform": set(),
    "sessions": {"platform"},
    "http": {"platform"},
    "vllm_routes": {"platform", "http"},
    "api": {"platform", "sessions", "http", "vllm_routes"},
    "root": {"platform", "sessions", "http", "vllm_routes", "api"},
}
WEB_FRAMEWORKS = ("fastapi", "starlette", "uvicorn")
# The session service's parts, which the APIs use only through its methods.
REACH_THROUGH = re.compile(
    r"\b(service|sessions)\.(registry|limits|parking|store|parsers|tokenizer|recorder|"
    r"membership|capacity)\b"
)


def module_path(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def module_of(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(module: str) -> set[str]:
    path = module_path(module)
    assert path is not None, module
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(
                f"{node.module}.{alias.name}"
                for alias in node.names
                if module_path(f"{node.module}.{alias.name}") is not None
            )
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


def layer_of(module: str) -> str | None:
    """The layer of a module of ``app`` (None: not one of app's)."""
    parts = module.split(".")
    if parts[0] != "app" or len(parts) == 1:
        return None
    top = parts[1]
    if top in ROOT_MODULES:
        return "root"
    if top in PLATFORM_MODULES or top in PLATFORM_PACKAGES:
        return "platform"
    if top in MAY_IMPORT:
        return top
    raise AssertionError(f"{module}: app/{top} is in no layer; place it in tests/unit/test_layering.py")


def app_modules() -> list[str]:
    return sorted(module_of(path) for path in APP.rglob("*.py") if "migrations" not in path.parts)


def against_the_layers(modules: list[str]) -> list[str]:
    found = []
    for module in modules:
        layer = layer_of(module)
        allowed = MAY_IMPORT[layer or "root"] | {layer}
        for imported in sorted(imports_of(module)):
            target = layer_of(imported)
            if target is not None and target not in allowed:
                found.append(f"{module} ({layer}) imports {imported} ({target})")
    return found


def test_no_import_runs_against_the_layers() -> None:
    assert against_the_layers(app_modules()) == []


def test_the_layer_check_sees_an_import_against_the_layers(tmp_path: Path) -> None:
    """Negative control: the walk, given a domain module that imports the edge, names it."""
    import tests.unit.test_layering as layering

    fake_repo = tmp_path
    (fake_repo / "app" / "sessions").mkdir(parents=True)
    (fake_repo / "app" / "http").mkdir()
    (fake_repo / "app" / "sessions" / "leaky.py").write_text("from app.http.sse import EventStream\n")
    (fake_repo / "app" / "http" / "sse.py").write_text("EventStream = object\n")
    original = layering.REPO
    layering.REPO = fake_repo
    try:
        assert layering.against_the_layers(["app.sessions.leaky"]) == [
            "app.sessions.leaky (sessions) imports app.http.sse (http)"
        ]
    finally:
        layering.REPO = original


def test_app_top_level_is_the_platform_and_the_root() -> None:
    """``ls app/`` shows the architecture: about ten platform modules, the root, and one
    folder per layer."""
    modules = {p.stem for p in APP.glob("*.py") if p.stem != "__init__"}
    folders = {p.name for p in APP.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    assert modules == PLATFORM_MODULES | ROOT_MODULES
    assert folders == PLATFORM_PACKAGES | {"sessions", "http", "vllm_routes", "api"}


def test_protocol_is_a_leaf() -> None:
    ours = {m for m in imports_of("app.protocol") if m.startswith("app")}
    assert ours <= {"app.errors"}, ours


def test_the_session_domain_reaches_no_web_framework() -> None:
    modules = [m for m in app_modules() if layer_of(m) == "sessions"]
    assert {"app.sessions.service", "app.sessions.run", "app.sessions.registry"} <= set(modules)
    for module in modules:
        reached = reached_from(module)
        bad = {m: via for m, via in reached.items() if m.split(".")[0] in WEB_FRAMEWORKS}
        assert not bad, f"{module} reaches {bad} (module: imported by)"


def test_the_web_framework_check_sees_one() -> None:
    """Negative control: an API module does import FastAPI, and the walk finds it."""
    assert "fastapi" in reached_from("app.api.sessions.rest")


def test_the_apis_use_the_session_service_through_its_methods_only() -> None:
    """No ``service.registry``, ``sessions.store``, ... in ``app/api``: the domain's parts
    are its own; what an API needs of them is a method of the service."""
    reaches = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in sorted((APP / "api").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if REACH_THROUGH.search(line)
    ]
    assert reaches == []
    assert REACH_THROUGH.search("self.sessions.registry.held")  # the pattern finds one


def test_connectors_import_nothing_of_the_app() -> None:
    for path in (REPO / "connectors").glob("*.py"):
        reached = reached_from(f"connectors.{path.stem}")
        assert not [m for m in reached if m == "app" or m.startswith("app.")], path


def test_no_file_in_app_is_over_600_lines() -> None:
    """A file a newcomer can hold in mind. Past 400 lines a file is named (a place to
    look for a responsibility to split out); past 600 the test fails. A hard 400 made
    files be cut to fit rather than by responsibility."""
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in APP.rglob("*.py")}
    print("over 400 lines:", {name: n for name, n in sizes.items() if n > 400})
    assert {name: n for name, n in sizes.items() if n > 600} == {}
