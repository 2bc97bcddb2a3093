"""Does vLLM load a compressed-tensors checkpoint written by ``lightinfer quantize`` unchanged?

Writes a checkpoint of the embedded SmolLM2 with ``lightinfer quantize --format compressed-tensors``
(RTN by default: the format is the point, not the quality), then loads that folder as it is with
vLLM's CPU build (the venv ``python -m bench.serving.peer_serving --setup`` makes under ``.peers/``) and with
lightinfer, and greedily completes the same prompts with both. Prints and writes
``bench/results/vllm_load_check.json``: vLLM's chosen quantization kernel, both outputs, and how
many prompts agree (the two engines compute in different dtypes, bf16 vs fp32, so near-ties may
flip; the check is that vLLM loads the folder and answers sensibly).

    python -m bench.quality.vllm_load_check [--method rtn|awq] [--out-dir /tmp/ct-check] [--peers .peers]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common.peer_install import vllm_python
from bench.common.results import RESULTS, write_json
from bench.common.servers import vllm_preload

PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colors are",
           "Water boils at a temperature of"]
MAX_TOKENS = 24

# Run inside vLLM's venv: vLLM spawns its engine process, hence the __main__ guard.
VLLM_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=512, enforce_eager=True, gpu_memory_utilization=0.1)
    outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=int(sys.argv[3])))
    print("RESULT " + json.dumps([o.outputs[0].text for o in outs]))
"""


def run_vllm(python: Path, folder: Path) -> tuple[list[str], str]:
    """vLLM's greedy completions of :data:`PROMPTS` and the log line naming its W4A16 kernel."""
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    preload = vllm_preload(python.parent / "vllm")
    if preload:
        env["LD_PRELOAD"] = ":".join(str(p) for p in preload)
    proc = subprocess.run([str(python), "-c", VLLM_SCRIPT, str(folder), json.dumps(PROMPTS), str(MAX_TOKENS)],
                          env=env, capture_output=True, text=True, timeout=1800, check=False)
    log = proc.stdout + proc.stderr
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise SystemExit(f"vLLM could not load {folder} (exit {proc.returncode}):\n{log[-4000:]}")
    kernel = next((line.split("] ", 1)[-1] for line in log.splitlines() if "LinearKernel" in line), "")
    return json.loads(results[-1][len("RESULT "):]), kernel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="rtn", choices=["rtn", "awq"])
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/lightinfer-ct-check"))
    p.add_argument("--peers", type=Path, default=Path(".peers"))
    args = p.parse_args()
    python = vllm_python(args.peers)
    if not python.is_file():
        raise SystemExit(f"no vLLM venv at {python}: run `python -m bench.serving.peer_serving --setup` first")
    folder = args.out_dir / f"smollm2-ct-{args.method}"
    if not (folder / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "lightinfer.cli", "quantize", "smollm2-135m-instruct", "--out",
                        str(folder), "--method", args.method, "--format", "compressed-tensors", "--force"],
                       check=True)
    t0 = time.perf_counter()
    vllm_out, kernel = run_vllm(python, folder)
    vllm_s = time.perf_counter() - t0
    from lightinfer import LLM, SamplingParams

    llm = LLM(str(folder))
    ours = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                                       use_tqdm=False)]
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "checkpoint": str(folder),
              "quantization_config": json.loads((folder / "config.json").read_text())["quantization_config"],
              "vllm_kernel": kernel, "vllm_seconds": round(vllm_s, 1), "prompts": PROMPTS,
              "vllm": vllm_out, "lightinfer": ours,
              "same_first_8_chars": sum(a[:8] == b[:8] for a, b in zip(vllm_out, ours))}
    out = write_json(RESULTS / "vllm_load_check.json", result)
    print(f"vLLM kernel: {kernel}")
    for prompt, a, b in zip(PROMPTS, vllm_out, ours):
        print(f"{prompt!r}\n  vLLM:       {a!r}\n  lightinfer: {b!r}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
