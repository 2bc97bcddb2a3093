"""``pack_for_cpu`` of the quantized linears: low-bit with 16-bit activations (one copy of the codes), the exact
dense path otherwise, a table an embedding reads kept readable; every form gives the layer's own product."""

from __future__ import annotations

import pytest
import torch

from lightinfer.kernels.cpu_lowbit import int4_gemm_available, int8_per_channel_nbytes, int8pack_available
from lightinfer.layers.linear import W4A16Linear
from lightinfer.layers.quant_embed import QuantizedLMHead, QuantizedVocabEmbedding
from lightinfer.layers.w8_linear import W8A16Linear
from lightinfer.layers.weight_forms import (
    DequantizedWeight,
    Int8PerChannelWeight,
    NativeW4Weight,
    PackedDenseWeight,
    TorchInt4Weight,
    W8RuntimeWeight,
)

LOWBIT = (NativeW4Weight, TorchInt4Weight)

pytestmark = pytest.mark.skipif(not int4_gemm_available(), reason="this torch has no CPU int4 GEMM")


def _w4(dtype: torch.dtype, gen: torch.Generator) -> W4A16Linear:
    layer = W4A16Linear(128, 64, True, 32, dtype)
    qweight = torch.randint(-2**31, 2**31 - 1, layer.qweight.shape, generator=gen, dtype=torch.int64).to(torch.int32)
    layer.load_runtime(qweight, torch.rand(layer.scales.shape, generator=gen) * 0.01,
                       torch.rand(layer.zeros.shape, generator=gen) * 15)
    layer.bias.data = torch.randn(64, generator=gen).to(dtype)
    return layer


def _w8(dtype: torch.dtype, gen: torch.Generator, n: int = 256) -> W8A16Linear:
    layer = W8A16Linear(64, n, False, 32, dtype)
    layer.load_runtime(torch.randint(-128, 128, (n, 64), generator=gen).to(torch.int8),
                       torch.rand(2, n, generator=gen) * 0.01, None)
    return layer


def _close(y: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(y.float(), want.float(), rtol=0.02, atol=0.02 * float(want.abs().max()))


def test_w4_stays_4bit_with_bf16_activations_and_replaces_its_runtime_tensors() -> None:
    gen = torch.Generator().manual_seed(0)
    layer = _w4(torch.bfloat16, gen)
    x = torch.randn(5, 128, generator=gen).bfloat16()
    want = torch.nn.functional.linear(x.float(), layer.dense_weight().float(), layer.bias.float())
    layer.pack_for_cpu()
    assert isinstance(layer.weight_impl, LOWBIT) and layer.qweight is None
    _close(layer(x), want)
    with pytest.raises(RuntimeError, match="pack_for_cpu"):
        layer.dense_weight()


def test_fp32_activations_take_the_exact_dense_path() -> None:
    gen = torch.Generator().manual_seed(1)
    layer = _w4(torch.float32, gen)
    x = torch.randn(3, 128, generator=gen)
    want = torch.nn.functional.linear(x, layer.dense_weight(), layer.bias)
    layer.pack_for_cpu()
    assert isinstance(layer.weight_impl, (PackedDenseWeight, DequantizedWeight))
    assert layer.qweight is not None  # the 4-bit tensors stay beside the dense copy
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not int8pack_available(), reason="this torch has no CPU int8 weight-only GEMM")
def test_a_tied_table_keeps_the_files_rows_and_its_head_is_requantized_per_row() -> None:
    gen = torch.Generator().manual_seed(2)
    table = _w8(torch.bfloat16, gen)
    embedding, head = QuantizedVocabEmbedding(table, torch.bfloat16), QuantizedLMHead(table)
    ids = torch.tensor([0, 7, 255])
    rows_before = embedding(ids)
    weight = table.dense_weight()
    head.pack_for_cpu(keep_weight=True)
    # the codes stay (the embedding reads them), the head multiplies by its per-row int8 copy, no 16-bit copy
    assert table.qweight is not None and isinstance(table.weight_impl, Int8PerChannelWeight)
    assert table.weight_impl.nbytes() == int8_per_channel_nbytes(256, 64)
    assert torch.equal(embedding(ids), rows_before)  # the file's rows, exactly
    for rows in (1, 7, 20):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        _close(head(x), x.float() @ weight.t())
    # per-row requantization: every weight within half a step of the row's int8 scale
    pc = table.weight_impl.prepared
    step = pc.scales.float().unsqueeze(1)
    assert bool(((pc.qweight.float() * step - weight).abs() <= 0.5 * step + 1e-6).all())


@pytest.mark.skipif(not int8pack_available(), reason="this torch has no CPU int8 weight-only GEMM")
def test_an_untied_w8_head_holds_only_its_per_row_copy_and_an_embedding_only_table_only_its_codes() -> None:
    gen = torch.Generator().manual_seed(4)
    head_table, embed_table = _w8(torch.bfloat16, gen), _w8(torch.bfloat16, gen)
    head, embedding = QuantizedLMHead(head_table), QuantizedVocabEmbedding(embed_table, torch.bfloat16)
    weight = head_table.dense_weight()
    rows_before = embedding(torch.tensor([3, 9]))
    head.pack_for_cpu(keep_weight=False)
    embed_table.pack_for_cpu()
    assert head_table.qweight is None and isinstance(head_table.weight_impl, Int8PerChannelWeight)
    assert embed_table.qweight is not None and type(embed_table.weight_impl) is W8RuntimeWeight  # not prepared
    assert embed_table.weight_impl.nbytes() == 0 and torch.equal(embedding(torch.tensor([3, 9])), rows_before)
    x = torch.randn(4, 64, generator=gen).bfloat16()
    _close(head(x), x.float() @ weight.t())


def test_a_head_whose_inputs_the_int8_gemm_cannot_take_keeps_the_exact_halves() -> None:
    gen = torch.Generator().manual_seed(5)
    table = W8A16Linear(96, 64, False, 32, torch.bfloat16)  # K = 96: not a multiple of 64
    table.load_runtime(torch.randint(-128, 128, (64, 96), generator=gen).to(torch.int8),
                       torch.rand(3, 64, generator=gen) * 0.01, None)
    head = QuantizedLMHead(table)
    weight = table.dense_weight()
    head.pack_for_cpu(keep_weight=False)
    assert isinstance(table.weight_impl, TorchInt4Weight) and table.weight_impl.prepared.num_splits == 2
    x = torch.randn(3, 96, generator=gen).bfloat16()
    _close(head(x), x.float() @ weight.t())


def test_w8_without_an_embedding_holds_one_copy() -> None:
    gen = torch.Generator().manual_seed(3)
    layer = _w8(torch.bfloat16, gen, n=64)
    layer.pack_for_cpu()
    assert layer.qweight is None and isinstance(layer.weight_impl, TorchInt4Weight)
