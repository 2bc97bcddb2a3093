"""One small interface over llguidance and over xgrammar, so bench/structured_libs.py measures both the
same way. Each library is used with its own defaults (as vLLM uses them), 2 threads for batched fills."""

from __future__ import annotations

import json
from typing import Any

import torch


class CompileError(Exception):
    """The library refused the grammar (syntax, unsupported feature)."""


class Adapter:
    """compile(kind, spec) -> compiled; matcher(compiled); fill(matchers, bitmask, parallel) writes
    rows 0..len-1 (a loop over the rows on this thread, or the library's batched call on 2 threads); accept / terminated per matcher; accepts(compiled, text) for the fixed instances."""

    version: str
    eos: int

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos = tokenizer.eos_token_id

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def clear_cache(self) -> None:
        pass


def _lark_choice(choices: list[str]) -> str:
    return "start: " + " | ".join(json.dumps(c) for c in choices)


class LlguidanceAdapter(Adapter):
    """Regexes with ``\\d`` / ``\\w`` as ASCII classes (``regex_to_lark(.., "dw")``, as lightinfer
    compiles them); llguidance's default is Unicode, xgrammar's ASCII."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        super().__init__(tokenizer, vocab_size)
        self.lib, self.lt = llguidance, llguidance.torch
        self.version = llguidance.__version__
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor(num_threads=2)
        self.templates: dict[str, Any] = {}

    def compile(self, kind: str, spec: Any) -> str:
        M = self.lib.LLMatcher
        grammar = {"json": lambda: M.grammar_from_json_schema(spec), "regex": lambda: M.grammar_from_lark(f"start: /{self.lib.regex_to_lark(spec, 'dw')}/"),
                   "choice": lambda: M.grammar_from_lark(_lark_choice(spec)),
                   "lark": lambda: M.grammar_from_lark(spec)}[kind]()
        is_error, messages = M.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise CompileError("; ".join(messages))
        return grammar

    def matcher(self, compiled: str) -> Any:
        # llguidance builds its lexer lazily in each new matcher (~1-10 ms to the first mask); a deep
        # copy of a template that has computed its first mask starts warm (~0.01 ms), as an engine's
        # compile cache would hold it. The cold path is what compile_times measures.
        template = self.templates.get(compiled)
        if template is None:
            template = self.new_matcher(compiled)
            template.compute_bitmask()
            self.templates[compiled] = template
        return template.deep_copy()

    def new_matcher(self, compiled: str) -> Any:
        m = self.lib.LLMatcher(self.ll_tokenizer, compiled, log_level=0)
        if m.is_error():
            raise CompileError(m.get_error())
        return m

    def clear_cache(self) -> None:
        self.templates.clear()

    def fill(self, matchers: list[Any], bitmask: torch.Tensor, parallel: bool = False) -> None:
        if parallel:
            self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        else:
            for i, m in enumerate(matchers):
                self.lt.fill_next_token_bitmask(m, bitmask, i)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def terminated(self, m: Any) -> bool:
        return m.is_stopped()

    def accepts(self, compiled: str, text: str) -> bool:
        m = self.new_matcher(compiled)
        return m.consume_tokens(self.ids(text)) and m.is_accepting()


class XgrammarAdapter(Adapter):
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar

        super().__init__(tokenizer, vocab_size)
        self.lib = xgrammar
        self.version = xgrammar.__version__ if hasattr(xgrammar, "__version__") else _dist_version("xgrammar")
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=2)

    def compile(self, kind: str, spec: Any) -> Any:
        c = self.compiler
        try:
            return {"json": lambda: c.compile_json_schema(spec), "regex": lambda: c.compile_regex(spec),
                    "choice": lambda: c.compile_lark(_lark_choice(spec)), "lark": lambda: c.compile_lark(spec)}[kind]()
        except (RuntimeError, ValueError) as e:
            raise CompileError(str(e)) from e

    def matcher(self, compiled: Any) -> Any:
        return self.lib.GrammarMatcher(compiled)

    new_matcher = matcher

    def fill(self, matchers: list[Any], bitmask: torch.Tensor, parallel: bool = False) -> None:
        if parallel:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def terminated(self, m: Any) -> bool:
        return m.is_terminated()

    def accepts(self, compiled: Any, text: str) -> bool:
        m = self.matcher(compiled)
        return all(m.accept_token(t) for t in self.ids(text)) and m.is_completed()

    def clear_cache(self) -> None:
        self.compiler.clear_cache()


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


ADAPTERS: dict[str, type[Adapter]] = {"llguidance": LlguidanceAdapter, "xgrammar": XgrammarAdapter}
