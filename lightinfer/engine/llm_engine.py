"""LLMEngine: requests in, one batched step at a time, RequestOutputs out.

Not thread-safe: exactly one thread drives ``step()`` (the async engine's loop, or
``LLM.generate``).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from lightinfer.config import EngineConfig, choose_max_model_len
from lightinfer.engine.block_manager import BlockManager
from lightinfer.engine.cpu_graph import replay_report
from lightinfer.engine.detokenizer import IncrementalDetokenizer, find_stop, stop_holdback
from lightinfer.engine.load_progress import LoadProgress
from lightinfer.engine.model_runner import ModelRunner
from lightinfer.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from lightinfer.engine.sequence import Sequence
from lightinfer.engine.spec.speculator import Speculator
from lightinfer.engine.spec.verify import DraftRows, Verified, verify_drafts
from lightinfer.engine.step_inputs import select_rows
from lightinfer.engine.structured_outputs import StructuredOutputManager
from lightinfer.formats.scheme import describe_formats
from lightinfer.inputs import (
    EngineRequest,
    InputError,
    InputProcessor,
    PoolerConfig,
    PoolingParams,
    PromptType,
)
from lightinfer.inputs.pooling import EMBEDDINGS_REFUSED, GENERATION_REFUSED
from lightinfer.layers.pooler import finish_embedding
from lightinfer.layers.rope_scaling import rope_max_positions
from lightinfer.layers.sampler import INVALID_TOKEN, Sampler, SamplingRow, has_penalties
from lightinfer.loader import Checkpoint
from lightinfer.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from lightinfer.sampling_params import SamplingParams

logger = logging.getLogger("lightinfer")


def resolve_max_model_len(hf_config: object, requested: int | None) -> int:
    """The engine's ``max_model_len`` in tokens: ``requested``, or the model's context capped at
    ``config.DEFAULT_MAX_MODEL_LEN``. The model's context is the config's own limit: ``max_position_embeddings``,
    extended by its RoPE scaling where that is how the config says it (linear / dynamic / yarn;
    ``layers/rope_scaling.py``). Sliding-window layers do not limit it (they keep their window of it).

    Raises:
        ValueError: ``requested`` exceeds the model's context (the message gives the limit), or an unknown
            RoPE type.
    """
    return choose_max_model_len(rope_max_positions(hf_config), requested)


def resolve_config(config: EngineConfig, checkpoint: Checkpoint) -> EngineConfig:
    """``config`` resolved against the opened ``checkpoint`` (``EngineConfig.resolve``): its context
    (:func:`resolve_max_model_len`) and whether it is 4-/8-bit decide ``max_model_len`` and what ``dtype="auto"``
    means on a CPU; whether it is an embedding model (``Checkpoint.pooling_reason``) what ``runner="auto"`` means.
    The returned config is frozen; ``config`` is left as it is.

    Raises:
        ValueError: ``max_model_len`` beyond the model's context, or an unknown RoPE type; ``runner="generate"``
            for a checkpoint without an LM head.
    """
    reason = checkpoint.pooling_reason if config.runner != "generate" else None
    if config.runner == "generate" and not checkpoint.has_lm_head:
        raise ValueError(f"{checkpoint.name} has no LM head (an embedding model: {checkpoint.pooling_reason}); it "
                         f"cannot generate text: start it with runner='pooling' (CLI: --runner pooling)")
    resolved = config.resolve(model_max_len=rope_max_positions(checkpoint.hf_config),
                              quantized=checkpoint.quant_config is not None, pooling_model=reason is not None)
    if config.runner == "auto" and reason is not None:
        logger.info("%s is an embedding model (%s): a pooling engine (embeddings only)", checkpoint.name, reason)
    return resolved


@dataclass
class EngineStats:
    """Counters for monitoring (totals since start unless said otherwise)."""

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
    # which CPU decode batch sizes are replayed, and why the others run eagerly (LLMEngine.cpu_decode_replay)
    cpu_decode_replay: dict = field(default_factory=dict)
    # speculative decoding: its settings and counters (Speculator.info), None when off
    spec_decode: dict | None = None


@dataclass
class Request:
    """Engine-side state of one request: its ``n`` completions and their detokenizers."""

    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    detoks: list[IncrementalDetokenizer] = field(default_factory=list)
    generators: list[torch.Generator | None] = field(default_factory=list)
    outputs: list[CompletionOutput] = field(default_factory=list)
    forked: bool = False
    pooling: PoolingState | None = None  # an embedding request's progress (pooling engines)

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


@dataclass
class PoolingState:
    """Engine-side state of one embedding request: its settings, the sum of its pooled parts so far (chunked
    prefill: ``layers/pooler.py``) and, once its prompt is prefilled, its vector."""

    params: PoolingParams
    dimensions: int
    total: torch.Tensor | None = None
    embedding: torch.Tensor | None = None


def check_quant_config(qc: dict | None, hf_config: object) -> None:
    """Refuse a ``quantization_config`` we cannot run (AWQ, GPTQ, compressed-tensors, GGUF), before
    loading anything (``lightinfer.formats.quant_config``).

    Raises:
        ValueError: naming the field, its value and what is supported.
    """
    from lightinfer.formats.quant_config import check_quant_config as check

    check(qc, hf_config)


class LLMEngine:
    """The engine: tokenizer, model runner, KV block manager, scheduler, sampler.

    Args:
        config: the settings. See :class:`lightinfer.config.EngineConfig`; the engine resolves them against the
            checkpoint once (:func:`resolve_config`) and keeps that frozen copy as ``self.config``, which the
            model runner, scheduler and everything after read.
        show_progress: print a line on stderr as each loading phase starts (``load_progress.py``).

    Raises:
        FileNotFoundError / ValueError: a bad model source, an unsupported architecture or
            quantization, a ``max_model_len`` beyond the model's, or a KV pool too small.
    """

    def __init__(self, config: EngineConfig, show_progress: bool = False) -> None:
        t0 = time.perf_counter()
        progress = LoadProgress(show_progress)
        dummy = config.load_format == "dummy"
        with progress.phase(f"reading {config.model}"):
            self.checkpoint = Checkpoint(config.model, read_weights=not dummy)
        hf_config = self.checkpoint.hf_config
        from lightinfer.models.registry import get_model_class

        get_model_class(hf_config)  # unsupported architecture: fail before the tokenizer loads
        if config.quantization == "awq" and self.checkpoint.quant_config is None:
            if not dummy:
                raise ValueError(f"quantization='awq' was asked for, but {config.model} is not an AWQ checkpoint; "
                                 f"make one with `lightinfer quantize {config.model} --out OUT_DIR` and load OUT_DIR")
            from lightinfer.dummy_weights import dummy_awq_config

            self.checkpoint.quant_config = dummy_awq_config(hf_config)
        check_quant_config(self.checkpoint.quant_config, hf_config)
        # Every automatic setting decided, before anything is built; only this frozen copy is read from here on.
        self.config = config = resolve_config(config, self.checkpoint)
        self.hf_config = hf_config
        # No tokenizer: asked for, or a bare config folder with dummy weights (ids in, ids out).
        no_tokenizer = config.skip_tokenizer_init or (dummy and not self.checkpoint.has_tokenizer)
        # The engine's torch ops use every core (threads); the tokenizer's own thread pool on top of them would
        # oversubscribe the CPU whenever a request is tokenized during a step. One thread per tokenizer call.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        if not no_tokenizer:
            with progress.phase("loading the tokenizer"):
                self.tokenizer = self.checkpoint.load_tokenizer()
        else:
            self.tokenizer = None
        self.eos_token_ids = self.checkpoint.eos_token_ids(self.tokenizer)
        self.vocab_size = int(hf_config.vocab_size)
        # a pooling engine's rules (sentence-transformers files, else last token + normalised); None: generative
        self.pooler_config: PoolerConfig | None = self.checkpoint.pooler_config() if config.runner == "pooling" \
            else None
        if self.pooler_config is not None:
            logger.info("pooling engine (embeddings): %s", self.pooler_config.describe())
        # constrained decoding: the grammar backend is built at the first constrained request
        self.structured = StructuredOutputManager(self.tokenizer, self.eos_token_ids,
                                                  overlap=config.torch_device.type == "cuda")
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, int(config.max_model_len),
                                              grammar_backend=self.structured.get_backend,
                                              pooler_config=self.pooler_config)
        self.model_runner = ModelRunner(config, self.checkpoint, progress)
        self.block_manager = BlockManager(self.model_runner.group_num_blocks, config.block_size,
                                          config.enable_prefix_caching, self.model_runner.kv_windows)
        self.scheduler = Scheduler(config, self.block_manager, self.eos_token_ids)
        self.sampler = Sampler(config.seed)
        # speculative decoding (engine/spec/): drafts proposed before each step, verified in it
        runner = self.model_runner
        self.speculator = (Speculator(config.speculative_config, int(config.max_model_len),
                                      lambda rows: runner.platform.same_numerics_rows(runner, rows))
                           if config.speculative_config is not None else None)
        if self.speculator is not None:
            sc = config.speculative_config
            logger.info("speculative decoding: %s drafts, up to %d per sequence and step", sc.method,
                        sc.num_speculative_tokens)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats(num_total_blocks=self.block_manager.num_blocks)
        logger.info("engine ready in %.1f s: %s on %s, %s (%s)", time.perf_counter() - t0, self.checkpoint.name,
                    config.torch_device, str(config.torch_dtype).replace("torch.", ""), progress.summary())

    # ------------------------------------------------------------------ requests
    def add_request(
        self, request_id: str, prompt: PromptType | EngineRequest,
        sampling_params: SamplingParams | PoolingParams | None = None, arrival_time: float | None = None,
    ) -> None:
        """Queue a request; it joins the running batch at the next step with room.

        Args:
            request_id: the caller's unique id.
            prompt: an :class:`EngineRequest` (made by an :class:`InputProcessor`, e.g. a front end's),
                taken as it is; or a plain prompt (text, ids, vLLM's prompt dicts), which goes through
                this engine's ``input_processor`` first.
            sampling_params: for a plain prompt (default ``SamplingParams()``); an EngineRequest carries its own.
                A :class:`PoolingParams` makes the plain prompt an embedding request (a pooling engine's; as vLLM).
            arrival_time: ``time.monotonic()`` of arrival (default: now).
        Raises:
            ValueError: a duplicate ``request_id``, a bad prompt or setting (see
                :meth:`InputProcessor.process`); a generation request to a pooling engine or an embedding
                request to a generative one (:class:`InputError`, param ``model``); nothing is queued then.
        """
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, EngineRequest):
            if sampling_params is not None and sampling_params is not prompt.sampling_params:
                raise ValueError("an EngineRequest carries its own sampling_params; pass None")
            request = prompt
        elif isinstance(sampling_params, PoolingParams):
            request = self.input_processor.process_embedding(prompt, sampling_params)
        else:
            request = self.input_processor.process(prompt, SamplingParams() if sampling_params is None else sampling_params)
        if self.pooler_config is not None and request.pooling_params is None:
            raise InputError(GENERATION_REFUSED, param="model")
        if self.pooler_config is None and request.pooling_params is not None:
            raise InputError(EMBEDDINGS_REFUSED, param="model")
        ids, p = request.prompt_token_ids, request.sampling_params
        if request.pooling_params is not None:
            self._add_embedding(request_id, request, arrival_time)
            return
        seq = Sequence(request_id, ids, p, index=0)
        if p.structured_outputs is not None:  # a cache hit when the front end compiled it (off this thread)
            self.structured.add(seq, p.structured_outputs)
        req = Request(request_id, request.prompt, ids, p, RequestMetrics(arrival_time or time.monotonic()))
        for i in range(p.n):
            gen = None
            if p.seed is not None:
                gen = torch.Generator(device=self.config.torch_device)  # the sampler draws on the device
                gen.manual_seed(p.seed + i)
            req.generators.append(gen)
            req.detoks.append(IncrementalDetokenizer(self.tokenizer, ids, p.skip_special_tokens))
            req.outputs.append(CompletionOutput(index=i, logprobs=[] if p.logprobs is not None else None,
                                                cumulative_logprob=0.0 if p.logprobs is not None else None))
        req.seqs.append(seq)
        req.forked = p.n == 1
        self.requests[request_id] = req
        self.scheduler.add(seq)
        self.stats.num_prompt_tokens += len(ids)

    def _add_embedding(self, request_id: str, request: EngineRequest, arrival_time: float | None) -> None:
        """Queue an embedding request: one sequence, prefilled (in chunks where the budget says), pooled, finished."""
        assert self.pooler_config is not None and request.pooling_params is not None
        dims = self.pooler_config.output_dimensions(request.pooling_params.dimensions)
        if len(request.prompt_token_ids) > int(self.config.max_model_len):
            raise InputError(f"the prompt has {len(request.prompt_token_ids)} tokens but max_model_len is "
                             f"{self.config.max_model_len}", param="prompt", code="context_length_exceeded")
        seq = Sequence(request_id, request.prompt_token_ids, request.sampling_params, index=0)
        req = Request(request_id, request.prompt, request.prompt_token_ids, request.sampling_params,
                      RequestMetrics(arrival_time or time.monotonic()), seqs=[seq], outputs=[CompletionOutput(0)],
                      forked=True, pooling=PoolingState(request.pooling_params, dims))
        self.requests[request_id] = req
        self.scheduler.add(seq)
        self.stats.num_prompt_tokens += len(request.prompt_token_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks. Returns its final output (None if unknown)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.abort(request_id)
        for seq in req.seqs:
            self.structured.remove(seq)
        for out in req.outputs:
            if not out.finished:
                out.finish_reason = "abort"
        req.metrics.finished_time = time.monotonic()
        return self._make_output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ step
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Schedule, run the model once, sample, update.

        Args:
            final_only: return only the requests that finished in this step (``LLM.generate``
                needs nothing else; building every running request's output each step copies
                its token list, O(length) per token).
        Returns:
            Outputs of the requests that progressed (or finished, with ``final_only``).
        """
        if self.speculator is not None:
            alive = {q.seq_id for r in self.requests.values() for q in r.seqs if not q.is_finished}
            self.speculator.propose(self.scheduler.running, self.structured.constrained_seq_ids(), alive)
        out = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        if not out.scheduled:
            return []
        now = time.monotonic()
        for s in out.scheduled:
            m = self.requests[s.seq.request_id].metrics
            m.first_scheduled_time = m.first_scheduled_time or now
        if self.pooler_config is not None:
            return self._pooling_step(out, final_only)
        sampled = [s for s in out.scheduled if s.completes_prompt]
        # the logits have one row per sampled sequence, k + 1 for one that verifies k drafts
        first_row = list(itertools.accumulate((1 + len(s.draft_ids) for s in sampled), initial=0))
        plain = [(s, r) for s, r in zip(sampled, first_row) if not s.draft_ids]
        drafting = [(s, r) for s, r in zip(sampled, first_row) if s.draft_ids]
        # constrained rows: the bitmask is filled now (overlapping the forward where it can), applied below
        mask = self.structured.begin_step([s.seq for s, _ in plain]) if self.structured.num_active else None
        all_logits = self.model_runner.run(out)
        self.scheduler.postprocess(out)
        rows, targets = self._sampling_rows([s for s, _ in plain])
        logits = select_rows(all_logits, [plain[r][1] for r, _, _ in targets])
        if mask is not None:
            self.structured.apply_(logits, mask, [r for r, _, _ in targets])
        tokens, logprobs = self.sampler(logits, rows)
        verified = self._verify(all_logits, drafting)
        if self.speculator is not None and out.num_decodes == len(out.scheduled):
            self.speculator.record_step(out.num_tokens, time.monotonic() - now)
        # Fork every new completion before any token is appended: children copy the parent's tokens.
        owners: list[Sequence] = []
        for _, seq, index in targets:
            if index != seq.index:
                req = self.requests[seq.request_id]
                child = self.scheduler.fork(seq, index)
                self.structured.fork(seq, child)
                seq = child
                req.seqs.append(seq)
            owners.append(seq)
        touched: dict[str, Request] = {}
        for seq, token, lp in zip(owners, tokens, logprobs):
            req = self.requests[seq.request_id]
            if token == INVALID_TOKEN:
                self._fail_sequence(req, seq)
            else:
                self._append_token(req, seq, token, lp)
            touched[req.request_id] = req
        for (s, _), v in zip(drafting, verified):
            self._append_verified(s, v, touched)
        for s in out.scheduled:
            req = self.requests.get(s.seq.request_id)
            if req is not None and any(q.seq_id == s.seq.seq_id for q in req.seqs):
                touched.setdefault(req.request_id, req)
        return self._step_outputs(out, touched, final_only)

    def _step_outputs(self, out: SchedulerOutput, touched: dict[str, Request], final_only: bool) -> list[RequestOutput | EmbeddingRequestOutput]:
        """The step's outputs of the ``touched`` requests (only the finished ones when ``final_only``), the batch
        counters updated and the finished requests forgotten."""
        self.stats.last_batch_size = len(out.scheduled)
        self.stats.max_batch_size = max(self.stats.max_batch_size, len(out.scheduled))
        results = [self._make_output(r) for r in touched.values() if r.finished or not final_only]
        for r in touched.values():
            if r.finished:
                del self.requests[r.request_id]
        return results

    def _pooling_step(self, out: SchedulerOutput, final_only: bool) -> list[EmbeddingRequestOutput]:
        """A pooling engine's step: run the scheduled prompt chunks, add what each pools (``layers/pooler.py``), and
        finish each request whose prompt is now prefilled: its vector made, its KV blocks freed at once."""
        cfg = self.pooler_config
        assert cfg is not None
        parts = self.model_runner.pool(out, cfg.pooling_type)
        self.scheduler.postprocess(out)
        touched: dict[str, Request] = {}
        for s, part in zip(out.scheduled, parts):
            seq = s.seq
            req = self.requests[seq.request_id]
            state = req.pooling
            assert state is not None
            if s.start == 0:  # the first chunk (again, after a preemption): start over
                state.total = None
            if part is not None:
                state.total = part if state.total is None else state.total + part
            if s.completes_prompt:
                assert state.total is not None
                state.embedding = finish_embedding(state.total, seq.num_prompt_tokens, cfg.pooling_type,
                                                   state.dimensions, cfg.normalize)
                self.scheduler.finish(seq, "stop")  # frees its KV blocks now
                req.outputs[0].finish_reason = "stop"
                req.metrics.finished_time = time.monotonic()
            touched[req.request_id] = req
        return self._step_outputs(out, touched, final_only)

    def _verify(self, logits: torch.Tensor, drafting: list[tuple[ScheduledSequence, int]]) -> list[Verified]:
        """Accept or reject the drafts of the sequences that verify (``engine/spec/verify.py``): each one's
        ``k + 1`` rows from its first row in ``logits``, each row with the penalties and bans of its position."""
        if not drafting:
            return []
        seqs = []
        for s, first in drafting:
            seq = s.seq
            req = self.requests[seq.request_id]
            p = req.params
            penalized = has_penalties(p)
            outputs = seq.output_token_ids if penalized else []
            rows = []
            for i in range(len(s.draft_ids) + 1):
                suppress: tuple[int, ...] = ()
                if seq.num_output_tokens + i < p.min_tokens:
                    suppress = tuple(sorted(self.eos_token_ids | set(p.stop_token_ids)))
                rows.append(SamplingRow(p, req.prompt_token_ids, outputs + s.draft_ids[:i] if penalized else [],
                                        req.generators[seq.index], suppress))
            seqs.append(DraftRows(first, s.draft_ids, rows))
        return verify_drafts(logits, seqs, self.sampler.generator_for(logits.device))

    def _append_verified(self, s: ScheduledSequence, v: Verified, touched: dict[str, Request]) -> None:
        """Append a verified run's tokens in order, as plain steps would have, until one ends the sequence (a
        stop string, a stop token, ``max_tokens``); the accepted drafts' KV counts as computed."""
        seq = s.seq
        req = self.requests[seq.request_id]
        touched[req.request_id] = req
        self.speculator.record_verify(seq, len(s.draft_ids), v.num_accepted)
        req.metrics.num_draft_tokens += len(s.draft_ids)
        req.metrics.num_accepted_tokens += v.num_accepted
        self.scheduler.commit_drafts(seq, v.num_accepted)
        for token, lp in zip(v.tokens, v.logprobs):
            if token == INVALID_TOKEN:
                self._fail_sequence(req, seq)
            else:
                self._append_token(req, seq, token, lp)
            if seq.is_finished:
                return
        self.scheduler.register_blocks(seq)

    def _sampling_rows(
        self, sampled: list[ScheduledSequence]
    ) -> tuple[list[SamplingRow], list[tuple[int, Sequence, int]]]:
        """One row per token to sample; a request's first prefill samples all ``n`` (it forks)."""
        rows: list[SamplingRow] = []
        targets: list[tuple[int, Sequence, int]] = []
        for row_idx, s in enumerate(sampled):
            seq = s.seq
            req = self.requests[seq.request_id]
            indices = [seq.index]
            if not req.forked:
                req.forked = True
                indices = list(range(req.params.n))
            for index in indices:
                suppress: tuple[int, ...] = ()
                if seq.num_output_tokens < req.params.min_tokens:
                    suppress = tuple(sorted(self.eos_token_ids | set(req.params.stop_token_ids)))
                # The output ids only matter to penalties: slicing them for every row would cost
                # O(length) per token, O(length^2) per request.
                outputs = seq.output_token_ids if has_penalties(req.params) else []
                rows.append(SamplingRow(req.params, req.prompt_token_ids, outputs, req.generators[index], suppress))
                targets.append((row_idx, seq, index))
        return rows, targets

    def _append_token(self, req: Request, seq: Sequence, token: int, lp: dict[int, float] | None) -> None:
        out = req.outputs[seq.index]
        seq.append_token(token)
        self.stats.num_generation_tokens += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.monotonic()
        if lp is not None and out.logprobs is not None:
            out.logprobs.append(lp)
            out.cumulative_logprob = (out.cumulative_logprob or 0.0) + lp[token]
        grammar = self.structured.accept(seq, token) if self.structured.num_active else None
        detok = req.detoks[seq.index]
        before = len(detok.text)
        if token not in self.eos_token_ids or req.params.ignore_eos:  # EOS ends the text, never shows in it
            detok.add_token(token)
        stops = req.params.stop or []
        hit = find_stop(detok.text, stops, before - max((len(s) for s in stops), default=0)) if stops else None
        if hit is not None:
            detok.text = detok.text[: hit[0]]
            self.scheduler.finish(seq, "stop", hit[1])
        elif grammar == "rejected":
            self.scheduler.finish(seq, "abort")
        else:
            self.scheduler.check_stop(seq)
            if grammar == "terminated":  # the grammar's end: complete output, even on the last allowed token
                if not seq.is_finished:
                    self.scheduler.finish(seq, "stop")
                elif seq.finish_reason == "length":
                    seq.finish_reason = "stop"
        if seq.is_finished:
            if hit is None:
                detok.flush()
                if stops:  # a stop string may end in the flushed piece
                    late = find_stop(detok.text, stops, 0)
                    if late is not None:
                        detok.text = detok.text[: late[0]]
                        seq.finish_reason, seq.stop_reason = "stop", late[1]
            self._close_output(req, seq)
        else:
            visible = len(detok.text) - stop_holdback(detok.text, stops)
            out.text = detok.text[: max(visible, len(out.text))]
        out.token_ids.append(token)  # incremental: re-slicing the sequence would be O(length) per token

    def _fail_sequence(self, req: Request, seq: Sequence) -> None:
        """End ``seq`` with reason "abort" when its logits were not finite: the text so far is kept,
        its KV blocks are freed, and the rest of the batch goes on."""
        logger.error("request %s: the model's logits for output token %d are NaN or infinite (an overflow in "
                     "the forward; with dtype float16, try bfloat16); this completion stops with reason 'abort'",
                     req.request_id, seq.num_output_tokens)
        self.scheduler.finish(seq, "abort")
        req.detoks[seq.index].flush()
        self._close_output(req, seq)

    def _close_output(self, req: Request, seq: Sequence) -> None:
        """The finished ``seq``'s output takes its detokenizer's whole text and the sequence's finish and stop
        reasons; the request's finish time is now (the last completion to finish sets it)."""
        out = req.outputs[seq.index]
        out.text = req.detoks[seq.index].text
        out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
        self.structured.remove(seq)
        req.metrics.finished_time = time.monotonic()

    def _make_output(self, req: Request) -> RequestOutput | EmbeddingRequestOutput:
        if req.pooling is not None:
            vec = req.pooling.embedding if req.pooling.embedding is not None else torch.empty(0)
            return EmbeddingRequestOutput(req.request_id, req.prompt, req.prompt_token_ids, EmbeddingOutput(vec),
                                          req.finished, req.metrics)
        outputs = [CompletionOutput(o.index, o.text, list(o.token_ids), o.finish_reason,
                                    list(o.logprobs) if o.logprobs is not None else None,
                                    o.cumulative_logprob, o.stop_reason) for o in req.outputs]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs, req.finished,
                             req.seqs[0].num_cached_tokens, req.metrics)

    # ------------------------------------------------------------------ info
    def get_stats(self) -> EngineStats:
        """Current counters (a fresh copy)."""
        s = self.stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.kv_cache_usage = self.block_manager.usage()
        s.num_free_blocks = self.block_manager.num_free_blocks
        s.num_preemptions = self.scheduler.num_preemptions
        s.prefix_cache_queries = self.block_manager.num_queries
        s.prefix_cache_hits = self.block_manager.num_hits
        s.cpu_decode_replay = self.cpu_decode_replay()
        s.spec_decode = None if self.speculator is None else self.speculator.info()
        return EngineStats(**vars(s))

    def model_info(self) -> dict:
        """What the UI's model panel shows (sizes in bytes and tokens)."""
        qc = self.checkpoint.quant_config
        spec = self.model_runner.kv_spec
        return {
            "model": self.checkpoint.name,
            "architecture": type(self.model_runner.model).__name__,
            # what a chat UI starts its sampling from (Checkpoint.sampling_defaults; {} = its own defaults)
            "sampling_defaults": self.checkpoint.sampling_defaults(),
            "quantization": None if qc is None else {"method": qc.get("quant_method"), "bits": qc.get("bits"),
                                                     "group_size": qc.get("group_size")},
            # per layer kind, how its weights were loaded: "W4 (GGUF Q4_1, g32)", "dense"...
            "weights": describe_formats(self.model_runner.weight_formats),
            "kv_cache_dtype": "int8" if spec.is_int8 else str(spec.dtype).replace("torch.", ""),
            "weight_bytes": self.model_runner.weight_bytes,
            # what the weight files take on disk (0 for dummy weights); of weight_bytes, what the CPU path's GEMM
            # forms add (the quantized linears dequantized for the fp32 GEMM, a quantized table's 16-bit rows, the
            # MoE experts' prepared copies), and of those the experts' part: their copies' bytes less the W4
            # stacks the copies replace and release (FusedMoE.pack_for_cpu), so 0 for int4 copies of W4 experts
            # with 16-bit activations, 4 bytes a weight less the stack for the fp32 engine's prepacked copy
            "checkpoint_bytes": 0 if self.config.load_format == "dummy" else self.checkpoint.source_bytes,
            "cpu_dense_bytes": self.model_runner.cpu_dense_bytes,
            "cpu_expert_bytes": self.model_runner.cpu_expert_bytes,
            "num_kv_blocks": self.model_runner.num_blocks,
            "block_size": spec.block_size,
            "enable_prefix_caching": bool(self.config.enable_prefix_caching),
            "kv_pool_tokens": self.model_runner.num_blocks * spec.block_size,
            # per KV-cache group (sliding-window layers keep their own pool): window (None: full), layers, blocks
            "kv_groups": [{"window": g.window, "num_layers": len(g.layers), "num_blocks": n}
                          for g, n in zip(self.model_runner.kv_groups, self.model_runner.group_num_blocks)],
            "max_model_len": int(self.config.max_model_len),
            "dtype": str(self.config.torch_dtype).replace("torch.", ""),
            "device": str(self.config.torch_device),
            # a CPU engine's threads: mode ("auto": fewer while other processes keep cores busy; "fixed"), the
            # count now and at most, other processes' load at the last measurement (engine/cpu_threads.py)
            "cpu_threads": None if self.model_runner.cpu_threads is None else self.model_runner.cpu_threads.info(),
            # which CPU decode batch sizes are replayed from recordings, and why the others run eagerly
            "cpu_decode_replay": self.cpu_decode_replay(),
            # the settings that change a CPU engine's results or memory, as resolved (field, else environment)
            "cpu_lowbit": self.config.cpu_lowbit,
            "cpu_w4": self.config.cpu_w4,
            # speculative decoding: settings and counters so far (engine/spec/), None when off
            "speculative_decoding": None if self.speculator is None else self.speculator.info(),
            # "generate", or "pooling": an embedding model (LLM.embed, /v1/embeddings), with how it pools
            "runner": self.config.runner,
            "pooling": None if self.pooler_config is None else {
                "pooling_type": self.pooler_config.pooling_type, "normalize": self.pooler_config.normalize,
                "hidden_size": self.pooler_config.hidden_size, "source": self.pooler_config.source},
        }

    def cpu_decode_replay(self) -> dict:
        """Which CPU decode steps are replayed (``engine/cpu_graph.replay_report``): ``enabled``, ``batch_sizes``
        (the recorded range), ``replayed`` (sizes with a graph now), ``refused`` (size -> why eager), ``eager``
        (why the other sizes, or all of them, run eagerly)."""
        mr = self.model_runner
        return replay_report(mr.cpu_graph_runner, mr.cpu_replay_off, mr.cpu_replay_above)

    # ------------------------------------------------------------------ scoring
    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position, through the engine's own paged-KV prefill (chunked).

        Args:
            token_ids: 1..``max_model_len`` ids.
        Returns:
            fp32 ``[len(token_ids), vocab]`` on the CPU.
        Raises:
            ValueError: bad length or ids; RuntimeError: requests are in flight.
        """
        if self.pooler_config is not None:
            raise ValueError(GENERATION_REFUSED)
        if self.requests:
            raise RuntimeError("prompt_logits() needs an idle engine; finish or abort the running requests first")
        if not (1 <= len(token_ids) <= int(self.config.max_model_len)):
            raise ValueError(f"takes 1..{self.config.max_model_len} tokens, got {len(token_ids)}")
        bad = [t for t in token_ids if not (0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        seq = Sequence("__score__", token_ids, SamplingParams(max_tokens=1))
        seq.admitted = True
        caching = self.block_manager.enable_prefix_caching
        self.block_manager.enable_prefix_caching = False  # every position must be computed
        try:
            pieces = []
            chunk = self.config.max_num_batched_tokens
            for start in range(0, len(token_ids), chunk):
                n = min(chunk, len(token_ids) - start)
                # chunk by chunk, as the scheduler would: sliding-window groups free what their windows passed
                if not self.block_manager.allocate_slots(seq, len(token_ids) - start, num_step_tokens=n):
                    raise RuntimeError(f"prompt_logits() found no KV blocks for {len(token_ids)} tokens in an idle "
                                       f"engine")
                step = SchedulerOutput([ScheduledSequence(seq, start, n)])
                pieces.append(self.model_runner.run(step, all_logits=True).float().cpu())
                seq.num_computed_tokens = start + n
            return torch.cat(pieces)
        finally:
            self.block_manager.free(seq)
            self.block_manager.enable_prefix_caching = caching

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Log-probabilities of each next token (perplexity), via :meth:`prompt_logits`.

        Returns:
            fp32 ``[len(token_ids) - 1]``: ``log p(token_ids[i + 1] | token_ids[: i + 1])``.
        Raises:
            ValueError: fewer than 2 ids (or see :meth:`prompt_logits`).
        """
        if len(token_ids) < 2:
            raise ValueError(f"score() needs at least 2 tokens, got {len(token_ids)}")
        lp = torch.log_softmax(self.prompt_logits(token_ids)[:-1], dim=-1)
        return lp.gather(1, torch.tensor(token_ids[1:], dtype=torch.long).unsqueeze(1)).squeeze(1)
