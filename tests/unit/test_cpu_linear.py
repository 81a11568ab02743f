"""connectors/cpu_linear.py: which CPUs get vLLM's packed bf16 linear kernel, which weights
and which engines, and that a layer dispatched through vLLM's own code computes with it.

Oracle for the layer: a float32 matmul of the same bf16 inputs. The packed kernel accumulates
in float32 and rounds its output to bf16, as oneDNN does, so its error against float32 must
stay within two of bf16's relative steps (2^-8: rounding, and sums taken in another order);
the negative control hands the kernel an
unpacked weight (a layout mistake) and must see the check fail.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from app.engine import build_engine_args
from app.settings import Settings
from connectors import cpu_linear

AVX512_BF16 = frozenset({"avx512f", "avx512_bf16", "avx2"})


def test_only_avx512_bf16_cpus_without_amx_get_the_packed_kernel() -> None:
    assert cpu_linear.packed_kernel_helps(AVX512_BF16)
    assert not cpu_linear.packed_kernel_helps(AVX512_BF16 | {"amx_tile", "amx_bf16"})  # vLLM chooses there
    assert not cpu_linear.packed_kernel_helps(frozenset({"avx512f", "avx2"}))  # no bf16 dot products
    assert not cpu_linear.packed_kernel_helps(frozenset({"avx2"}))


def test_the_installed_vllm_dispatch_is_the_one_the_plugin_is_for() -> None:
    assert cpu_linear.dispatch_is_known()


@pytest.fixture
def engine_config() -> Iterator[Any]:
    """Enter a vLLM config as model loading does; yields a setter of its ask."""
    from vllm.config import VllmConfig, set_current_vllm_config

    def enter(asks: bool) -> None:
        config = VllmConfig(additional_config={cpu_linear.CONFIG_KEY: cpu_linear.PACKED} if asks else {})
        stack.append(set_current_vllm_config(config))
        stack[-1].__enter__()

    stack: list[Any] = []
    yield enter
    for context in reversed(stack):
        context.__exit__(None, None, None)


def test_the_check_says_yes_to_packable_bf16_weights_of_an_engine_that_asked(engine_config: Any) -> None:
    check = cpu_linear.with_packed_bf16(lambda n, k, dtype: False)  # vLLM's answer without AMX
    assert not check(960, 576, torch.bfloat16)  # no engine config: vLLM's own answer
    engine_config(asks=False)
    assert not check(960, 576, torch.bfloat16)
    engine_config(asks=True)
    assert check(960, 576, torch.bfloat16) and check(49152, 576, torch.bfloat16)  # any size, the LM head too
    assert not check(960, 576, torch.float32)  # bf16 only: a float32 engine computes as before
    assert not check(960, 100, torch.bfloat16) and not check(100, 576, torch.bfloat16)  # K by 32, N by 16
    assert cpu_linear.with_packed_bf16(lambda n, k, dtype: True)(7, 7, torch.float16)  # vLLM's yes stands


def test_our_server_asks_for_it_on_such_a_cpu_unless_told_onednn() -> None:
    asked = {cpu_linear.CONFIG_KEY: cpu_linear.PACKED}
    default = build_engine_args(Settings(_env_file=None)).additional_config
    assert (default == asked) == cpu_linear.packed_kernel_helps(), default
    assert not build_engine_args(Settings(_env_file=None, cpu_linear="onednn")).additional_config


def linear_layer(n: int, k: int) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter((torch.randn(n, k) * 0.05).to(torch.bfloat16), requires_grad=False)
    return layer


def worst_error(output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> float:
    """Largest difference from the float32 product, in bf16 relative steps (2^-8)."""
    reference = x.float() @ weight.float().t()
    ulp = reference.abs().clamp(min=1e-3) * 2.0**-8
    return float(((output.float() - reference).abs() / ulp).max())


@pytest.mark.skipif(
    not cpu_linear.packed_kernel_helps(),
    reason="this CPU is not one the plugin serves (it needs avx512_bf16 and no AMX): vLLM's dispatch is unchanged here",
)
def test_a_layer_dispatched_by_vllm_computes_with_the_packed_kernel(
    engine_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils

    assert cpu_linear.register().startswith("bf16 linear layers use the packed kernel")
    calls: list[int] = []
    packed_linear = ops.weight_packed_linear_cpu
    monkeypatch.setattr(ops, "weight_packed_linear_cpu", lambda *a: calls.append(1) or packed_linear(*a))
    torch.manual_seed(0)
    engine_config(asks=True)
    for n, k in ((960, 576), (576, 1536), (49152, 576)):
        layer = linear_layer(n, k)
        weight = layer.weight.detach().clone()
        utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        for rows in (1, 3, 64):
            x = torch.randn(rows, k).to(torch.bfloat16)
            before = len(calls)
            output = layer.cpu_linear(x, layer.weight, None)
            assert len(calls) == before + 1, "vLLM dispatched this layer elsewhere"
            assert worst_error(output, x, weight) <= 2.0, (n, k, rows)
    # Negative control: the same kernel on an unpacked weight is caught by the same check.
    x = torch.randn(1, 576).to(torch.bfloat16)
    weight = linear_layer(960, 576).weight.detach()
    assert worst_error(packed_linear(x, weight, 960, None), x, weight) > 2.0


def test_an_engine_that_did_not_ask_keeps_onednn(engine_config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils

    cpu_linear.register()
    calls: list[int] = []
    monkeypatch.setattr(ops, "weight_packed_linear_cpu", lambda *a: calls.append(1))
    engine_config(asks=False)
    layer = linear_layer(960, 576)
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    x = torch.randn(1, 576).to(torch.bfloat16)
    assert worst_error(layer.cpu_linear(x, layer.weight, None), x, layer.weight) <= 2.0
    assert not calls
