"""connectors/compile_cache.py without an engine: the guard finds the installed vLLM's loader
(so the plugin applies to it), the wrapper gives a loaded plain function the method vLLM's
loader calls and leaves one that has it alone, and the serve script's check for a compiler.
The engine-level check, with its negative control, is tests/server/test_compile_cache.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from connectors import compile_cache


def test_the_installed_vllm_loader_is_the_one_the_fix_is_for() -> None:
    assert compile_cache.loader_needs_it()


def loader_of(compiled: Any) -> Any:
    return lambda *args, **kwargs: SimpleNamespace(_artifacts=SimpleNamespace(compiled_fn=compiled))


def test_a_loaded_plain_function_gets_a_finalize_loading() -> None:
    def inductor_compiled(*args: Any) -> None: ...

    loaded = compile_cache.with_finalize(loader_of(inductor_compiled))("file")
    loaded._artifacts.compiled_fn.finalize_loading(object())  # what vLLM's loader calls: no error


def test_a_function_with_its_own_finalize_loading_keeps_it() -> None:
    calls: list[Any] = []
    piecewise = SimpleNamespace(finalize_loading=calls.append)
    loaded = compile_cache.with_finalize(loader_of(piecewise))("file")
    loaded._artifacts.compiled_fn.finalize_loading("config")
    assert calls == ["config"]


def test_without_a_compiler_the_serve_script_serves_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert not compile_cache.can_compile()
