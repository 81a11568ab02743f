"""Our vLLM general plugin (connectors/cpu_platform.py): found by vLLM, and what it
does in a fresh process, which is how vLLM's engine processes start on CPU (spawn)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

from connectors.cpu_platform import ATTENTION_ENV, PLUGIN_NAME, cpu_has_amx

# What a fresh process sees: the plugin run the way vLLM runs it, then vLLM's own
# choice of CPU attention kernel for the embedded models (bf16, block size 32).
FRESH_PROCESS = """
import json, torch
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
import connectors.cpu_platform as plugin
load_general_plugins()
print(json.dumps({"did": plugin.register(), "bf16_kernel": _get_attn_isa(torch.bfloat16, 32, 64)}))
"""


def run_fresh(**env: str) -> dict[str, str]:
    result = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def test_vllm_finds_the_plugin_by_its_entry_point() -> None:
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    (entry,) = [e for e in entry_points(group=DEFAULT_PLUGINS_GROUP) if e.name == PLUGIN_NAME]
    assert entry.value == "connectors.cpu_platform:register"
    assert PLUGIN_NAME in load_plugins_by_group(DEFAULT_PLUGINS_GROUP)


def test_plugin_in_a_fresh_process() -> None:
    auto = run_fresh(**{ATTENTION_ENV: "auto"})
    without_amx = run_fresh(**{ATTENTION_ENV: "no-amx"})
    if cpu_has_amx():
        assert auto["did"].startswith("requested AMX tile state"), auto
        assert auto["bf16_kernel"] == "amx", auto
        # The diagnostic switch gives the kernel of a CPU without AMX.
        assert without_amx["bf16_kernel"] not in {"amx", ""}, without_amx
    else:
        assert auto["did"] == without_amx["did"] == "no AMX on this CPU: nothing to do"
        assert auto["bf16_kernel"] == without_amx["bf16_kernel"] != "amx"


def test_vllm_plugins_allowlist_switches_it_off() -> None:
    # The negative control of tests/server/test_fresh_server.py relies on this.
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    os.environ["VLLM_PLUGINS"] = ""
    try:
        assert PLUGIN_NAME not in load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    finally:
        del os.environ["VLLM_PLUGINS"]
