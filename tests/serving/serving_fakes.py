"""A small fake of ``LLMEngine`` (same interface, no model) so the serving layer tests fast.

Greedy requests spell out a fixed script one byte-token per step; sampled ones draw letters from
a per-request seeded generator. A prompt containing ``FAIL_STEP`` makes ``step()`` raise, to test
that a failed step is reported to its requests and the loop carries on.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from lightinfer.config import EngineConfig
from lightinfer.inputs import EngineRequest, InputProcessor
from lightinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from lightinfer.sampling_params import SamplingParams

SCRIPT = "The capital of France is Paris. " * 64
IM_START, IM_END = 256, 257


class FakeTokenizer:
    """Byte-level tokenizer: ids 0..255 are bytes, 256/257 the chat markers (257 = EOS)."""

    eos_token_id = IM_END
    eos_token = "<|im_end|>"
    vocab_size = 258
    chat_template = "chatml"  # what apply_chat_template below renders

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        for part in text.split("<|im_start|>"):
            if ids or text.startswith("<|im_start|>"):
                ids.append(IM_START)
            for j, piece in enumerate(part.split("<|im_end|>")):
                if j:
                    ids.append(IM_END)
                ids.extend(piece.encode())
        return ids[1:] if not text.startswith("<|im_start|>") and ids and ids[0] == IM_START else ids

    def get_vocab(self) -> dict[str, int]:
        """Byte tokens (one character each) and the two chat markers, as a vocabulary."""
        return {**{chr(i): i for i in range(256)}, "<|im_start|>": IM_START, "<|im_end|>": IM_END}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = False, tokenize: bool = True,
        **kwargs: Any,
    ) -> str | list[int]:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text) if tokenize else text


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    last_batch_size: int = 0
    max_batch_size: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    spec_decode: dict | None = None  # speculative decoding's counters (the fake does not speculate)


@dataclass
class _Req:
    request_id: str
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    rng: random.Random
    arrival: float
    outputs: list[CompletionOutput] = field(default_factory=list)
    blocks: int = 0


class FakeLLMEngine:
    """Interface of ``LLMEngine``; ``step_delay`` seconds per step emulate the model's compute."""

    def __init__(self, config: EngineConfig, step_delay: float = 0.002, num_blocks: int = 256) -> None:
        self.config = config
        self.tokenizer = FakeTokenizer()
        self.step_delay = step_delay
        self.max_model_len = config.max_model_len or 2048
        self.input_processor = InputProcessor(self.tokenizer, self.tokenizer.vocab_size, self.max_model_len)
        self.stats = EngineStats(num_free_blocks=num_blocks, num_total_blocks=num_blocks)
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.global_rng = random.Random(config.seed)

    def model_info(self) -> dict[str, Any]:
        return {
            "model": "fake-model", "quantization": {"method": "awq", "bits": 4, "group_size": 64},
            "kv_cache_dtype": self.config.kv_cache_dtype, "weight_bytes": 123_456_789,
            "num_kv_blocks": self.stats.num_total_blocks, "block_size": self.config.block_size,
            "enable_prefix_caching": self.config.enable_prefix_caching,
            "kv_pool_tokens": self.stats.num_total_blocks * self.config.block_size,
            "max_model_len": self.max_model_len, "dtype": "float32", "device": "cpu",
        }

    def add_request(self, request_id: str, prompt: str | list[int] | EngineRequest,
                    sampling_params: SamplingParams | None = None) -> None:
        if isinstance(prompt, EngineRequest):  # prepared by a front end's InputProcessor
            prompt, sampling_params = prompt.prompt_token_ids, prompt.sampling_params
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if not ids or any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
                raise ValueError(f"token ids must be in [0, {self.tokenizer.vocab_size})")
            prompt = self.tokenizer.decode(ids)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        seed = sampling_params.seed if sampling_params.seed is not None else self.global_rng.randrange(2**31)
        req = _Req(request_id, prompt, ids, sampling_params, random.Random(seed), time.monotonic())
        req.outputs = [CompletionOutput(index=i) for i in range(sampling_params.n)]
        self.waiting.append(req)

    def abort_request(self, request_id: str) -> None:
        for queue in (self.waiting, self.running):
            for req in list(queue):
                if req.request_id == request_id:
                    queue.remove(req)
                    self._free(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_stats(self) -> EngineStats:
        s = self.stats
        s.num_running, s.num_waiting = len(self.running), len(self.waiting)
        s.kv_cache_usage = 1 - s.num_free_blocks / s.num_total_blocks
        return EngineStats(**vars(s))

    def _free(self, req: _Req) -> None:
        self.stats.num_free_blocks += req.blocks
        req.blocks = 0

    def _need(self, req: _Req) -> int:
        longest = max(len(c.token_ids) for c in req.outputs)
        return req.params.n * math.ceil((len(req.prompt_ids) + longest + 1) / self.config.block_size)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_delay)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self._need(req) > self.stats.num_free_blocks:
                break
            self.waiting.pop(0)
            self.running.append(req)
            self.stats.num_prompt_tokens += len(req.prompt_ids)
        if any("FAIL_STEP" in r.prompt for r in self.running):
            raise RuntimeError("simulated kernel failure")
        self.stats.last_batch_size = len(self.running)
        self.stats.max_batch_size = max(self.stats.max_batch_size, len(self.running))
        results = []
        for req in list(self.running):
            grow = self._need(req) - req.blocks
            req.blocks += grow
            self.stats.num_free_blocks -= grow
            for comp in req.outputs:
                if comp.finished:
                    continue
                self._advance(req, comp)
            done = all(c.finished for c in req.outputs)
            if done:
                self.running.remove(req)
                self._free(req)
            results.append(RequestOutput(
                req.request_id, req.prompt, list(req.prompt_ids),
                [CompletionOutput(c.index, c.text, list(c.token_ids), c.finish_reason,
                                  None if c.logprobs is None else list(c.logprobs), c.cumulative_logprob,
                                  c.stop_reason) for c in req.outputs],
                done, 0, RequestMetrics(req.arrival)))
        return results

    def _advance(self, req: _Req, comp: CompletionOutput) -> None:
        p = req.params
        n = len(comp.token_ids)
        if p.greedy:
            tok = ord(SCRIPT[n % len(SCRIPT)])
        else:
            tok = ord(req.rng.choice("abcdefghijklmnopqrstuvwxyz "))
        comp.token_ids.append(tok)
        self.stats.num_generation_tokens += 1
        if p.logprobs is not None:
            comp.logprobs = (comp.logprobs or []) + [{tok: -0.25, **{(tok + k) % 256: -1.0 - k for k in
                                                                     range(1, p.logprobs + 1)}}]
            comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) - 0.25
        text = self.tokenizer.decode(comp.token_ids)
        for stop in p.stop or []:
            if stop in text:
                comp.text, comp.finish_reason, comp.stop_reason = text[: text.index(stop)], "stop", stop
                return
        # hold back a tail that could still become a stop string
        hold = max((k for s in p.stop or [] for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        comp.text = text[: len(text) - hold]
        if len(comp.token_ids) >= p.max_tokens or len(req.prompt_ids) + n + 1 >= self.max_model_len:
            comp.text, comp.finish_reason = text, "length"
