"""Our vLLM general plugin that counts and traces each chunk of a streaming-input request
(connectors/streaming_stats.py): vLLM finds it, and on the installed vLLM both of its
guards pass (a vLLM whose code moved makes it do nothing, which this test would catch
before the counters test does). In a fresh process: registering patches classes.
Oracle: what ``register`` says it did, and the classes it patched."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

from connectors.streaming_stats import PLUGIN_NAME, _chunk_trace_headers, register_chunk_trace

FRESH_PROCESS = """
import json
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.output_processor import OutputProcessor
import connectors.streaming_stats as plugin
did = plugin.register()
print(json.dumps({"did": did, "patched": [Scheduler._update_request_as_session.__module__,
                                          OutputProcessor._update_stats_from_output.__module__]}))
"""


def test_vllm_finds_the_plugin_by_its_entry_point() -> None:
    from vllm.plugins import DEFAULT_PLUGINS_GROUP

    (entry,) = [e for e in entry_points(group=DEFAULT_PLUGINS_GROUP) if e.name == PLUGIN_NAME]
    assert entry.value == "connectors.streaming_stats:register"


def test_both_halves_apply_to_the_installed_vllm() -> None:
    result = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "nothing done" not in report["did"], report
    assert report["patched"] == ["connectors.streaming_stats"] * 2, report


def test_a_chunks_trace_context_is_kept_until_forgotten() -> None:
    register_chunk_trace("req-1", {"traceparent": "00-aa-bb-01"})
    register_chunk_trace("req-2", {})  # not tracing: nothing kept
    assert _chunk_trace_headers.get("req-1") == {"traceparent": "00-aa-bb-01"} and "req-2" not in _chunk_trace_headers
    register_chunk_trace("req-1", None)
    assert "req-1" not in _chunk_trace_headers
