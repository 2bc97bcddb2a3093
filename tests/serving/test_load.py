"""Load: 32 concurrent streaming clients over HTTP, a quarter disconnecting midway (real SmolLM2).

Every other request must complete with exactly ``max_tokens`` tokens (``ignore_eos``), ``/health``
must keep answering during the load, the engine must have batched them together, and afterwards
every KV block must be free (the disconnected requests were aborted, not left running).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from conftest import LiveServer, wait_idle

NUM_CLIENTS, MAX_TOKENS = 32, 12


async def _client(c: httpx.AsyncClient, i: int, disconnect: bool) -> dict:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": f"Tell me fact number {i} about cats."}],
            "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": i, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    result: dict = {"i": i, "chunks": 0, "usage": None, "finish": None, "done": False}
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result["done"] = True
                break
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                result["chunks"] += 1
                result["finish"] = chunk["choices"][0]["finish_reason"] or result["finish"]
            if chunk.get("usage"):
                result["usage"] = chunk["usage"]
            if disconnect and result["chunks"] >= 3:
                break  # leaving the block closes the connection mid-stream
    return result


def test_32_streaming_clients_quarter_disconnect(real_server: LiveServer) -> None:
    wait_idle(real_server.url)
    health_codes: list[int] = []

    async def poll_health(c: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            health_codes.append((await c.get("/health", timeout=5)).status_code)
            assert time.monotonic() - t0 < 2.0, "/health was slow under load"
            await asyncio.sleep(0.2)

    async def main() -> list[dict]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 4)
        async with httpx.AsyncClient(base_url=real_server.url, timeout=180, limits=limits) as c:
            stop = asyncio.Event()
            health = asyncio.create_task(poll_health(c, stop))
            results = await asyncio.gather(*[_client(c, i, disconnect=i % 4 == 0) for i in range(NUM_CLIENTS)])
            stop.set()
            await health
            return results

    results = asyncio.run(main())
    completed = [r for r in results if r["i"] % 4]
    assert len(completed) == 24
    for r in completed:
        assert r["done"] and r["finish"] == "length", r
        assert r["usage"]["completion_tokens"] == MAX_TOKENS, r
    assert health_codes and set(health_codes) == {200}
    stats = wait_idle(real_server.url)
    assert stats["max_batch_size"] > 8  # the clients ran in one continuous batch
    metrics = httpx.get(f"{real_server.url}/metrics").text
    assert 'lightinfer_requests_finished_total{finish_reason="abort"}' in metrics
