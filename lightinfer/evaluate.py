"""Perplexity through the engine's own forward path (paged KV prefill, INT8 KV when asked).

The text (the built-in held-out part of ``quant/calib.py``, or a ``.txt`` / ``.jsonl`` file)
is tokenized as one stream without special tokens and cut into non-overlapping windows of
``window`` tokens (2,048 by default, as the README's table reports); each window is scored on its own (``LLMEngine.score``: the log-probability
of every token given the ones before it in the window), so a window of L tokens scores L-1.
``ppl = exp(-sum(logprobs) / tokens_scored)``.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class PerplexityResult:
    """Attributes: ppl; tokens_scored; num_windows; window (tokens); seconds (wall clock)."""

    ppl: float
    tokens_scored: int
    num_windows: int
    window: int
    seconds: float

    def format(self) -> str:
        return (f"perplexity {self.ppl:.4f} over {self.tokens_scored} tokens scored "
                f"({self.num_windows} windows of <= {self.window} tokens, {self.seconds:.1f} s)")


def _engine_of(llm: Any) -> Any:
    for attr in ("llm_engine", "engine"):
        if hasattr(llm, attr):
            return getattr(llm, attr)
    raise AttributeError("LLM object exposes no engine (expected .llm_engine)")


DEFAULT_WINDOW = 2048  # the windows of the README's quality table (bench/quality/quant_quality.py)


def default_window(model: str) -> int:
    """:data:`DEFAULT_WINDOW`, or the model's context when that is shorter (read from its config only)."""
    from lightinfer.loader import Checkpoint

    context = getattr(Checkpoint(model, read_weights=False).hf_config, "max_position_embeddings", None)
    return min(DEFAULT_WINDOW, int(context)) if context else DEFAULT_WINDOW


def perplexity(
    model: str | None = None,
    text_path: str | None = None,
    kv_cache_dtype: str = "auto",
    max_tokens: int | None = None,
    window: int | None = None,
    llm: Any = None,
    progress: bool = False,
    **llm_options: Any,
) -> PerplexityResult:
    """Perplexity of a model on held-out text.

    Args:
        model: anything ``LLM`` accepts (ignored when ``llm`` is given).
        text_path: a ``.txt`` / ``.jsonl`` file; None = the built-in held-out text.
        kv_cache_dtype: "auto" or "int8".
        max_tokens: score at most this many tokens of the text (None: all).
        window: tokens per window (>= 2); None = :data:`DEFAULT_WINDOW` (2,048, what the README reports), or
            the model's context when shorter.
        llm: an already built ``LLM`` to reuse.
        progress: show a progress bar with the windows done, the running perplexity and the time left (stderr).
        llm_options: passed to ``LLM``.
    Raises:
        ValueError: ``window < 2``, ``max_tokens < 2`` or a text shorter than 2 tokens.
    """
    from tqdm.auto import tqdm

    from lightinfer.quant.calib import get_text

    if window is not None and window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    if llm is None:
        from lightinfer.llm import LLM

        window = window or default_window(model)
        llm_options.setdefault("max_model_len", window)
        llm = LLM(model, kv_cache_dtype=kv_cache_dtype, **llm_options)
    engine = _engine_of(llm)
    if window is None:
        window = min(DEFAULT_WINDOW, int(getattr(getattr(engine, "config", None), "max_model_len", DEFAULT_WINDOW)))
    tokenizer = engine.tokenizer if hasattr(engine, "tokenizer") else llm.tokenizer
    ids: list[int] = tokenizer(get_text(text_path, "eval"), add_special_tokens=False)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"the evaluation text has {len(ids)} token(s); need at least 2")
    t0 = time.monotonic()
    nll, scored, windows = 0.0, 0, 0
    starts = [a for a in range(0, len(ids), window) if len(ids) - a >= 2]
    bar = tqdm(total=len(starts), desc="perplexity", unit="window", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    try:
        for a in starts:
            chunk = ids[a : a + window]
            logprobs = engine.score(chunk)  # fp32 [len(chunk) - 1]
            nll -= float(logprobs.double().sum())
            scored += len(chunk) - 1
            windows += 1
            bar.set_postfix(ppl=f"{math.exp(nll / scored):.3f}", tokens=scored, refresh=False)
            bar.update(1)
    finally:
        bar.close()
    return PerplexityResult(math.exp(nll / scored), scored, windows, window, time.monotonic() - t0)
