"""The batched step: bitmask layout, in-place masking, padded LM heads, mixed batches, threads."""

from __future__ import annotations

import pytest
import torch

from lightinfer.structured import (
    StructuredBatch,
    StructuredOutputs,
    allocate_token_bitmask,
    apply_token_bitmask_,
    unpack_bitmask,
)
from lightinfer.structured.bitmask import unpack_bitmask_by_shifts


def reference_allowed(bitmask: torch.Tensor, n: int) -> torch.Tensor:
    """The layout spelled out: bit t % 32 of word t // 32, one token at a time."""
    out = torch.zeros(bitmask.shape[0], n, dtype=torch.bool)
    for r in range(bitmask.shape[0]):
        for t in range(min(n, 32 * bitmask.shape[1])):
            out[r, t] = bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1)
    return out


def test_unpack_matches_the_layout() -> None:
    g = torch.Generator().manual_seed(0)
    bm = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=g)
    for n in (1, 31, 100, 128, 150):  # 150 > 32 * 4: the tail is disallowed
        assert torch.equal(unpack_bitmask(bm, n), reference_allowed(bm, n))
    for n in (1, 100, 128):  # the GPU path, run on CPU
        assert torch.equal(unpack_bitmask_by_shifts(bm, n), reference_allowed(bm, n))


def test_allocate() -> None:
    bm = allocate_token_bitmask(2, 49152)
    assert bm.shape == (2, 1536) and bm.dtype == torch.int32 and bool((bm == -1).all())
    assert allocate_token_bitmask(1, 33).shape == (1, 2)
    with pytest.raises(ValueError, match=">= 1"):
        allocate_token_bitmask(0, 10)


def test_apply_rows_and_padded_vocab() -> None:
    g = torch.Generator().manual_seed(1)
    vocab, width = 70, 80  # LM head padded past the tokenizer's 70 tokens
    bm = torch.randint(-(2**31), 2**31 - 1, (4, 3), dtype=torch.int32, generator=g)
    logits = torch.randn(4, width, generator=g)
    before = logits.clone()
    out = apply_token_bitmask_(logits, bm, rows=[1, 3], vocab_size=vocab)
    assert out is logits
    allowed = reference_allowed(bm, vocab)
    for r in (1, 3):
        assert torch.equal(logits[r, :vocab][allowed[r]], before[r, :vocab][allowed[r]])
        assert bool(torch.isneginf(logits[r, :vocab][~allowed[r]]).all())
        assert bool(torch.isneginf(logits[r, vocab:]).all())  # padding columns never sampled
    for r in (0, 2):  # unconstrained rows: bit-identical
        assert torch.equal(logits[r], before[r])
    whole = before.clone()
    apply_token_bitmask_(whole, bm, vocab_size=vocab)
    assert torch.equal(whole[[1, 3]], logits[[1, 3]])
    narrow = before[:, :40].clone()  # logits narrower than the bitmask: the bitmask is cut
    apply_token_bitmask_(narrow, bm)
    assert torch.equal(torch.isneginf(narrow), ~reference_allowed(bm, 40))
    with pytest.raises(ValueError, match="same batch"):
        apply_token_bitmask_(before[:2], bm)
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_(before, bm.long())


def test_mixed_batch_leaves_unconstrained_rows_bit_identical(byte_backend) -> None:
    step = StructuredBatch(byte_backend.vocab_size)
    spec = StructuredOutputs(json={"type": "object"})
    matchers = [None, byte_backend.matcher(spec), None, None, byte_backend.matcher(spec)]
    logits = torch.randn(5, byte_backend.vocab_size + 7)
    before = logits.clone()
    step(logits, matchers)
    assert step.rows == [1, 4]
    for r in (0, 2, 3):
        assert torch.equal(logits[r], before[r])
    brace = byte_backend.tokenizer.encode("{", add_special_tokens=False)[0]
    for r in (1, 4):  # only "{" (and "{\"") may open a JSON object
        finite = torch.isfinite(logits[r]).nonzero().flatten().tolist()
        assert brace in finite and len(finite) <= 3
    none = torch.randn(3, 10)
    same = none.clone()
    assert torch.equal(step(none, [None, None, None]), same) and step.rows == []
    with pytest.raises(ValueError, match="2 matchers for 3 rows"):
        step(none, [None, None])


def test_threads_fill_the_same_bitmask(smollm2_backend) -> None:
    be = smollm2_backend
    specs = [StructuredOutputs(json={"type": "object", "properties": {"k": {"type": "string"}}}),
             StructuredOutputs(regex=r"[a-z]+@[a-z]+\.com"), StructuredOutputs(choice=["alpha", "beta"])]
    matchers = [be.matcher(specs[i % 3]) if i % 4 else None for i in range(12)]
    prefix = {0: '{"k": "ab', 1: "abc@x", 2: "al"}
    for i, m in enumerate(matchers):
        if m is not None:
            assert m.accept_tokens(be.tokenizer.encode(prefix[i % 3], add_special_tokens=False))
    one = StructuredBatch(be.vocab_size, num_threads=1)
    two = StructuredBatch(be.vocab_size, num_threads=2, parallel_min_rows=1)
    assert one.fill(matchers) == two.fill(matchers) == [i for i in range(12) if i % 4]
    assert torch.equal(one.bitmask[one.rows], two.bitmask[two.rows])
    assert one.bitmask.shape[0] >= 12  # grown to the batch
    with pytest.raises(ValueError, match="num_threads"):
        StructuredBatch(10, num_threads=0)
