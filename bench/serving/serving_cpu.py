"""Serving throughput on CPU over HTTP: one user alone, then 8 users at once, same server.

Starts lightinfer's server in-process on a free 127.0.0.1 port with SmolLM2-135M (the cached AWQ
checkpoint of ``make demo`` when present, else the GGUF), INT8 KV unless ``--kv-cache-dtype``
says otherwise, and streams chat completions with the ``openai`` client. Writes
``bench/results/serving_cpu.json``. The server is built as ``lightinfer serve`` builds it
(``AsyncLLMEngine.from_config`` + ``entrypoints.server.build_api_app``: the serving seam it measures), in this
process so that nothing else shares the cores.

    python -m bench.serving.serving_cpu [--model M] [--max-tokens 64] [--users 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

import openai
import uvicorn

from bench.common.results import RESULTS, write_json
from bench.common.servers import free_port

PROMPTS = ["Tell me about the history of Paris.", "Explain how a bicycle works.", "Write a poem about the sea.",
           "What are the benefits of exercise?", "Describe a day in the life of a farmer.",
           "How do airplanes fly?", "Give me three tips for learning to cook.", "Why is the sky blue?"]


async def _one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> dict[str, float]:
    """Stream one chat completion; returns tokens, TTFT and decode time (seconds)."""
    t0 = time.perf_counter()
    first = None
    usage = None
    stream = await client.chat.completions.create(
        model="bench", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.7,
        seed=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        if chunk.usage:
            usage = chunk.usage
    end = time.perf_counter()
    first = first or end
    return {"tokens": usage.completion_tokens, "ttft_s": first - t0, "total_s": end - t0, "decode_s": end - first}


async def _measure(url: str, users: int, max_tokens: int) -> dict[str, Any]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", timeout=600, max_retries=0) as client:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*[_one(client, PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(users)])
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in runs)
    return {
        "users": users, "tokens": tokens, "wall_s": round(wall, 3),
        "total_tokens_per_s": round(tokens / wall, 2),
        "per_user_tokens_per_s": round(sum(r["tokens"] / r["total_s"] for r in runs) / users, 2),
        "per_user_decode_tokens_per_s": round(sum((r["tokens"] - 1) / r["decode_s"] for r in runs) / users, 2),
        "mean_ttft_s": round(sum(r["ttft_s"] for r in runs) / users, 3),
    }


def main() -> int:
    from lightinfer.cli.serve import cache_dir
    from lightinfer.config import EngineConfig
    from lightinfer.engine.async_engine import AsyncLLMEngine
    from lightinfer.entrypoints.server import build_api_app

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    awq = cache_dir() / "smollm2-135m-instruct-awq"
    ap.add_argument("--model", default=str(awq) if (awq / "config.json").is_file() else "smollm2-135m-instruct")
    ap.add_argument("--kv-cache-dtype", default="int8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--dtype", default="auto", help="engine dtype (auto: on a CPU bf16 for a 4-bit model)")
    ap.add_argument("--threads", type=int, default=None, help="engine CPU threads (default: all usable cores)")
    ap.add_argument("--out", type=Path, default=RESULTS / "serving_cpu.json")
    args = ap.parse_args()

    t0 = time.perf_counter()
    # loaded on the engine's own thread, as `lightinfer serve` does (AsyncLLMEngine.from_config)
    engine = AsyncLLMEngine.from_config(EngineConfig(model=args.model, device="cpu", max_model_len=1024,
                                                     kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype,
                                                     threads=args.threads))
    load_s = time.perf_counter() - t0
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_api_app(engine, served_model_name="bench"),
                                           host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    asyncio.run(_measure(url, 1, 8))  # warm-up
    one = asyncio.run(_measure(url, 1, args.max_tokens))
    many = asyncio.run(_measure(url, args.users, args.max_tokens))
    stats = engine.get_stats()
    server.should_exit = True
    info = engine.model_info()
    result = {
        "model": info["model"], "quantization": info["quantization"],
        "kv_cache_dtype": args.kv_cache_dtype, "dtype": info["dtype"],
        "max_tokens": args.max_tokens, "load_s": round(load_s, 1),
        "cpu_count": os.cpu_count(), "torch_threads": __import__("torch").get_num_threads(),
        "platform": platform.platform(), "one_user": one, "many_users": many,
        "speedup_total_vs_one_user": round(many["total_tokens_per_s"] / one["total_tokens_per_s"], 2),
        "engine_max_batch_size": stats.max_batch_size,
    }
    write_json(args.out, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
