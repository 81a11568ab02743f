"""A rolling restart under load, and a replica killed mid-chunk: Debian's HAProxy with
the repo's configuration, two replicas (embedded model, real engines, float32) sharing
Debian's PostgreSQL, all on loopback.

Sixteen clients of five kinds (REST, SSE, the session websocket, Responses with
``previous_response_id`` through the official SDK, Realtime attached to a session) send
turns without pause while each replica in turn gets SIGTERM, drains, exits and starts
again. A client retries only what the server says it did not do (503
``server_draining``, ``chunk_undone``, ``replica_unavailable``) and reconnects a
websocket closed with 1012; a request whose fate it cannot know (the connection cut
mid-answer) is resolved by the session's chunk count before it is sent again.

Oracle: each turn's input carries a tag unique to it; at the end, every tag of a turn a
client saw answered is in its conversation's transcript exactly once (none lost, none
applied twice), read from the store through the proxy; and each replica exits 0.

What the negative control showed (run by hand on 2026-12-07, commit after 081abb4, the
drain off: uvicorn's own SIGTERM handling): the replicas exited -15, and 9 websocket
turns were cut mid-answer against 4 with the drain; no turn was lost or doubled even
then, because HAProxy sends again what a stopped replica refused and these clients
resolve a cut turn by its session's chunk count. So this test guards the cluster's
exactly-once outcome; the drain's own promises (a chunk in flight answered, ``/ready``
failing first) are what test_replicas' drain test checks, with its own negative control.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

from clients._common import NOTHING_DONE_CODES, error_code
from tests.deploy import haproxy
from tests.harness.haproxy import Restartable, start_together
from tests.harness.servers import app_server
from tests.helpers import paused_engine
from tests.postgres import needs_postgres, postgres_server

KEY = "rolling-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
KINDS = ("rest", "sse", "websocket", "responses", "realtime")
CLIENTS = 16
MAX_TOKENS = 3
# A client starts a new conversation after this many turns (a session's context is
# bounded), and pauses between turns as an agent between tool calls.
TURNS_PER_CONVERSATION = 60
PAUSE_S = 0.1

pytestmark = [pytest.mark.server, haproxy.needs_haproxy, needs_postgres]


def replica(name: str, store_url: str, workdir: Path) -> Restartable:
    settings = {
        "api_keys": KEY,
        "replica_name": name,
        "replica_id": name,
        "store_url": store_url,
        "dtype": "float32",
        "kv_cache_gib": "0.25",
        "cpu_tier_gib": "0.5",
        "max_num_seqs": "32",
        "max_sessions": "128",
        "log_level": "warning",
        "drain_timeout_s": "30",
    }
    return Restartable(name, lambda port, start: app_server(name, workdir / f"{name}-{start}.log", settings, port=port))


@dataclass
class Cluster:
    proxy: str
    replicas: dict[str, Restartable]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("rolling")
    with contextlib.ExitStack() as stack:
        database = stack.enter_context(postgres_server())
        replicas = [replica(name, database.url, workdir) for name in ("replica-a", "replica-b")]
        start_together(stack, replicas)
        proxy = stack.enter_context(haproxy.running({r.name: r.port for r in replicas}, workdir))
        yield Cluster(proxy, {r.name: r for r in replicas})


# --------------------------------------------------------------------------- clients


@dataclass
class Client:
    kind: str
    number: int
    session_id: str | None = None  # for responses: the chain's first session
    answered: list[str] = field(default_factory=list)
    retries: int = 0
    reconnects: int = 0
    unknown: int = 0  # requests cut mid-answer, resolved by the session's chunk count
    replicas: Counter[str] = field(default_factory=Counter)
    last_response_id: str | None = None
    # Conversations the client went on from: (session id, or None for a chain; its tags).
    earlier: list[tuple[str | None, list[str]]] = field(default_factory=list)

    def tag(self) -> str:
        return f"[c{self.number:02d}s{len(self.earlier):02d}t{len(self.answered):03d}]"

    def conversations(self) -> list[tuple[str | None, list[str]]]:
        current = self.session_id if self.kind != "responses" else None
        return [*self.earlier, (current, self.answered)] if self.answered else self.earlier

    def turns(self) -> int:
        return sum(len(tags) for _, tags in self.conversations())

    def full(self) -> bool:
        return len(self.answered) >= TURNS_PER_CONVERSATION

    def begin_again(self) -> None:
        self.earlier.append((self.session_id if self.kind != "responses" else None, self.answered))
        self.answered, self.session_id, self.last_response_id = [], None, None


class Unanswered(Exception):
    """A refusal that did nothing: send the turn again."""


def text_of(tag: str) -> str:
    return f"{tag} more of the live transcript"


async def chunks_of(http: httpx.AsyncClient, session_id: str) -> int:
    while True:
        with contextlib.suppress(httpx.TransportError):
            answer = await http.get(f"/v1/sessions/{session_id}")
            if answer.status_code == 200:
                return int(answer.json()["num_chunks"])
        await asyncio.sleep(0.2)


def refusal(answer: httpx.Response) -> None:
    """Raise Unanswered for a refusal that did nothing; fail on anything else."""
    code = error_code(answer)
    if answer.status_code in (502, 503) and (code in NOTHING_DONE_CODES or code is None):
        raise Unanswered(code)
    if answer.status_code == 409 and code == "chunk_in_flight":
        raise Unanswered(code)  # a lease not yet released by a replica that stopped
    raise AssertionError(f"{answer.status_code} {answer.text}")


async def http_turn(http: httpx.AsyncClient, client: Client, stream: bool) -> None:
    assert client.session_id is not None
    before = await chunks_of(http, client.session_id)
    body = {"input": text_of(client.tag()), "max_tokens": MAX_TOKENS, "stream": stream}
    try:
        async with http.stream("POST", f"/v1/sessions/{client.session_id}/chunks", json=body) as answer:
            if answer.status_code != 200:
                await answer.aread()
                refusal(answer)
            payload = (await answer.aread()).decode()
            client.replicas[answer.headers.get("x-replica", "?")] += 1
    except httpx.TransportError:
        client.unknown += 1
        if await chunks_of(http, client.session_id) == before + 1:
            return  # applied: the answer was lost, not the turn
        raise Unanswered("cut") from None
    if stream:
        events = [json.loads(line[6:]) for line in payload.splitlines() if line.startswith("data: {")]
        assert events and events[-1]["object"] == "session.chunk.done", payload[-500:]


async def websocket_turns(proxy: str, http: httpx.AsyncClient, client: Client, stop: asyncio.Event) -> None:
    """Session websocket or Realtime, attached to the client's session; reconnects."""
    while not stop.is_set():
        if client.full():
            client.begin_again()
            client.session_id = await open_session(http)
        path = (
            f"/v1/sessions/{client.session_id}/ws"
            if client.kind == "websocket"
            else f"/v1/realtime?model=embedded-tiny&session_id={client.session_id}"
        )
        url = proxy.replace("http://", "ws://") + path
        assert client.session_id is not None
        try:
            async with websockets.connect(url, additional_headers=HEADERS, open_timeout=30) as ws:
                hello = json.loads(await ws.recv())
                if hello["type"] == "error":
                    raise Unanswered(hello["error"]["code"])
                replica = ws.response.headers.get("x-replica", "?") if ws.response else "?"
                while not stop.is_set() and not client.full():
                    await asyncio.sleep(PAUSE_S)
                    before = await chunks_of(http, client.session_id)
                    try:
                        await websocket_turn(ws, client)
                    except ConnectionClosed:
                        client.unknown += 1
                        if await chunks_of(http, client.session_id) == before + 1:
                            client.answered.append(client.tag())
                        raise
                    client.replicas[replica] += 1
                    client.answered.append(client.tag())
        except (Unanswered, ConnectionClosed, InvalidStatus, OSError, TimeoutError):
            client.reconnects += 1
            await asyncio.sleep(0.3)


async def websocket_turn(ws: Any, client: Client) -> None:
    tag = client.tag()
    if client.kind == "websocket":
        await ws.send(json.dumps({"type": "input.append", "input": text_of(tag), "max_tokens": MAX_TOKENS}))
    else:
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text_of(tag)}]}
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": MAX_TOKENS}}))
    while True:
        event = json.loads(await ws.recv())
        if event["type"] == "error":
            code = event["error"]["code"]
            assert code in NOTHING_DONE_CODES, event
            raise Unanswered(code)  # the connection goes; the server closes it with 1012
        if event["type"] == "response.done":
            return


async def responses_turn(openai_client: Any, client: Client) -> None:
    import openai

    try:
        raw = await openai_client.responses.with_raw_response.create(
            model="embedded-tiny",
            input=text_of(client.tag()),
            max_output_tokens=MAX_TOKENS,
            temperature=0,
            previous_response_id=client.last_response_id,
        )
    except openai.APIStatusError as exc:
        refusal(exc.response)
        raise
    client.replicas[raw.headers.get("x-replica", "?")] += 1
    response = raw.parse()
    client.session_id = client.session_id or response.id
    client.last_response_id = response.id


async def run_client(proxy: str, client: Client, stop: asyncio.Event) -> None:
    import openai

    async with (
        httpx.AsyncClient(base_url=proxy, headers=HEADERS, timeout=180) as http,
        openai.AsyncOpenAI(base_url=f"{proxy}/v1", api_key=KEY, max_retries=0, timeout=180) as sdk,
    ):
        if client.kind != "responses":
            client.session_id = await open_session(http)
        if client.kind in ("websocket", "realtime"):
            await websocket_turns(proxy, http, client, stop)
            return
        while not stop.is_set():
            await asyncio.sleep(PAUSE_S)
            if client.full():
                client.begin_again()
                if client.kind != "responses":
                    client.session_id = await open_session(http)
            try:
                if client.kind == "responses":
                    await responses_turn(sdk, client)
                else:
                    await http_turn(http, client, stream=client.kind == "sse")
            except (Unanswered, openai.APIConnectionError):
                client.retries += 1
                await asyncio.sleep(0.2)
                continue
            client.answered.append(client.tag())


async def open_session(http: httpx.AsyncClient) -> str:
    while True:
        created = await http.post("/v1/sessions", json={"defaults": {"temperature": 0}})
        if created.status_code == 201:
            return str(created.json()["id"])
        with contextlib.suppress(Unanswered):
            refusal(created)
        await asyncio.sleep(0.2)


async def answered(http: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> httpx.Response:
    """A request through the proxy as a client sends it: a 503 with Retry-After (a replica
    just restarted, or draining) is sent again after it, for at most a minute; any other
    answer is returned, and so is the last 503."""
    deadline = time.monotonic() + 60
    while True:
        response = await http.request(method, url, **kwargs)
        if response.status_code != 503 or time.monotonic() > deadline:
            return response
        await asyncio.sleep(float(response.headers.get("retry-after", "1")))


async def transcript_text(http: httpx.AsyncClient, session_id: str | None, tags: list[str], open_ids: list[str]) -> str:
    """The text of the session that holds a conversation: a session's own, or for a
    chain (``session_id`` None) the open session whose transcript has its last tag (a
    chain's latest response may be in a fork)."""
    for candidate in [session_id] if session_id is not None else open_ids:
        response = await answered(http, "GET", f"/v1/sessions/{candidate}/transcript")
        assert response.status_code == 200, response.text
        text = str(response.json()["text"])
        if tags[-1] in text:
            return text
    raise AssertionError(f"no session holds the turn {tags[-1]}")


async def test_a_rolling_restart_under_load_loses_nothing(cluster: Cluster) -> None:
    stop = asyncio.Event()
    clients = [Client(KINDS[n % len(KINDS)], n) for n in range(CLIENTS)]
    tasks = [asyncio.create_task(run_client(cluster.proxy, c, stop), name=f"client-{c.number}") for c in clients]
    stopped = {}
    try:
        await asyncio.sleep(5)
        for each in cluster.replicas.values():
            stopped[each.name] = await asyncio.to_thread(each.sigterm_and_wait)
            await asyncio.to_thread(each.start)
            await asyncio.sleep(3)  # HAProxy's checks see it up (rise 2, every 1 s)
        await asyncio.sleep(5)
    finally:
        stop.set()
        done, pending = await asyncio.wait(tasks, timeout=300)
    assert not pending, "clients did not finish their last turn within 300 s"
    for task in done:
        task.result()  # a client's assertion (an unexpected error) fails the test here
    report = {
        f"{c.kind}-{c.number}": {
            "turns": c.turns(),
            "retries": c.retries,
            "reconnects": c.reconnects,
            "cut": c.unknown,
            "replicas": dict(c.replicas),
        }
        for c in clients
    }
    print(json.dumps({"exit statuses": stopped, "clients": report}, indent=1))
    assert stopped == dict.fromkeys(cluster.replicas, 0), stopped  # each drained and exited cleanly
    async with httpx.AsyncClient(base_url=cluster.proxy, headers=HEADERS, timeout=120) as http:
        listed = await answered(http, "GET", "/v1/sessions")
        assert listed.status_code == 200, listed.text
        open_ids = [s["id"] for s in listed.json()["data"]]
        for client in clients:
            assert client.conversations(), f"{client.kind} client {client.number} saw no turn answered"
            for session_id, tags in client.conversations():
                text = await transcript_text(http, session_id, tags, open_ids)
                counts = {tag: text.count(tag) for tag in tags}
                assert set(counts.values()) == {1}, (client.kind, client.number, counts)
    assert all(c.turns() >= 3 for c in clients), report


async def test_a_killed_replicas_session_goes_on_once_its_lease_expires(cluster: Cluster) -> None:
    """``kill -9`` of a replica's whole process group while a chunk of one of its sessions
    runs through the proxy (the engine paused, so the chunk surely holds the session's
    lease and has not committed): the client gets 502 ``replica_failed`` naming the
    session, and the proxy does not send the chunk again; the chunk is not in the
    transcript. The session's next chunk lands on the other replica, which answers 409
    chunk_in_flight while the dead replica's lease lasts and then takes the session up.
    The time until then is printed (bounded by session_lease_s after the last
    renewal), not asserted."""
    victim, heir = cluster.replicas["replica-a"], cluster.replicas["replica-b"]
    assert victim.server is not None
    async with (
        httpx.AsyncClient(base_url=victim.server.base_url, headers=HEADERS, timeout=120) as direct,
        httpx.AsyncClient(base_url=cluster.proxy, headers=HEADERS, timeout=120) as http,
    ):
        for _ in range(40):  # a session the proxy homes on the victim (a chance of 2**-40 to miss)
            created = await answered(http, "POST", "/v1/sessions", json={})
            assert created.status_code == 201, created.text
            if created.headers["x-replica"] == victim.name:
                break
        assert created.headers["x-replica"] == victim.name
        session_id = created.json()["id"]
        assert (
            await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": "one", "max_tokens": 2})
        ).status_code == 200
        # On a connection of its own: HAProxy answers 502 for a connection's first request
        # (on a later one it closes the connection instead, its keep-alive rule).
        fresh = httpx.AsyncClient(base_url=cluster.proxy, headers=HEADERS, timeout=120)
        with paused_engine(victim.server.process):
            in_flight = asyncio.create_task(
                fresh.post(f"/v1/sessions/{session_id}/chunks", json={"input": "two", "max_tokens": 2})
            )
            deadline = time.monotonic() + 30
            while (await direct.get(f"/v1/sessions/{session_id}")).json()["status"] != "generating":
                assert time.monotonic() < deadline, "the chunk never started"
                await asyncio.sleep(0.05)
            victim.kill()
            killed_at = time.monotonic()
        cut = await in_flight
        await fresh.aclose()
        assert cut.status_code == 502 and cut.json()["error"]["code"] == "replica_failed", cut.text
        assert session_id in cut.json()["error"]["message"]
    # New connections from here on: HAProxy closes the client connections it held to the
    # dead replica, and a pooled one may already be closed (no request is lost: none left).
    async with httpx.AsyncClient(base_url=cluster.proxy, headers=HEADERS, timeout=120) as http:
        refused = failed = 0
        while True:
            answer = await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": "three", "max_tokens": 2})
            code = error_code(answer)
            if answer.status_code == 502 and code == "replica_failed":
                # Sent before the proxy's health check saw the replica die (it checks every
                # second): as the error says, the state is read before sending again.
                failed += 1
                if await chunks_of(http, session_id) == 2:
                    break
            elif answer.status_code != 409:
                assert answer.status_code == 200 and answer.headers["x-replica"] == heir.name, answer.text
                break
            else:
                assert code == "chunk_in_flight", answer.text
                refused += 1
            assert time.monotonic() - killed_at < 120, "the dead replica's lease never expired"
            await asyncio.sleep(0.25)
        waited = time.monotonic() - killed_at
        state = (await http.get(f"/v1/sessions/{session_id}")).json()
        assert state["num_chunks"] == 2, state  # "one" and "three": the killed chunk is not there
    print(
        f"after kill -9: {refused} answers 409 chunk_in_flight, {failed} 502 replica_failed (sent before the "
        f"proxy saw the death), the session went on on {heir.name} after {waited:.1f} s (session_lease_s 6)"
    )
