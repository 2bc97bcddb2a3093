"""Peak memory of AWQ on a 7B-shaped model (random weights, reduced calibration): issue 3 asks
that a 7B model quantize within 24 GB of RAM on a CPU (8 GB of GPU memory on CUDA).

A Llama-2-7B-shaped checkpoint (hidden 4096, intermediate 11008, 32 heads, vocab 32000) with
only ``--layers`` decoder layers (disk and time) is written to a temp folder and quantized.
One decoder layer is on the compute device at a time, so the working set does not grow with
depth; what grows is the quantized output kept for the final write (measured per layer). The
estimate for 32 layers is ``peak + (32 - layers) * quantized bytes per layer``.

Usage: ``python -m bench.quality.quant_memory [--layers 2] [--num-samples 4] [--seq-len 128] [--device cpu]``
Writes ``bench/results/quant_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common.results import RESULTS
from lightinfer.quant.api import quantize
from lightinfer.quant.config import QuantConfig
from tests.conftest import _save_tokenizer

SHAPE = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
         "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}


def write_7b_shaped(folder: Path, layers: int) -> None:
    """Random fp16 weights of Llama-2-7B's shapes (``layers`` decoder layers) + config + tokenizer."""
    h, i, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.float16)

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(v, h), "lm_head.weight": rnd(v, h),
                                  "model.norm.weight": torch.ones(h, dtype=torch.float16)}
    for n in range(layers):
        p = f"model.layers.{n}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[f"{p}.self_attn.{name}.weight"] = rnd(h, h)
        t[f"{p}.mlp.gate_proj.weight"] = rnd(i, h)
        t[f"{p}.mlp.up_proj.weight"] = rnd(i, h)
        t[f"{p}.mlp.down_proj.weight"] = rnd(h, i)
        t[f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
           "hidden_act": "silu", "torch_dtype": "float16", "tie_word_embeddings": False, "rope_theta": 10000.0,
           "bos_token_id": 256, "eos_token_id": 257, **SHAPE}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    _save_tokenizer(folder, SHAPE["vocab_size"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(RESULTS / "quant_memory.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="li-7b-") as tmp:
        src, dst = Path(tmp) / "src", Path(tmp) / "out"
        src.mkdir()
        write_7b_shaped(src, args.layers)
        s = quantize(str(src), dst, QuantConfig(num_samples=args.num_samples, seq_len=args.seq_len,
                                                device=args.device, group_size=128))
        print(s.format())
        per_layer = s.linear_quant_bytes / args.layers
        est = s.peak_memory_bytes + (32 - args.layers) * per_layer
        res = {"shape": SHAPE, "layers": args.layers, "num_samples": args.num_samples, "seq_len": args.seq_len,
               "device": s.device, "peak_memory_mib": s.peak_memory_bytes >> 20, "peak_kind": s.peak_memory_kind,
               "quantized_bytes_per_layer_mib": round(per_layer / 2**20, 1),
               "estimated_peak_32_layers_gib": round(est / 2**30, 2), "seconds": round(s.seconds, 1),
               "limit_gib": 24 if s.device == "cpu" else 8}
        print(json.dumps(res, indent=2))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
