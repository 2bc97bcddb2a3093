"""Embeddings through the engine (``LLM.embed``, pooling engines): vectors equal transformers' ``Qwen3Model`` pooled
and normalised in fp32, alone or batched, in one step or in chunks (last token and mean), cut to ``dimensions``;
no KV kept once pooled; generation and embeddings each refused by the other kind of engine."""

from __future__ import annotations

import pytest
import torch

from lightinfer import LLM
from lightinfer.formats.sentence_transformers import read_pooler_config
from lightinfer.inputs import InputError, PoolerConfig, PoolingParams
from lightinfer.sampling_params import SamplingParams
from tests.conftest import write_tiny_checkpoint
from tests.fixtures.embedding_models import (
    reference_embedding,
    tiny_qwen3_model,
    write_embedding_checkpoint,
    write_sentence_transformers_files,
)

ATOL = 2e-5  # fp32: the engine's kernels sum in another order than transformers'
PROMPTS = ["hello world", "a", "The quick brown fox jumps over the lazy dog " * 3, "embeddings, batched"]


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def assert_all_blocks_free(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return tiny_qwen3_model()


@pytest.fixture(scope="module")
def last_llm(tmp_path_factory: pytest.TempPathFactory, hf_model: torch.nn.Module) -> LLM:
    """Last-token pooling, normalised; the bare decoder's checkpoint (architecture Qwen3Model, no `model.`)."""
    path = write_embedding_checkpoint(tmp_path_factory.mktemp("emb") / "last", hf_model)
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes="4MiB",
               show_progress=False)


@pytest.fixture(scope="module")
def chunked_llm(last_llm: LLM) -> LLM:
    """The same model with a 16-token step budget: every prompt longer than that is prefilled in chunks."""
    return LLM(last_llm.llm_engine.config.model, device="cpu", dtype="float32", max_model_len=256,
               max_num_batched_tokens=16, kv_cache_memory_bytes="4MiB", show_progress=False)


def test_detected_as_pooling_model(last_llm: LLM) -> None:
    info = last_llm.llm_engine.model_info()
    assert info["runner"] == "pooling"
    assert info["pooling"] == {"pooling_type": "LAST", "normalize": True, "hidden_size": 64,
                               "source": "modules.json, 1_Pooling/config.json"}
    assert not last_llm.llm_engine.model_runner.model.has_lm_head
    assert last_llm.llm_engine.config.enable_prefix_caching is False  # nothing to share: no KV outlives a prefill


def test_batch_equals_each_alone_and_transformers(last_llm: LLM, hf_model: torch.nn.Module) -> None:
    batch = last_llm.embed(PROMPTS, use_tqdm=False)
    assert [o.prompt for o in batch] == PROMPTS and all(o.finished for o in batch)
    for prompt, out in zip(PROMPTS, batch):
        alone = last_llm.embed(prompt, use_tqdm=False)[0]
        assert alone.prompt_token_ids == out.prompt_token_ids
        torch.testing.assert_close(out.outputs.data, alone.outputs.data, atol=ATOL, rtol=0)
        assert_close(out.outputs.data, reference_embedding(hf_model, out.prompt_token_ids))
        assert out.outputs.embedding == pytest.approx(out.outputs.data.tolist())
        assert abs(float(out.outputs.data.norm()) - 1.0) < 1e-5
    assert_all_blocks_free(last_llm)


def test_token_id_prompts(last_llm: LLM, hf_model: torch.nn.Module) -> None:
    ids = [[5, 17, 200, 3], [9]]  # a one-token prompt is scheduled like a decode row
    outs = last_llm.embed(ids, use_tqdm=False)
    for prompt, out in zip(ids, outs):
        assert out.prompt_token_ids == prompt
        assert_close(out.outputs.data, reference_embedding(hf_model, prompt))
    assert_close(last_llm.embed(ids[0], use_tqdm=False)[0].outputs.data, outs[0].outputs.data)


def test_dimensions_cut_then_normalised(last_llm: LLM, hf_model: torch.nn.Module) -> None:
    out = last_llm.embed(PROMPTS[:2], dimensions=16, use_tqdm=False)
    for o in out:
        assert_close(o.outputs.data, reference_embedding(hf_model, o.prompt_token_ids, dimensions=16))
    for bad in (0, 65, -3, True, 2.5):
        with pytest.raises(ValueError, match="dimensions"):
            last_llm.embed("x", dimensions=bad, use_tqdm=False)  # type: ignore[arg-type]
    assert_all_blocks_free(last_llm)


def test_prompt_of_the_whole_context(last_llm: LLM, hf_model: torch.nn.Module) -> None:
    ids = [(7 * i) % 250 + 1 for i in range(256)]  # max_model_len ids: no room is kept for a token after them
    assert_close(last_llm.embed(ids, use_tqdm=False)[0].outputs.data, reference_embedding(hf_model, ids))
    with pytest.raises(InputError, match="257 tokens") as err:
        last_llm.embed(ids + [1], use_tqdm=False)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(ValueError, match="empty"):
        last_llm.embed([""], use_tqdm=False)


def test_chunked_prefill_equals_one_step(chunked_llm: LLM, hf_model: torch.nn.Module) -> None:
    engine = chunked_llm.llm_engine
    chunks: list[list[int]] = []
    pool = engine.model_runner.pool

    def recording(out, pooling_type):
        chunks.append([s.num_new_tokens for s in out.scheduled])
        return pool(out, pooling_type)

    engine.model_runner.pool = recording  # type: ignore[method-assign]
    try:
        outs = chunked_llm.embed(PROMPTS, use_tqdm=False)
    finally:
        del engine.model_runner.pool
    assert max(sum(c) for c in chunks) <= 16 and len(chunks) >= 11  # 163 prompt tokens, 16 a step
    for out in outs:
        assert_close(out.outputs.data, reference_embedding(hf_model, out.prompt_token_ids))
    assert_all_blocks_free(chunked_llm)


def test_blocks_freed_as_soon_as_pooled(chunked_llm: LLM, hf_model: torch.nn.Module) -> None:
    engine = chunked_llm.llm_engine
    total = engine.block_manager.num_blocks
    engine.add_request("short", [3, 4, 5], PoolingParams())
    engine.add_request("long", list(range(1, 101)), PoolingParams(dimensions=8))
    finished = [o for o in engine.step() if o.finished]  # short: 3 tokens; long: its first 13
    assert [o.request_id for o in finished] == ["short"]
    assert_close(finished[0].outputs.data, reference_embedding(hf_model, [3, 4, 5]))
    assert engine.block_manager.num_free_blocks == total - 7  # the long prompt's 100 tokens reserved; short's freed
    while engine.has_unfinished_requests():
        finished = [o for o in engine.step() if o.finished] or finished
    assert finished[-1].request_id == "long"
    assert_close(finished[-1].outputs.data, reference_embedding(hf_model, list(range(1, 101)), dimensions=8))
    assert_all_blocks_free(chunked_llm)


@pytest.mark.parametrize("pooling, normalize, described", [("MEAN", False, "mean of the tokens, not normalised"),
                                                            ("CLS", True, "first token, normalised")])
def test_mean_and_cls_pooling_chunked(tmp_path: pytest.TempPathFactory, hf_model: torch.nn.Module, pooling: str,
                                      normalize: bool, described: str) -> None:
    """Mean pooling adds every chunk's rows, CLS takes the first chunk's first; a model without
    sentence-transformers' Normalize is not normalised. Config architecture Qwen3ForCausalLM over the bare
    decoder's weights, as Qwen3-Embedding ships."""
    path = write_embedding_checkpoint(tmp_path / pooling, hf_model, pooling, normalize=normalize,
                                      architecture="Qwen3ForCausalLM")
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=16,
              kv_cache_memory_bytes="4MiB", show_progress=False)
    assert llm.llm_engine.pooler_config.describe().startswith(described)
    for out in llm.embed(PROMPTS, use_tqdm=False):
        assert_close(out.outputs.data, reference_embedding(hf_model, out.prompt_token_ids, pooling, normalize))
    assert_all_blocks_free(llm)


def test_generation_refused_by_a_pooling_engine(last_llm: LLM) -> None:
    for call in (lambda: last_llm.generate("hi", use_tqdm=False),
                 lambda: last_llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False),
                 lambda: last_llm.llm_engine.add_request("g", [1, 2], SamplingParams(max_tokens=2)),
                 lambda: last_llm.llm_engine.score([1, 2, 3])):
        with pytest.raises(ValueError, match="this model serves embeddings: use /v1/embeddings"):
            call()
    assert_all_blocks_free(last_llm)
    with pytest.raises(ValueError, match="no LM head.*runner='pooling'"):
        LLM(last_llm.llm_engine.config.model, device="cpu", runner="generate", show_progress=False)


def test_generative_engine_refuses_embeddings_and_runner_pooling_embeds(tmp_path: pytest.TempPathFactory) -> None:
    path = write_tiny_checkpoint(tmp_path / "gen", "Qwen3ForCausalLM", head_dim=16)
    gen = LLM(str(path), device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes="4MiB",
              enforce_eager=True, show_progress=False)
    engine = gen.llm_engine
    assert engine.model_info()["runner"] == "generate"
    engine.add_request("gen", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(InputError, match="not started for embeddings.*runner='pooling'") as err:
        engine.add_request("emb", [5, 6, 7], PoolingParams())
    assert err.value.param == "model"
    with pytest.raises(ValueError, match="not started for embeddings"):
        gen.embed("hi", use_tqdm=False)
    outs = []
    while engine.has_unfinished_requests():  # the generation goes on, alone
        outs += engine.step()
    assert outs[-1].request_id == "gen" and len(outs[-1].outputs[0].token_ids) == 3
    del gen, engine

    import transformers

    hf = transformers.Qwen3ForCausalLM.from_pretrained(path).eval()
    pooled = LLM(str(path), device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes="4MiB",
                 task="embed", show_progress=False)  # vLLM's older spelling of runner="pooling"
    assert pooled.llm_engine.pooler_config.source == "defaults"  # no sentence-transformers files: last, normalised
    out = pooled.embed([[5, 6, 7, 8]], use_tqdm=False)[0]
    assert_close(out.outputs.data, reference_embedding(hf.model, [5, 6, 7, 8]))


def test_sentence_transformers_files_refused_clearly(tmp_path: pytest.TempPathFactory) -> None:
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    write_sentence_transformers_files(tmp_path / "dense", extra_modules=[dense])
    with pytest.raises(ValueError, match="modules.json lists the module 'sentence_transformers.models.Dense'"):
        read_pooler_config(tmp_path / "dense", 64)
    write_sentence_transformers_files(tmp_path / "max", pooling_mode_max_tokens=True)
    with pytest.raises(ValueError, match="pooling_mode_max_tokens is not supported"):
        read_pooler_config(tmp_path / "max", 64)
    write_sentence_transformers_files(tmp_path / "two", "MEAN", pooling_mode_cls_token=True)
    with pytest.raises(ValueError, match="sets 2 of"):
        read_pooler_config(tmp_path / "two", 64)
    write_sentence_transformers_files(tmp_path / "ok")
    with pytest.raises(ValueError, match="word_embedding_dimension 64 is not the model's hidden_size 32"):
        read_pooler_config(tmp_path / "ok", 32)
    write_sentence_transformers_files(tmp_path / "cls", "CLS", normalize=False)
    assert read_pooler_config(tmp_path / "cls", 64) == PoolerConfig(
        "CLS", False, 64, source="modules.json, 1_Pooling/config.json")
    assert read_pooler_config(tmp_path, 64) is None  # no modules.json: not a sentence-transformers model


def test_matryoshka_dimensions_rule() -> None:
    cfg = PoolerConfig("LAST", True, 64, matryoshka_dimensions=(8, 32))
    assert cfg.output_dimensions(None) == 64 and cfg.output_dimensions(8) == 8 and cfg.output_dimensions(64) == 64
    with pytest.raises(InputError, match="use one of 8, 32") as err:
        cfg.output_dimensions(16)
    assert err.value.param == "dimensions"
    with pytest.raises(InputError, match="is_matryoshka: false"):
        PoolerConfig("LAST", True, 64, matryoshka=False).output_dimensions(16)
    assert PoolerConfig("LAST", True, 64, default_dimensions=16).output_dimensions(None) == 16
