"""Errors that fuzzing found shaped wrong: each must be a 4xx in the OpenAI shape."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import auth
from tests.server.test_errors import assert_openai_error

pytestmark = pytest.mark.server


async def test_a_body_that_is_not_json_to_vllms_routes_gets_400_not_500(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=30) as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            response = await http.post(path, content=b"prompt=1", headers={"content-type": "text/plain"})
            error = assert_openai_error(response, 400, "invalid_request")
            assert "application/json" in error["message"]


async def test_405_names_every_method_the_path_serves(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=30) as http:
        response = await http.put("/v1/sessions")
        assert_openai_error(response, 405)
        assert set(response.headers["allow"].split(", ")) == {"GET", "POST"}
        response = await http.patch("/v1/sessions/sess_x")
        assert_openai_error(response, 405)
        assert set(response.headers["allow"].split(", ")) == {"GET", "DELETE"}
