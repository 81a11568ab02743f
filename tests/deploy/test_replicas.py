"""The scale profile, for real: Debian's HAProxy on loopback with the repo's own
configuration, in front of two app replicas (embedded model, real engines, float32)
that share one PostgreSQL database (Debian's server, started here on loopback).

The proxy hashes on each conversation's routing key, so every chunk of a session, every
turn of a Responses chain or a conversation and a Realtime connection attached to a
session land on one replica while it is up (cache locality). Any replica can resume any session from
the database: stopping one loses no session, its sessions go on on the replica
that inherits their ids, with outputs equal to an uninterrupted run; and two
appends to one session through two replicas at once get one answer and one 409.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import websockets

from tests.deploy import haproxy
from tests.harness.servers import RunningServer, app_server, enter_together, free_port
from tests.helpers import paused_engine
from tests.postgres import needs_postgres, postgres_server

KEY = "replicas-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}

pytestmark = [
    pytest.mark.server,
    haproxy.needs_haproxy,
    needs_postgres,
]
# One conversation: the control runs it uninterrupted, the others are moved about.
CHUNKS: list[list[int]] = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34], [41, 42]]
MAX_TOKENS = 6


@dataclass
class Replica:
    name: str
    port: int
    server: RunningServer

    @property
    def url(self) -> str:
        return self.server.base_url


def replica_settings(name: str, store_url: str) -> dict[str, str]:
    return {
        "api_keys": KEY,
        "replica_name": name,
        "replica_id": name,
        "store_url": store_url,
        "dtype": "float32",
        "kv_cache_gib": "0.25",
        "cpu_tier_gib": "0.5",
        "max_num_seqs": "16",
        "max_sessions": "64",
        "log_level": "warning",
    }


@dataclass
class Cluster:
    proxy: str
    replicas: dict[str, Replica]
    workdir: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("replicas")
    with contextlib.ExitStack() as stack:
        database = stack.enter_context(postgres_server())
        names, ports = ("replica-a", "replica-b"), (free_port(), free_port())
        servers = enter_together(
            stack,
            [
                app_server(name, workdir / f"{name}.log", replica_settings(name, database.url), port=port)
                for name, port in zip(names, ports)
            ],
        )
        replicas = [Replica(name, port, server) for name, port, server in zip(names, ports, servers)]
        proxy = stack.enter_context(haproxy.running({r.name: r.port for r in replicas}, workdir))
        yield Cluster(proxy, {r.name: r for r in replicas}, workdir)


@pytest_asyncio.fixture
async def http(cluster: Cluster) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=cluster.proxy, headers=HEADERS, timeout=120) as client:
        yield client


# Sessions opened by the first test; the failover test closes the book on them.
SESSIONS: dict[str, str] = {}


async def test_rest_chunks_land_on_the_creating_replica(http: httpx.AsyncClient) -> None:
    for index in range(12):
        headers = {"X-Session-ID": f"client-chosen-{index}"} if index % 3 == 0 else {}
        created = await http.post("/v1/sessions", json={"defaults": {"temperature": 0}}, headers=headers)
        assert created.status_code == 201, created.text
        session_id, home = created.json()["id"], created.headers["x-replica"]
        if headers:
            assert session_id == headers["X-Session-ID"]
        for chunk in ([1, 2, 3], "and more", [4, 5]):
            response = await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": chunk, "max_tokens": 2})
            assert response.status_code == 200, response.text
            assert response.headers["x-replica"] == home
        state = await http.get(f"/v1/sessions/{session_id}")
        assert state.headers["x-replica"] == home and state.json()["num_chunks"] == 3
        SESSIONS[session_id] = home
    # Both replicas hold sessions: the hash spreads them.
    assert set(SESSIONS.values()) == {"replica-a", "replica-b"}
    # Requests that name no session reach a replica too.
    completion = await http.post("/v1/completions", json={"model": "embedded-tiny", "prompt": [1, 2], "max_tokens": 2})
    assert completion.status_code == 200


async def test_websocket_sessions_are_routed_by_their_id(cluster: Cluster, http: httpx.AsyncClient) -> None:
    ws_base = cluster.proxy.replace("http://", "ws://")
    for _ in range(6):
        async with websockets.connect(f"{ws_base}/v1/sessions/ws", additional_headers=HEADERS) as ws:
            created = json.loads(await ws.recv())
            assert created["type"] == "session.created"
            session_id = created["session"]["id"]
            await ws.send(json.dumps({"type": "input.append", "input": [7, 8, 9], "max_tokens": 2}))
            while (event := json.loads(await ws.recv()))["type"] != "response.done":
                assert event["type"] == "response.output.delta", event
            # The session id the proxy chose routes REST calls to the same replica.
            state = await http.get(f"/v1/sessions/{session_id}")
            assert state.status_code == 200 and state.json()["num_chunks"] == 1
            # A second connection, attached by id, lands there too.
            async with websockets.connect(
                f"{ws_base}/v1/sessions/{session_id}/ws", additional_headers=HEADERS
            ) as again:
                hello = json.loads(await again.recv())
                assert hello["type"] == "session.updated" and hello["session"]["num_chunks"] == 1
                await again.send(json.dumps({"type": "input.append", "input": [1], "max_tokens": 1}))
                while (event := json.loads(await again.recv()))["type"] != "response.done":
                    pass
            assert (await http.get(f"/v1/sessions/{session_id}")).json()["num_chunks"] == 2
            await ws.send(json.dumps({"type": "session.close"}))


async def send(
    http: httpx.AsyncClient, session_id: str, chunk: list[int], max_tokens: int = MAX_TOKENS
) -> httpx.Response:
    return await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": chunk, "max_tokens": max_tokens})


async def open_session(http: httpx.AsyncClient) -> httpx.Response:
    created = await http.post("/v1/sessions", json={"defaults": {"temperature": 0, "ignore_eos": True}})
    assert created.status_code == 201, created.text
    return created


@pytest_asyncio.fixture(scope="module")
async def expected(cluster: Cluster) -> list[list[int]]:
    """The conversation's outputs, uninterrupted, on one replica."""
    async with httpx.AsyncClient(base_url=cluster.proxy, headers=HEADERS, timeout=120) as http:
        control = (await open_session(http)).json()["id"]
        outputs = []
        for chunk in CHUNKS:
            response = await send(http, control, chunk)
            assert response.status_code == 200, response.text
            outputs.append(response.json()["output"]["token_ids"])
        return outputs


async def test_every_replica_lists_every_replicas_sessions(cluster: Cluster) -> None:
    assert SESSIONS, "runs after test_rest_chunks_land_on_the_creating_replica"
    for replica in cluster.replicas.values():
        async with httpx.AsyncClient(base_url=replica.url, headers=HEADERS, timeout=60) as http:
            listed = {s["id"] for s in (await http.get("/v1/sessions")).json()["data"]}
            assert set(SESSIONS) <= listed


async def test_two_appends_through_two_replicas_get_one_answer_and_one_409(cluster: Cluster) -> None:
    a, b = (cluster.replicas[name] for name in ("replica-a", "replica-b"))
    budgets = [MAX_TOKENS, 64, MAX_TOKENS, MAX_TOKENS]
    async with (
        httpx.AsyncClient(base_url=a.url, headers=HEADERS, timeout=120) as via_a,
        httpx.AsyncClient(base_url=b.url, headers=HEADERS, timeout=120) as via_b,
    ):
        control = (await open_session(via_b)).json()["id"]
        expected = [(await send(via_b, control, c, n)).json()["output"]["token_ids"] for c, n in zip(CHUNKS, budgets)]

        session_id = (await open_session(via_a)).json()["id"]
        assert (await send(via_a, session_id, CHUNKS[0])).status_code == 200
        assert (await via_b.get(f"/v1/sessions/{session_id}")).status_code == 200  # replica-b has it loaded
        # The same chunk through both: replica-a takes the session's lease and
        # answers; replica-b, asked while it does, refuses. Replica-a's engine is
        # stopped (SIGSTOP) before the chunk is sent, so replica-a provably holds the
        # lease and has not committed when replica-b is asked, however fast the chunk
        # would run and however the 2 cores are shared.
        body = {"input": CHUNKS[1], "max_tokens": budgets[1]}
        with paused_engine(a.server.process):
            first = asyncio.create_task(via_a.post(f"/v1/sessions/{session_id}/chunks", json=body))
            deadline = time.monotonic() + 30
            while (await via_a.get(f"/v1/sessions/{session_id}")).json()["status"] != "generating":
                assert not first.done(), first.result().text
                assert time.monotonic() < deadline, "replica-a never started the chunk"
                await asyncio.sleep(0.05)
            assert (await via_b.get(f"/v1/sessions/{session_id}")).json()["num_chunks"] == 1
            refused = await send(via_b, session_id, CHUNKS[1], budgets[1])
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "chunk_in_flight"
        answer = await first
        assert answer.status_code == 200, answer.text
        answered = answer.json()["output"]["token_ids"]
        assert answered == expected[1]
        # The conversation goes on through either replica, each picking up what the
        # other added (a replica whose copy is stale reloads it from the database).
        third = await send(via_b, session_id, CHUNKS[2])
        fourth = await send(via_a, session_id, CHUNKS[3])
        assert [third.status_code, fourth.status_code] == [200, 200], [third.text, fourth.text]
        assert [third.json()["output"]["token_ids"], fourth.json()["output"]["token_ids"]] == expected[2:]
        for via in (via_a, via_b):
            assert (await via.get(f"/v1/sessions/{session_id}")).json()["num_chunks"] == 4


async def test_a_responses_chain_and_a_conversation_go_on_through_either_replica(cluster: Cluster) -> None:
    """OpenAI's stateful APIs across replicas (issue 27): a ``previous_response_id`` chain
    and a conversation whose turns alternate between the replicas. Oracles (float32,
    greedy): each turn's answer equals the same turn of an uninterrupted control on one
    replica; the chain stays one session whose chunks are its turns (each replica takes
    up what the other added, no fork); the conversation's items are every turn's, in
    order; and a response stored by one replica is retrieved through the other."""
    import openai

    a, b = (cluster.replicas[name] for name in ("replica-a", "replica-b"))
    turns = ["one", "two", "three", "four"]

    def text(response: Any) -> str:
        # Random weights emit byte tokens: a reply's text may begin or end with a
        # replacement character where its detokenizer saw another prefix (a live request's
        # own, or a resumed one's), with the same tokens (tests/api/responses/test_responses.py).
        return str(response.output_text).replace("\ufffd", "")

    async with (
        openai.AsyncOpenAI(base_url=f"{a.url}/v1", api_key=KEY, max_retries=0) as via_a,
        openai.AsyncOpenAI(base_url=f"{b.url}/v1", api_key=KEY, max_retries=0) as via_b,
    ):

        async def respond(client: openai.AsyncOpenAI, turn: str, **fields: Any) -> Any:
            return await client.responses.create(
                model="embedded-tiny", input=turn, max_output_tokens=4, temperature=0, **fields
            )

        control, previous = [], None
        for turn in turns:
            response = await respond(via_b, turn, previous_response_id=previous)
            control.append(text(response))
            previous = response.id
        chain, previous = [], None
        for index, turn in enumerate(turns):
            response = await respond((via_a, via_b)[index % 2], turn, previous_response_id=previous)
            chain.append(response)
            previous = response.id
        assert [text(r) for r in chain] == control
        first = chain[0].id
        async with httpx.AsyncClient(base_url=b.url, headers=HEADERS, timeout=60) as http:
            assert (await http.get(f"/v1/sessions/{first}")).json()["num_chunks"] == len(turns)
        assert text(await via_a.responses.retrieve(chain[1].id)) == control[1]

        control_conversation = await via_b.conversations.create()
        expected = [text(await respond(via_b, turn, conversation=control_conversation.id)) for turn in turns]
        conversation = await via_a.conversations.create()
        answers = [
            text(await respond((via_a, via_b)[index % 2], turn, conversation=conversation.id))
            for index, turn in enumerate(turns)
        ]
        assert answers == expected
        items = [item async for item in via_b.conversations.items.list(conversation.id, order="asc")]
        assert [item.role for item in items] == ["user", "assistant"] * len(turns)


# --- affinity: every API that names a conversation stays on the replica that holds it

AFFINITY_TURNS = 10


@dataclass
class Turn:
    replica: str
    computed: int  # prompt tokens computed (usage's computed_tokens)
    added: int  # what the turn added to the context: its input and the template's framing


def turn_of(replica: str, prompt: int, computed: int, before: tuple[int, int] | None) -> Turn:
    """``before``: the previous turn's (prompt, output) tokens; the context grew by this
    turn's prompt less those."""
    return Turn(replica, computed, prompt if before is None else prompt - sum(before))


def off_affinity(turns: list[Turn]) -> list[str]:
    """Each turn after the first that another replica answered, or that computed more
    than it added (+1: the last sampled token of the turn before, which has no KV yet
    and is sent again). Oracle: usage's own split of the prompt, and X-Replica."""
    home = turns[0].replica
    return [
        f"turn {index}: {turn.replica} (home {home}), computed {turn.computed} of {turn.added} added"
        for index, turn in enumerate(turns[1:], 2)
        if turn.replica != home or turn.computed > turn.added + 1
    ]


def words(index: int, tag: str) -> str:
    """A turn's input; ``tag`` differs between conversations, so that no replica's
    prefix cache holds another run's turns."""
    return f"Turn {index} of {tag}: a few more words of the conversation, about twenty tokens, number {index}."


async def responses_turns(proxy: str, *, conversation: bool) -> list[Turn]:
    """A 10-turn Responses chain (``previous_response_id``) or conversation through
    ``proxy``, by the official SDK."""
    import openai

    turns: list[Turn] = []
    tag = secrets.token_hex(4)
    async with openai.AsyncOpenAI(base_url=f"{proxy}/v1", api_key=KEY, max_retries=0) as client:
        link: dict[str, Any] = {}
        if conversation:
            link["conversation"] = (await client.conversations.create()).id
        before = None
        for index in range(AFFINITY_TURNS):
            raw = await client.responses.with_raw_response.create(
                model="embedded-tiny", input=words(index, tag), max_output_tokens=6, temperature=0, **link
            )
            response = raw.parse()
            assert response.usage is not None
            usage = response.usage
            computed = usage.input_tokens_details.model_dump()["computed_tokens"]
            turns.append(turn_of(raw.headers["x-replica"], usage.input_tokens, computed, before))
            before = (usage.input_tokens, usage.output_tokens)
            if not conversation:
                link["previous_response_id"] = response.id
    return turns


async def session_turns(proxy: str) -> list[Turn]:
    """A REST session's 10 chunks of 20 token ids through ``proxy``."""
    turns: list[Turn] = []
    async with httpx.AsyncClient(base_url=proxy, headers=HEADERS, timeout=120) as http:
        session_id = (await open_session(http)).json()["id"]
        before, salt = None, secrets.randbelow(500)
        for index in range(AFFINITY_TURNS):
            chunk = [(7 * index + offset + salt) % 500 + 3 for offset in range(20)]
            answer = await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": chunk, "max_tokens": 4})
            assert answer.status_code == 200, answer.text
            usage = answer.json()["usage"]
            turns.append(
                turn_of(
                    answer.headers["x-replica"],
                    usage["prompt_tokens"],
                    usage["prompt_tokens_details"]["computed_tokens"],
                    before,
                )
            )
            before = (usage["prompt_tokens"], usage["completion_tokens"])
    return turns


async def realtime_turns(proxy: str) -> list[Turn]:
    """A session opened over REST, then two Realtime connections attached to it
    (``?session_id=``), five turns each, through ``proxy``."""
    async with httpx.AsyncClient(base_url=proxy, headers=HEADERS, timeout=120) as http:
        created = await open_session(http)
    session_id = created.json()["id"]
    turns: list[Turn] = []
    before, tag = None, secrets.token_hex(4)
    url = proxy.replace("http://", "ws://") + f"/v1/realtime?model=embedded-tiny&session_id={session_id}"
    for _ in range(2):
        async with websockets.connect(url, additional_headers=HEADERS) as ws:
            replica = ws.response.headers["x-replica"]
            assert json.loads(await ws.recv())["type"] == "session.created"
            for _ in range(AFFINITY_TURNS // 2):
                item = {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": words(len(turns), tag)}],
                }
                await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
                await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 6}}))
                while (event := json.loads(await ws.recv()))["type"] != "response.done":
                    assert event["type"] != "error", event
                usage = event["response"]["usage"]
                turns.append(
                    turn_of(replica, usage["input_tokens"], usage["input_token_details"]["computed_tokens"], before)
                )
                before = (usage["input_tokens"], usage["output_tokens"])
    # The session was created on its home: the REST answer names it.
    assert turns[0].replica == created.headers["x-replica"]
    return turns


async def test_every_stateful_api_stays_on_the_replica_that_holds_its_kv(cluster: Cluster) -> None:
    """A Responses chain, a conversation, a Realtime connection attached to a session
    and a REST session, 10 turns each through the proxy only: each turn after the first
    is answered by the first turn's replica and computes only what it added. Oracles:
    X-Replica on every answer (and the websocket handshake), and usage's computed_tokens
    against the turn's growth of the context."""
    found = {
        "responses chain": await responses_turns(cluster.proxy, conversation=False),
        "conversation": await responses_turns(cluster.proxy, conversation=True),
        "realtime": await realtime_turns(cluster.proxy),
        "session": await session_turns(cluster.proxy),
    }
    print({api: [(t.replica, t.computed, t.added) for t in turns] for api, turns in found.items()})
    assert {api: off_affinity(turns) for api, turns in found.items()} == {api: [] for api in found}


async def test_without_the_key_rules_chains_and_conversations_scatter(cluster: Cluster) -> None:
    """Negative control: the same proxy hashing only the session API's paths (what the
    nginx configuration before it did): a Responses chain and a conversation go to the
    least busy replica each turn, and the check above catches it."""
    with haproxy.running(
        {r.name: r.port for r in cluster.replicas.values()}, cluster.workdir, routing="session-paths"
    ) as old_proxy:
        chain = await responses_turns(old_proxy, conversation=False)
        conversation = await responses_turns(old_proxy, conversation=True)
    print("chain:", off_affinity(chain), "conversation:", off_affinity(conversation))
    assert off_affinity(chain) and off_affinity(conversation)
    # And a turn that changed replica recomputed history, not only what it added.
    for turns in (chain, conversation):
        assert any(turn.computed > turn.added + 1 for turn in turns), [(t.replica, t.computed, t.added) for t in turns]


async def drain_with_a_chunk_in_flight(
    http: httpx.AsyncClient,
    victim: Replica,
    heir: Replica,
    session_id: str,
    expected: list[list[int]],
) -> None:
    """SIGTERM (to the server process alone, as a container runtime sends it) while a
    chunk of ``session_id`` runs on ``victim``, whose engine is paused so that the
    chunk is surely in flight: /ready answers 503 at once, new work sent to the victim
    is refused (after the drain's notice) with 503 server_draining and Retry-After, new work through the proxy
    lands on ``heir``; the chunk in flight completes with the uninterrupted run's
    tokens; the victim exits 0; the session's next chunk goes on on the heir."""
    async with httpx.AsyncClient(base_url=victim.url, headers=HEADERS, timeout=120) as direct:
        with paused_engine(victim.server.process):
            in_flight = asyncio.create_task(send(direct, session_id, CHUNKS[2]))
            deadline = time.monotonic() + 30
            while (await direct.get(f"/v1/sessions/{session_id}")).json()["status"] != "generating":
                assert not in_flight.done() and time.monotonic() < deadline, "the chunk never started"
                await asyncio.sleep(0.05)
            victim.server.process.send_signal(signal.SIGTERM)
            while (ready := await direct.get("/ready")).status_code == 200:
                assert time.monotonic() < deadline + 10, "/ready never failed"
                await asyncio.sleep(0.05)
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "draining", ready.text
            assert (await direct.get("/health")).status_code == 200  # alive: liveness is not readiness
            # New work is still taken for drain_notice_s (the proxy's checks see /ready
            # meanwhile), then refused.
            while (refused := await direct.post("/v1/sessions", json={})).status_code == 201:
                assert time.monotonic() < deadline + 20, "new work was never refused"
                await asyncio.sleep(0.2)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_draining", refused.text
            assert refused.headers["retry-after"] == "1"
            moved = await http.post("/v1/sessions", json={})
            assert moved.status_code == 201 and moved.headers["x-replica"] == heir.name, moved.text
            assert not in_flight.done()
        answer = await in_flight
    assert answer.status_code == 200, answer.text
    assert answer.json()["output"]["token_ids"] == expected[2]
    assert await asyncio.to_thread(victim.server.process.wait, 60) == 0
    following = await send(http, session_id, CHUNKS[3])
    assert following.status_code == 200 and following.headers["x-replica"] == heir.name, following.text
    assert following.json()["output"]["token_ids"] == expected[3]


async def test_a_stopped_replicas_sessions_go_on_elsewhere(
    cluster: Cluster, http: httpx.AsyncClient, expected: list[list[int]]
) -> None:
    homes: dict[str, str] = {}
    # The proxy hashes new sessions' keys over both replicas; 40 sessions all landing on one
    # replica (a chance of 2 in 2**40) would mean the proxy does not spread them.
    while set(homes.values()) != {"replica-a", "replica-b"} or len(homes) < 6:
        assert len(homes) < 40, f"the proxy sent every new session to one replica: {set(homes.values())}"
        created = await open_session(http)
        session_id = created.json()["id"]
        homes[session_id] = created.headers["x-replica"]
        for chunk in CHUNKS[:2]:
            response = await send(http, session_id, chunk)
            assert response.status_code == 200 and response.headers["x-replica"] == homes[session_id]
    victim, heir = cluster.replicas["replica-a"], cluster.replicas["replica-b"]
    draining = next(session_id for session_id, home in homes.items() if home == victim.name)
    await drain_with_a_chunk_in_flight(http, victim, heir, draining, expected)
    homes.pop(draining)
    # The proxy fails over at once (the drained replica is marked down, then refuses
    # connections), so no request sees a 503 or a 404: each session's next chunk
    # resumes on replica-b from the database, with the outputs of the uninterrupted run.
    for session_id, home in homes.items():
        for index in (2, 3):
            response = await send(http, session_id, CHUNKS[index])
            assert response.status_code == 200, (home, response.text)
            assert response.headers["x-replica"] == "replica-b"
            assert response.json()["output"]["token_ids"] == expected[index], (home, index)
    for session_id in SESSIONS:  # the first test's sessions, from both replicas
        response = await send(http, session_id, [3, 4], max_tokens=2)
        assert response.status_code == 200, response.text
    completion = await http.post("/v1/completions", json={"model": "embedded-tiny", "prompt": [1, 2], "max_tokens": 2})
    assert completion.status_code == 200 and completion.headers["x-replica"] == "replica-b"
