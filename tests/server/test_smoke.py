from __future__ import annotations

import httpx
import pytest

from tests.conftest import auth

pytestmark = pytest.mark.server


async def test_smoke(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        r = await http.get("/health")
        assert r.status_code == 200
        r = await http.post("/v1/sessions", json={"defaults": {"temperature": 0}})
        print(r.status_code, r.text)
        sid = r.json()["id"]
        r = await http.post(f"/v1/sessions/{sid}/chunks", json={"input": "hello streaming world", "max_tokens": 5})
        print(r.status_code, r.text)
        r = await http.post(f"/v1/sessions/{sid}/chunks", json={"input": [5, 6, 7], "max_tokens": 5, "stream": True})
        print(r.status_code, r.text)
        r = await http.get(f"/v1/sessions/{sid}/transcript")
        print(r.status_code, r.text)
        r = await http.post("/v1/completions", json={"model": "embedded-tiny", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
        print(r.status_code, r.text)
        r = await http.delete(f"/v1/sessions/{sid}")
        print(r.status_code, r.text)
        r = await http.get("/metrics")
        print([l for l in r.text.splitlines() if l.startswith("streamsess_")][:10])
