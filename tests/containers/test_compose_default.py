"""compose's default profile, for real: the CPU image, one server, reached through its
published port by the official openai SDK and the project's own client; a restart of
the container keeps the session. And the failure the static checks cannot see: an
image whose state directory the container's user cannot write never becomes ready,
and the check says so with the server's own error.

Oracle: the server's own answers (health, usage, the session's transcript) across a
container restart; the engine is the real one in the image."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from clients.sync_client import SessionsClient
from tests.containers.compose import API_KEY, ROOT, Compose, free_port, render
from tests.containers.conftest import WORKDIR
from tests.containers.podman import Podman

UNWRITABLE_STATE = """FROM {image}
USER root
RUN chown -R root:root /var/lib/streamsess && chmod 755 /var/lib/streamsess
USER app
"""


@pytest.fixture()
def server(podman: Podman, cpu_image: str) -> Iterator[tuple[Compose, int]]:
    port = free_port()
    file = ROOT / "docker" / f".compose-check-{os.getpid()}.yaml"  # beside compose.yaml: its relative mounts
    render(file, {"streaming-sessions:cpu": cpu_image})
    try:
        with Compose(podman, file, f"streamsess-check-{os.getpid()}", {"STREAMSESS_PORT": str(port)}) as compose:
            compose("up", "-d", "server")
            yield compose, port
    finally:
        file.unlink(missing_ok=True)


def test_default_profile_serves_sessions_across_a_restart(server: tuple[Compose, int]) -> None:
    compose, port = server
    started = compose.wait_ready("server", port)
    print(f"\nserver ready {started:.0f} s after compose up")
    assert compose.healthcheck("server"), "compose's healthcheck fails on a ready server"

    base = f"http://127.0.0.1:{port}/v1"
    sdk = openai.OpenAI(base_url=base, api_key=API_KEY)
    model = sdk.models.list().data[0].id
    chat = sdk.chat.completions.create(
        model=model, max_tokens=8, temperature=0, messages=[{"role": "user", "content": "Say hello."}]
    )
    assert chat.choices[0].message.content and chat.usage and chat.usage.completion_tokens > 0
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong").models.list()

    client = SessionsClient(base_url=f"http://127.0.0.1:{port}", api_key=API_KEY)
    over_websocket = client.sessions.create(defaults={"max_tokens": 4, "temperature": 0}, transport="websocket")
    first = over_websocket.send("The meeting starts at nine. ")
    assert first.usage.prompt_tokens > 0 and first.text
    over_rest = client.sessions.attach(over_websocket.id)
    second = over_rest.send("Then the budget review. ")
    assert second.index == first.index + 1
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # the first chunk's KV, kept

    compose("restart", "-t", "60", "server")  # a stop drains: the websocket is told to reconnect
    compose.wait_ready("server", port)
    assert client.sessions.retrieve(over_websocket.id).id == over_websocket.id  # SQLite in the volume
    third = over_rest.send("And lunch at noon. ")
    assert third.index == second.index + 1
    transcript = client.sessions.transcript(over_websocket.id).text
    for chunk in ("The meeting starts at nine.", "Then the budget review.", "And lunch at noon."):
        assert chunk in transcript
    over_rest.close()
    client.close()


def test_unwritable_state_directory_is_caught(podman: Podman, cpu_image: str) -> None:
    """Negative control: the Dockerfile still parses and compose still validates (the
    static checks pass), but the container's user cannot write its state directory."""
    broken = f"{cpu_image}-unwritable-state"
    dockerfile = WORKDIR / "Dockerfile.unwritable-state"
    dockerfile.write_text(UNWRITABLE_STATE.format(image=cpu_image))
    podman.build(broken, dockerfile, WORKDIR)
    port = free_port()
    file = ROOT / "docker" / f".compose-check-broken-{os.getpid()}.yaml"
    render(file, {"streaming-sessions:cpu": broken})
    try:
        with Compose(podman, file, f"streamsess-check-broken-{os.getpid()}", {"STREAMSESS_PORT": str(port)}) as compose:
            compose("up", "-d", "server")
            with pytest.raises(RuntimeError) as caught:
                compose.wait_ready("server", port, timeout_s=240)
        print(f"\ncaught: {str(caught.value)[-600:]}")
        assert "Permission denied" in str(caught.value) or "not writable" in str(caught.value)
    finally:
        file.unlink(missing_ok=True)
        podman("rmi", "-f", broken, check=False)
        Path(dockerfile).unlink(missing_ok=True)
