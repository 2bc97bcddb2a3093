"""The reference side of ``bench/quality/format_quality.py``: a checkpoint's weights as its own tool dequantized
them, run dense in fp32 by transformers, scored on the same token windows lightinfer scores.

Imports only torch and transformers, so both the project venv (GGUF references: transformers' GGUF
reader) and the tools' venv (GPTQModel's / compressed-tensors' / AutoAWQ's dequantizers, in
``bench/quality/format_quality_tools.py``) use this one scorer: the same windows and the same arithmetic as
``lightinfer.evaluate.perplexity`` (non-overlapping windows, each scored on its own, a window of L tokens
scores L-1, ``ppl = exp(-sum(logprobs) / tokens_scored)``).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch


def windows(ids: list[int], window: int) -> list[list[int]]:
    """``ids`` cut into non-overlapping windows of ``window`` tokens, dropping a last one of < 2 tokens
    (exactly the windows ``lightinfer.evaluate.perplexity`` scores)."""
    return [ids[a : a + window] for a in range(0, len(ids), window) if len(ids) - a >= 2]


@torch.no_grad()
def score_dense(model: Any, ids: list[int], window: int) -> dict[str, Any]:
    """Perplexity of a transformers causal LM (fp32, eval mode) on ``ids`` in windows of ``window`` tokens.

    Returns ``{"ppl", "tokens_scored", "seconds"}``; the log-probabilities are taken in fp32 and summed in fp64.
    """
    t0 = time.monotonic()
    nll, scored = 0.0, 0
    for chunk in windows(ids, window):
        x = torch.tensor([chunk])
        logits = model(x, attention_mask=torch.ones_like(x)).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, x[0, 1:, None])[:, 0]
        nll -= float(logprobs.double().sum())
        scored += len(chunk) - 1
    return {"ppl": math.exp(nll / scored), "tokens_scored": scored, "seconds": round(time.monotonic() - t0, 1)}


def dense_model(config: Any, state: dict[str, torch.Tensor]) -> Any:
    """A transformers fp32 causal LM of ``config`` (its ``quantization_config`` dropped) holding ``state``.

    Raises:
        ValueError: a weight of the model that ``state`` does not hold (other than a tied lm_head).
    """
    import transformers

    config.quantization_config = None
    if hasattr(config, "dtype"):
        config.dtype = torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, _ = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if set(missing) - {"lm_head.weight"}:
        raise ValueError(f"the dequantized state lacks {sorted(set(missing) - {'lm_head.weight'})[:5]}")
    model.tie_weights()
    return model


def read_ids(path: Path) -> tuple[list[int], int]:
    """The token ids and window written by ``format_quality.py`` (``{"ids": [...], "window": W}``)."""
    d = json.loads(Path(path).read_text())
    return d["ids"], int(d["window"])
