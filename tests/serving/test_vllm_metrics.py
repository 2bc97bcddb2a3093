"""``/metrics`` speaks the Model Server Protocol: vLLM's names and types, parsed by prometheus_client's own parser,
moving with the load (fake engine)."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
from conftest import fake_engine, start_server
from prometheus_client.parser import text_string_to_metric_families

from lightinfer.entrypoints.server import build_api_app
from lightinfer.entrypoints.vllm_metrics import PROTOCOL


def scrape(url: str) -> dict[str, Any]:
    """Metric families by name (as the parser names them: a counter without ``_total``)."""
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)}


def value(families: dict[str, Any], name: str, **labels: str) -> float:
    fam = families[name]
    return next(s.value for s in fam.samples
                if s.name in (name, name + "_total") and all(s.labels.get(k) == v for k, v in labels.items()))


def test_protocol_names_types_and_that_they_move_with_the_load() -> None:
    engine = fake_engine(step_delay=0.02)
    live = start_server(build_api_app(engine, served_model_name="m"), engine)
    try:
        idle = scrape(live.url)
        for name, kind in PROTOCOL.items():
            assert name in idle and idle[name].type == kind, (name, idle.get(name))
        assert value(idle, "vllm:num_requests_running", model_name="m") == 0
        assert value(idle, "vllm:kv_cache_usage_perc", model_name="m") == 0
        info = next(s for s in idle["vllm:cache_config_info"].samples)
        assert info.value == 1 and info.labels["model_name"] == "m" and info.labels["block_size"] == "16"
        assert int(info.labels["num_gpu_blocks"]) > 0 and info.labels["enable_prefix_caching"] == "True"

        done = threading.Event()

        def stream() -> None:
            httpx.post(f"{live.url}/v1/completions", timeout=60, json={
                "model": "m", "prompt": "x" * 40, "max_tokens": 60, "temperature": 0, "ignore_eos": True})
            done.set()

        threads = [threading.Thread(target=stream) for _ in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        busy = idle
        while time.monotonic() < deadline:
            busy = scrape(live.url)
            if value(busy, "vllm:num_requests_running", model_name="m") >= 1:
                break
            time.sleep(0.02)
        assert value(busy, "vllm:num_requests_running", model_name="m") >= 1
        assert 0 < value(busy, "vllm:kv_cache_usage_perc", model_name="m") <= 1
        for t in threads:
            t.join(60)
        after = scrape(live.url)
        assert value(after, "vllm:num_requests_running", model_name="m") == 0
        assert value(after, "vllm:kv_cache_usage_perc", model_name="m") == 0
        assert value(after, "vllm:generation_tokens", model_name="m") == 180
        assert value(after, "vllm:request_success", model_name="m", finished_reason="length") == 3
        ttft = after["vllm:time_to_first_token_seconds"]
        assert next(s.value for s in ttft.samples if s.name.endswith("_count")) == 3
        assert "lightinfer_num_requests_running" in after  # lightinfer's own names stay
    finally:
        live.stop()
