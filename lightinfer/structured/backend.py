"""One grammar backend per tokenizer: llguidance's view of the vocabulary, the EOS ids, and a cache of
compiled constraints from which every request's :class:`GrammarMatcher` is copied."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf

from lightinfer.structured.matcher import GrammarMatcher
from lightinfer.structured.spec import (
    JSON_NUMBER_GUARD_LARK,
    StructuredOutputs,
    StructuredOutputsError,
    library_message,
)

# Short errors: llguidance's verbose ones dump the parser state and the whole grammar (schema text).
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class GrammarBackend:
    """llguidance set up for one tokenizer; compiles :class:`StructuredOutputs` into matchers.

    Building one reads the whole vocabulary (~0.3-2 s for 50k-150k tokens): make one per model and
    share it. :meth:`matcher` is cheap after the first request with the same constraint: compiling
    (grammar build + the first mask, ~1-15 ms) happens once per distinct constraint, and each request
    gets a deep copy of that warm template (~0.01 ms). Thread-safe.

    Args:
        tokenizer: a transformers *fast* tokenizer (``tokenizer.backend_tokenizer`` exists), e.g. what
            ``AutoTokenizer.from_pretrained`` returns, GGUF-read ones included.
        eos_token_ids: the ids that end a completion (the tokenizer's EOS plus, e.g., Llama 3's
            ``<|eot_id|>`` from generation_config). The grammar allows them exactly where it may end.
            Default: ``[tokenizer.eos_token_id]``.
        cache_size: how many compiled constraints to keep (least recently used dropped first).

    Raises:
        ValueError: a slow (Python) tokenizer, or no EOS id known.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int] | None = None, cache_size: int = 256) -> None:
        if not hasattr(tokenizer, "backend_tokenizer"):
            raise ValueError(f"structured outputs need a fast (Rust) tokenizer, got {type(tokenizer).__name__}; "
                             "load it with AutoTokenizer.from_pretrained(..., use_fast=True)")
        if eos_token_ids is None:
            eos_token_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        eos = sorted({int(t) for t in eos_token_ids})
        if not eos:
            raise ValueError("structured outputs need the EOS token id(s): the tokenizer has no eos_token; "
                             "pass eos_token_ids")
        self.tokenizer = tokenizer
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=eos)
        self.vocab_size: int = self.ll_tokenizer.vocab_size  # tokens the bitmask covers
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._number_guard: Any = None  # compiled JSON_NUMBER_GUARD_LARK, on first JSON request

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row: ``ceil(vocab_size / 32)``."""
        return (self.vocab_size + 31) // 32

    def special_token_id(self, text: str) -> int | None:
        """The id of ``text`` when the tokenizer has it as one special (added) token, else None.
        Tool-call grammars use it to match e.g. Mistral's ``[TOOL_CALLS]`` as the token, not as text."""
        tid = self.tokenizer.convert_tokens_to_ids(text)
        if tid is None or tid == self.tokenizer.unk_token_id or not isinstance(tid, int):
            return None
        return tid if self.ll_tokenizer.is_special_token(tid) else None

    def _compile(self, spec: StructuredOutputs) -> Any:
        m = llguidance.LLMatcher(self.ll_tokenizer, spec.llguidance_grammar, log_level=0, limits=_LIMITS)
        if m.is_error():
            raise StructuredOutputsError(spec.kind, f"cannot be used with this model's tokenizer: "
                                                    f"{library_message(m.get_error())}")
        m.compute_bitmask()  # builds the lexer states of the start: every copy begins warm
        if m.is_error():
            raise StructuredOutputsError(spec.kind, f"cannot be used for constrained decoding: "
                                                    f"{library_message(m.get_error())}")
        return m

    def compile(self, spec: StructuredOutputs) -> Any:
        """The cached template matcher of ``spec`` (compiled on first use).

        Raises:
            StructuredOutputsError: the grammar needs what this tokenizer lacks (e.g. a special token).
        """
        with self._lock:
            template = self._cache.get(spec.key)
            if template is not None:
                self._cache.move_to_end(spec.key)
                return template
        template = self._compile(spec)  # outside the lock: llguidance drops the GIL while compiling
        with self._lock:
            self._cache[spec.key] = template
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return template

    def number_guard(self) -> Any:
        """The compiled template of :data:`~lightinfer.structured.spec.JSON_NUMBER_GUARD_LARK` (any JSON
        value with float64-sized numbers), run beside every JSON constraint."""
        with self._lock:
            if self._number_guard is not None:
                return self._number_guard
        guard = llguidance.LLMatcher(self.ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(JSON_NUMBER_GUARD_LARK),
                                     log_level=0, limits=_LIMITS)
        if guard.is_error():  # a fixed grammar: only a broken library gets here
            raise RuntimeError(f"the JSON number grammar does not compile: {guard.get_error()}")
        guard.compute_bitmask()
        with self._lock:
            self._number_guard = guard
        return guard

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        """A new matcher at the start of ``spec`` for one sequence (see :meth:`compile` for errors)."""
        template = self.compile(spec)
        guard = self.number_guard() if spec.bounds_numbers else None
        with self._lock:  # deep_copy reads the template, which another thread may be copying too
            copy = template.deep_copy()
            guard_copy = guard.deep_copy() if guard is not None else None
        return GrammarMatcher(copy, self.eos_token_ids, guard=guard_copy)

    def cache_info(self) -> dict[str, int]:
        """``{"size": cached constraints, "capacity": cache_size}``."""
        with self._lock:
            return {"size": len(self._cache), "capacity": self.cache_size}
