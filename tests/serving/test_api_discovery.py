"""How a client finds the API (issue 44 item 6): /openapi.json and /docs describe the /v1 routes (not the chat UI's
Gradio routes, which answered there before), and a wrong /v1 path gets OpenAI's error JSON listing the routes."""

from __future__ import annotations

import httpx
import pytest
from conftest import LiveServer, fake_engine

from lightinfer.entrypoints.server import build_api_app

V1_ROUTES = ["GET /v1/models", "GET /v1/models/{model_id}", "POST /v1/chat/completions", "POST /v1/completions"]


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_openapi_json_describes_the_v1_routes_with_the_ui_mounted(fake_server: LiveServer) -> None:
    r = httpx.get(f"{fake_server.url}/openapi.json", timeout=10)  # open, as /docs must fetch it without a key
    assert r.status_code == 200
    schema = r.json()
    assert schema["info"]["title"] == "lightinfer"
    paths = schema["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"} <= set(paths)
    assert not any(p.startswith(("/gradio_api", "/config", "/queue")) for p in paths), list(paths)
    chat = paths["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.split("/")[-1] in schema["components"]["schemas"]  # the request model came along
    # the server has an API key: the /v1 operations say they take a Bearer key, /health does not
    assert "HTTPBearer" in schema["components"]["securitySchemes"]
    assert chat["security"] == [{"HTTPBearer": []}] and "security" not in paths["/health"]["get"]


def test_docs_page_is_the_swagger_ui_of_that_schema(fake_server: LiveServer) -> None:
    r = httpx.get(f"{fake_server.url}/docs", timeout=10)
    assert r.status_code == 200 and "swagger-ui" in r.text and "/openapi.json" in r.text
    # its script and stylesheet come from this server (the ui extra's bundle), not a CDN: it works offline
    assert "cdn." not in r.text and "/docs/assets/swagger-ui-bundle.js" in r.text
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        got = httpx.get(f"{fake_server.url}/docs/assets/{asset}", timeout=10)
        assert got.status_code == 200 and len(got.content) > 10_000


def test_the_api_only_server_serves_the_same_schema() -> None:
    """``lightinfer serve --no-ui``: the same routes, and no Bearer scheme when there is no key."""
    from fastapi.testclient import TestClient

    client = TestClient(build_api_app(fake_engine()))
    schema = client.get("/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"] and "/stats" in schema["paths"]
    assert "securitySchemes" not in schema.get("components", {})
    assert client.get("/docs").status_code == 200


@pytest.mark.parametrize("path", ["/v1/nothing", "/v1/chat/completion", "/v1/v1/models", "/v1", "/v1/"])
def test_an_unknown_v1_route_lists_the_routes(fake_server: LiveServer, path: str) -> None:
    r = httpx.get(f"{fake_server.url}{path}", headers={"Authorization": "Bearer test-key"}, timeout=10)
    assert r.status_code == 404
    error = _error(r)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"Invalid URL (GET {path})")
    assert all(route in error["message"] for route in V1_ROUTES), error["message"]
    assert "/docs" in error["message"]


def test_a_v1_route_with_the_wrong_method_says_which_one(fake_server: LiveServer) -> None:
    r = httpx.get(f"{fake_server.url}/v1/chat/completions", headers={"Authorization": "Bearer test-key"},
                  timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert _error(r)["message"] == "Invalid method for URL (GET /v1/chat/completions): use POST"


def test_the_agents_apis_are_served(fake_server: LiveServer) -> None:
    """An agent's client pointed here finds its API (Claude Code's /v1/messages: tests/serving/test_anthropic_api.py;
    Codex's /v1/responses: tests/serving/test_responses_api.py): a body without fields is that API's 400, not a 404."""
    r = httpx.post(f"{fake_server.url}/v1/messages", json={}, headers={"x-api-key": "test-key"}, timeout=10)
    assert r.status_code == 400 and r.json()["type"] == "error"  # Anthropic's error shape
    assert "messages" in r.json()["error"]["message"]
    r = httpx.post(f"{fake_server.url}/v1/responses", json={}, headers={"Authorization": "Bearer test-key"}, timeout=10)
    assert r.status_code == 400 and _error(r)["param"] == "model"  # OpenAI's error shape
