"""Many models behind one server (``entrypoints/model_pool.py``), on fake engines: loading on demand, the budget of
loaded models (least recently used idle one unloaded), idle unloading, load failures, the manual routes."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import LiveServer, fake_engine, start_server

from lightinfer.config import EngineConfig
from lightinfer.entrypoints.model_pool import ModelPool, model_entry, scan_models_dir
from lightinfer.entrypoints.server import build_api_app

KEY = "pool-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Loader:
    """Fake engines by model source; ``broken`` sources fail to load, ``unreadable`` ones already to be sized (as a
    truncated file fails when its header is read); each load takes ``delay`` seconds."""

    def __init__(self, delay: float = 0.0, broken: tuple[str, ...] = (), unreadable: tuple[str, ...] = ()) -> None:
        self.delay, self.broken, self.unreadable = delay, broken, unreadable
        self.loads: list[str] = []
        self.engines: dict[str, list[weakref.ref]] = {}

    def __call__(self, config: EngineConfig) -> Any:
        time.sleep(self.delay)
        if config.model in self.broken:
            raise ValueError(f"{config.model}: not a GGUF file (bad magic)")
        self.loads.append(config.model)
        engine = fake_engine(step_delay=0.004)
        engine.start()
        self.engines.setdefault(config.model, []).append(weakref.ref(engine))
        return engine

    def estimate(self, config: EngineConfig) -> int:
        if config.model in self.unreadable:
            raise ValueError(f"{config.model} is not a readable GGUF file: its metadata ends early")
        return 1


def make_pool(loader: Loader, names: tuple[str, ...] = ("a", "b", "c"), **kw: Any) -> ModelPool:
    pinned = kw.pop("pinned", ())
    entries = [model_entry(f"/models/{n}.gguf", name=n, pinned=n in pinned) for n in names]
    return ModelPool(entries, EngineConfig(model="fake", device="cpu"), loader=loader, estimator=loader.estimate, **kw)


@pytest.fixture()
def served() -> Iterator[tuple[LiveServer, Loader, ModelPool]]:
    loader = Loader(delay=0.3, broken=("/models/c.gguf",), unreadable=("/models/e.gguf",))
    pool = make_pool(loader, names=("a", "b", "c", "d", "e"), max_loaded=2, idle_unload_s=None)
    live = start_server(build_api_app(models=pool, api_key=KEY), None)
    yield live, loader, pool
    live.stop()


def chat(url: str, model: str, max_tokens: int = 8, **kw: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
        "temperature": 0, **kw})


def states(url: str) -> dict[str, str]:
    return {m["id"]: m["state"] for m in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]}


def test_models_load_on_demand_and_least_recently_used_idle_one_unloads(served: Any) -> None:
    live, loader, _ = served
    assert set(states(live.url).values()) == {"unloaded"}
    card = httpx.get(f"{live.url}/v1/models", headers=AUTH).json()["data"][0]
    assert card["format"] == "gguf" and "size_bytes" not in card  # no such file: size unknown, left out
    first = chat(live.url, "a")
    assert first.status_code == 200 and first.json()["model"] == "a"
    assert chat(live.url, "b").json()["model"] == "b"
    assert states(live.url)["a"] == "loaded" and states(live.url)["b"] == "loaded"

    # a long stream on b keeps it busy; a request for d must unload a (idle, least recently used), not b
    results: dict[str, Any] = {}

    def long_stream() -> None:
        with httpx.stream("POST", f"{live.url}/v1/chat/completions", headers=AUTH, timeout=60, json={
                "model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                "temperature": 0, "stream": True}) as r:
            results["b"] = "".join(r.iter_text())

    t = threading.Thread(target=long_stream)
    t.start()
    time.sleep(0.2)
    chat(live.url, "a")  # a is now the most recently used, but idle: b is busy
    assert chat(live.url, "d").json()["model"] == "d"
    t.join(60)
    assert "[DONE]" in results["b"] and '"finish_reason":"length"' in results["b"]  # b's stream ran to its end
    assert states(live.url) == {"a": "unloaded", "b": "loaded", "c": "unloaded", "d": "loaded", "e": "unloaded"}
    assert loader.loads == ["/models/a.gguf", "/models/b.gguf", "/models/d.gguf"]
    gc.collect()
    assert loader.engines["/models/a.gguf"][0]() is None  # the unloaded engine is gone, not merely stopped


def test_requests_for_a_loading_model_wait_visibly_and_others_are_served(served: Any) -> None:
    live, loader, _ = served
    chat(live.url, "a")
    loader.delay = 1.5
    out: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: out.setdefault("b", chat(live.url, "b")))
    t.start()
    time.sleep(0.4)
    stats = httpx.get(f"{live.url}/stats", headers=AUTH).json()
    assert stats["models"]["b"]["state"] == "loading" and stats["models"]["b"]["waiting_for_load"] == 1
    assert stats["load_queue"] == ["b"] and stats["models"]["b"]["load_queue_position"] == 0
    assert states(live.url)["b"] == "loading"
    t0 = time.monotonic()
    assert chat(live.url, "a").status_code == 200  # served while b loads
    assert time.monotonic() - t0 < 1.0
    t.join(30)
    assert out["b"].status_code == 200
    assert httpx.get(f"{live.url}/stats", headers=AUTH).json()["models"]["b"]["engine"]["num_running"] == 0


def test_unknown_model_and_a_model_that_fails_to_load(served: Any) -> None:
    live, loader, _ = served
    r = chat(live.url, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert all(f"`{n}`" in r.json()["error"]["message"] for n in "abcde")
    assert chat(live.url, "a").status_code == 200 and chat(live.url, "b").status_code == 200
    r = chat(live.url, "e")  # a file that cannot even be opened fails before any model is unloaded for it
    assert r.status_code == 503 and "metadata ends early" in r.json()["error"]["message"]
    assert not r.json()["error"]["message"].startswith("ValueError")
    assert states(live.url)["a"] == "loaded" and states(live.url)["b"] == "loaded"
    r = chat(live.url, "c")
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "model_unavailable" and "bad magic" in err["message"] and err["param"] == "model"
    assert chat(live.url, "c").status_code == 503 and loader.loads.count("/models/c.gguf") == 0
    assert states(live.url)["c"] == "error"
    assert chat(live.url, "a").status_code == 200  # the others keep serving
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_manual_load_and_unload(served: Any) -> None:
    live, _, _ = served
    assert httpx.post(f"{live.url}/models/load", json={"model": "b"}).status_code == 401
    r = httpx.post(f"{live.url}/models/load", headers=AUTH, json={"model": "b"}, timeout=30)
    assert r.status_code == 200 and r.json()["state"] == "loaded" and r.json()["id"] == "b"
    assert httpx.post(f"{live.url}/models/load", headers=AUTH, json={"model": "zz"}).status_code == 404
    r = httpx.post(f"{live.url}/models/load", headers=AUTH, json={"name": "b"})
    assert r.status_code == 400 and "model" in r.json()["error"]["message"]
    r = httpx.post(f"{live.url}/models/unload", headers=AUTH, json={"model": "b"}, timeout=30)
    assert r.status_code == 200 and r.json()["state"] == "unloaded"
    assert states(live.url)["b"] == "unloaded"


def test_idle_model_unloads_and_pinned_one_stays() -> None:
    loader = Loader()
    pool = make_pool(loader, names=("a", "b"), idle_unload_s=0.4, pinned=("a",))
    live = start_server(build_api_app(models=pool), None)
    try:
        assert states(live.url) == {"a": "loaded", "b": "unloaded"}  # pinned: loaded at start
        assert chat(live.url, "b").status_code == 200
        deadline = time.monotonic() + 10
        while states(live.url)["b"] != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert states(live.url) == {"a": "loaded", "b": "unloaded"}
        metrics = httpx.get(f"{live.url}/metrics").text
        assert 'lightinfer_num_requests_running{model_name="a"} 0.0' in metrics
        assert 'lightinfer_requests_finished_total{finish_reason="length",model_name="b"} 1.0' in metrics
    finally:
        live.stop()


def test_pool_refuses_bad_settings(tmp_path: Any) -> None:
    loader = Loader()
    with pytest.raises(ValueError, match="two models are served as 'a'"):
        ModelPool([model_entry("/x/a.gguf"), model_entry("/y/a.gguf")], EngineConfig(model="x"), loader=loader)
    with pytest.raises(ValueError, match="pinned"):
        make_pool(loader, names=("a", "b"), max_loaded=1, pinned=("a", "b"))
    with pytest.raises(ValueError, match="holds no model"):
        scan_models_dir(str(tmp_path))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "mmproj-m.gguf").write_bytes(b"GGUF")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"quantization_config": {"quant_method": "awq"}}')
    (tmp_path / "notes").mkdir()
    found = {e.name: (e.format, e.size_bytes) for e in scan_models_dir(str(tmp_path))}
    assert found == {"hf": ("awq", 0), "m": ("gguf", 4)}


def _serve_args(argv: list[str]) -> Any:
    import argparse

    from lightinfer.cli import serve as commands

    p = argparse.ArgumentParser()
    commands.register(p.add_subparsers(dest="cmd"))
    return p.parse_args(["serve", *argv])


def test_serve_command_line_of_several_models(tmp_path: Any) -> None:
    from lightinfer.cli.serve import model_pool, parse_duration

    assert model_pool(_serve_args(["one.gguf"])) is None  # one model: the one-model server, as before
    (tmp_path / "q.gguf").write_bytes(b"GGUF")
    pool = model_pool(_serve_args(["x.gguf", "y", "--served-model-name", "ex", "why", "--models-dir", str(tmp_path),
                                   "--max-loaded-models", "2", "--idle-unload", "10m", "--pin", "q"]))
    assert pool.names() == ["ex", "why", "q"] and pool.max_loaded == 2 and pool.idle_unload_s == 600
    assert [e.pinned for e in pool.entries.values()] == [False, False, True]
    assert parse_duration("90") == 90 and parse_duration("1.5h") == 5400
    for argv, message in ((["a.gguf", "--pin", "a"], "apply to several models"),
                          (["a.gguf", "b.gguf", "--served-model-name", "x"], "1 name\\(s\\) for 2 MODEL"),
                          (["a.gguf", "b.gguf", "--pin", "c"], "--pin c: no such model"),
                          (["a.gguf", "b.gguf", "--idle-unload", "soon"], "not a time"),
                          ([], "name a model to serve")):
        with pytest.raises(ValueError, match=message):
            model_pool(_serve_args(argv))


def test_model_routes_answer_in_openai_shape_on_either_server() -> None:
    from fastapi.testclient import TestClient

    one = TestClient(build_api_app(fake_engine()))
    r = one.post("/models/load", json={"model": "x"})
    assert r.status_code == 404 and "server of several models" in r.json()["error"]["message"]
    many = TestClient(build_api_app(models=make_pool(Loader(), names=("a", "b"))))
    r = many.get("/models/load")
    assert r.status_code == 405 and "use POST /models/load" in r.json()["error"]["message"]
    assert many.post("/models/nothing").status_code == 404
    r = many.post("/models/load", json={"model": "a"}, headers={})
    assert r.status_code == 200 and r.json()["state"] == "loaded"
