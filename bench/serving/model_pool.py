"""Many models behind one server, on a CPU: what loading on demand costs, what an idle loaded model costs the
others, and whether unloading gives the memory back.

One process: a many-model server (``entrypoints/model_pool.py``, built as ``lightinfer serve A B`` builds it) on a
free 127.0.0.1 port serving the embedded SmolLM2 under two names, ``a`` and ``b`` (two engines of the same GGUF),
and the ``openai`` client. Measured in the same run:

* **start-up**: the model started alone as ``lightinfer serve`` starts it before it answers (``AsyncLLMEngine.from_config``
  and the API's request preparation; the second of two) against the time from a request for the unloaded ``b`` to
  its first token (the load plus one prefill);
* **an idle neighbour**: ``a``'s one-user decode speed with ``b`` unloaded and with ``b`` loaded but idle (its
  engine thread parked, as after ``PARK_AFTER_S`` without requests), alternating ``--rounds`` times (medians);
* **memory**: the process's RSS before ``b`` is loaded, while loaded, and after ``POST /models/unload``.

Writes ``bench/results/model_pool.json``.

    python -m bench.serving.model_pool [--rounds 3] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import httpx
import openai
import uvicorn

from bench.common.results import RESULTS, git_commit, utc_now, write_json
from bench.common.servers import free_port

MODEL = "smollm2-135m-instruct"


def rss_bytes() -> int:
    """This process's resident set size (``VmRSS`` of ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def stream(client: openai.OpenAI, model: str, max_tokens: int) -> dict[str, float]:
    """One greedy completion streamed: seconds to the first token and decode tokens/s after it."""
    t0 = time.perf_counter()
    first, count = None, 0
    for chunk in client.completions.create(model=model, prompt="Tell me about the history of Paris.", stream=True,
                                           max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            count += 1
            first = first or time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return {"ttft_s": first - t0, "decode_tokens_per_s": (count - 1) / (end - first)}


def main() -> int:
    from lightinfer.config import EngineConfig
    from lightinfer.engine.async_engine import AsyncLLMEngine
    from lightinfer.entrypoints.model_pool import PARK_AFTER_S, ModelPool, model_entry, release_memory
    from lightinfer.entrypoints.openai_serving import OpenAIServing
    from lightinfer.entrypoints.server import build_api_app

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=RESULTS / "model_pool.json")
    args = ap.parse_args()
    config = EngineConfig(model=MODEL, device="cpu", max_model_len=1024)

    # the start-up time alone, as `lightinfer serve` starts before it answers (the engine, then the API's request
    # preparation with its tokenizer copies): the second of two (the first builds the C ops' cache and imports)
    for _ in range(2):
        t0 = time.perf_counter()
        alone = AsyncLLMEngine.from_config(config, show_progress=False)
        OpenAIServing(alone, MODEL)
        startup_s = time.perf_counter() - t0
        alone.shutdown()
        del alone
        release_memory()

    pool = ModelPool([model_entry(MODEL, "a"), model_entry(MODEL, "b")], config)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_api_app(models=pool), host="127.0.0.1", port=port,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=600, max_retries=0)

    stream(client, "a", 8)  # loads a; warm-up
    rss_before = rss_bytes()
    first_b = stream(client, "b", 8)  # the request that loads b: its time to first token includes the load
    load_b = pool.entries["b"].load_seconds
    rss_loaded = rss_bytes()
    idle_b, without_b, parked = [], [], []
    for _ in range(args.rounds):
        time.sleep(PARK_AFTER_S + 1.0)  # b idle as it stays between requests: its engine thread parked
        parked.append(pool.entries["b"].engine.num_parks > 0)
        idle_b.append(stream(client, "a", args.max_tokens)["decode_tokens_per_s"])  # b loaded, idle
        assert httpx.post(f"{url}/models/unload", json={"model": "b"}, timeout=60).status_code == 200
        without_b.append(stream(client, "a", args.max_tokens)["decode_tokens_per_s"])
        assert httpx.post(f"{url}/models/load", json={"model": "b"}, timeout=600).status_code == 200
    assert httpx.post(f"{url}/models/unload", json={"model": "b"}, timeout=60).status_code == 200
    time.sleep(1.0)
    rss_after = rss_bytes()
    server.should_exit = True

    alone_med, idle_med = statistics.median(without_b), statistics.median(idle_b)
    result = {
        "date": utc_now(), "commit": git_commit(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "model": MODEL, "rounds": args.rounds, "max_tokens": args.max_tokens,
        "startup_alone_s": round(startup_s, 2),
        "first_request_to_unloaded_model": {"ttft_s": round(first_b["ttft_s"], 2),
                                            "load_s": round(load_b or 0.0, 2),
                                            "ttft_over_startup": round(first_b["ttft_s"] / startup_s, 3)},
        "idle_neighbour": {"decode_tokens_per_s_alone": [round(x, 1) for x in without_b],
                           "decode_tokens_per_s_with_idle_model_loaded": [round(x, 1) for x in idle_b],
                           "ratio_of_medians": round(idle_med / alone_med, 3),
                           "idle_engine_thread_parked": parked},
        "memory": {"rss_before_load_mib": round(rss_before / 2**20, 1),
                   "rss_loaded_mib": round(rss_loaded / 2**20, 1),
                   "rss_after_unload_mib": round(rss_after / 2**20, 1),
                   "after_unload_over_before": round(rss_after / rss_before, 3)},
    }
    write_json(args.out, result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
