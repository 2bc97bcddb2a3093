"""Who may use what (issue 19 item 2): the chat UI's routes honour --api-key (they generated and uploaded
without it), uploads are off, /stats and /metrics take the key, and the start-up banner says what is open."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from conftest import LiveServer, fake_engine, start_server

from lightinfer.cli.serve import access_summary
from lightinfer.webui.server import build_app

CHAT_DATA = {"data": ["hi", [], "", 0, 1, 0, 8, -1, ""]}  # ..., seed, JSON schema box


@pytest.fixture(scope="module")
def keyed() -> Iterator[LiveServer]:
    engine = fake_engine()
    live = start_server(build_app(engine, api_key="k3y"), engine)
    yield live
    live.stop()


def _call_chat(client: httpx.Client) -> httpx.Response:
    r = client.post("/gradio_api/call/chat", json=CHAT_DATA)
    if r.status_code != 200:
        return r
    return client.get(f"/gradio_api/call/chat/{r.json()['event_id']}", timeout=20)


def test_ui_routes_need_the_api_key(keyed: LiveServer) -> None:
    with httpx.Client(base_url=keyed.url, timeout=20) as c:
        assert c.post("/gradio_api/call/chat", json=CHAT_DATA).status_code == 401  # generated without it before
        assert c.post("/gradio_api/queue/join", json={**CHAT_DATA, "fn_index": 0, "session_hash": "x"}
                      ).status_code == 401
        assert c.get("/config").status_code == 401
        assert c.post("/login", data={"username": "me", "password": "wrong"}).status_code in (400, 401)
        assert c.post("/login", data={"username": "anyone", "password": "k3y"}).status_code == 200
        r = _call_chat(c)
        assert r.status_code == 200 and "event: complete" in r.text and "The capi" in r.text


def test_uploads_are_off(keyed: LiveServer) -> None:
    """/gradio_api/upload wrote files without credentials; nothing in the chat UI uploads, so it is off."""
    engine = fake_engine()
    open_live = start_server(build_app(engine), engine)
    try:
        for live in (keyed, open_live):
            with httpx.Client(base_url=live.url, timeout=10) as c:
                c.post("/login", data={"username": "u", "password": "k3y"})
                r = c.post("/gradio_api/upload", files={"files": ("a.txt", b"hello")})
                assert r.status_code == 403 and "uploads are off" in r.text
        # without a key the UI itself stays open (127.0.0.1 by default)
        assert httpx.get(f"{open_live.url}/config").status_code == 200
    finally:
        open_live.stop()


def test_stats_and_metrics_take_the_key_health_stays_open(keyed: LiveServer) -> None:
    for path in ("/stats", "/metrics"):
        assert httpx.get(f"{keyed.url}{path}").status_code == 401
        assert httpx.get(f"{keyed.url}{path}", headers={"Authorization": "Bearer k3y"}).status_code == 200
    assert "num_running" in httpx.get(f"{keyed.url}/stats", headers={"Authorization": "Bearer k3y"}).json()
    assert httpx.get(f"{keyed.url}/health").status_code == 200


def test_ui_auth_is_the_uis_own_login() -> None:
    engine = fake_engine()
    live = start_server(build_app(engine, api_key="k3y", ui_auth=("alice", "pw")), engine)
    try:
        with httpx.Client(base_url=live.url, timeout=20) as c:
            assert c.post("/login", data={"username": "alice", "password": "k3y"}).status_code in (400, 401)
            assert c.post("/login", data={"username": "alice", "password": "pw"}).status_code == 200
            assert _call_chat(c).status_code == 200
    finally:
        live.stop()


def test_the_banner_says_what_is_open_to_whom() -> None:
    text = access_summary("127.0.0.1", False, None, False)
    assert "this machine only" in text and "open, no key" in text and "open, no login" in text
    text = access_summary("0.0.0.0", True, None, False)
    assert "anyone who can reach 0.0.0.0" in text and "Bearer API key required" in text
    assert "login with the API key as password" in text and "uploads: off" in text
    assert "login as 'alice' (--ui-auth)" in access_summary("::1", True, ("alice", "pw"), False)
    assert "not served (--no-ui)" in access_summary("127.0.0.1", True, None, True)


def test_run_serve_prints_the_access_banner(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import argparse

    from serving_fakes import FakeLLMEngine

    from lightinfer.cli import build_parser
    from lightinfer.engine import llm_engine
    from lightinfer.entrypoints import server

    served = {}
    monkeypatch.setattr(llm_engine, "LLMEngine", lambda config, **_: FakeLLMEngine(config))
    monkeypatch.setattr(server, "run_server", lambda app, host, port, **kw: served.update(kw, host=host))
    from conftest import free_port

    args = build_parser().parse_args(["serve", "fake", "--api-key", "k", "--port", str(free_port()),
                                      "--timeout-header", "3", "--device", "cpu"])
    assert isinstance(args, argparse.Namespace) and args.func(args) == 0
    out = capsys.readouterr().out
    assert "/v1, /metrics, /stats: Bearer API key required" in out and "login with the API key" in out
    assert served["limits"].timeout_header == 3 and served["limits"].limit_concurrency == 512
