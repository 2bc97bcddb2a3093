"""The offline Python API: ``LLM(...).generate / .chat / .embed`` (vLLM style) and ``pipeline`` (LMDeploy style)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from lightinfer.config import EngineConfig
from lightinfer.engine.llm_engine import LLMEngine
from lightinfer.inputs import (
    EngineRequest,
    InputProcessor,
    Message,
    PoolingParams,
    PromptType,
    TokenizedPrompt,
)
from lightinfer.outputs import EmbeddingRequestOutput, RequestOutput
from lightinfer.sampling_params import SamplingParams, chat_sampling


class LLM:
    """Offline batched generation.

    Args:
        model: a Hugging Face folder, a ``.gguf`` file or ``smollm2-135m-instruct``.
        dtype: "auto", "float32", "float16" or "bfloat16".
        max_model_len: longest prompt + output in tokens.
        show_progress: print a line on stderr as each loading phase starts (reading, tokenizer, weights...).
        **engine_options: any other :class:`lightinfer.config.EngineConfig` field
            (``kv_cache_dtype="int8"``, ``max_num_seqs``, ``gpu_memory_utilization``, ``runner="pooling"`` for an
            embedding model, ...); vLLM's older ``task="embed"`` means ``runner="pooling"`` (``task="generate"``:
            ``runner="generate"``).

    Raises:
        FileNotFoundError / ValueError: see :class:`lightinfer.engine.llm_engine.LLMEngine`.
    """

    def __init__(self, model: str, dtype: str = "auto", max_model_len: int | None = None, show_progress: bool = True,
                 **engine_options: object) -> None:
        if "task" in engine_options:  # vLLM's older spelling of runner
            task = engine_options.pop("task")
            runners = {"embed": "pooling", "embedding": "pooling", "generate": "generate", "auto": "auto"}
            if task not in runners:
                raise ValueError(f"task must be one of {', '.join(runners)} (vLLM's older name of runner), got {task!r}")
            if engine_options.setdefault("runner", runners[task]) != runners[task]:  # type: ignore[arg-type]
                raise ValueError(f"task={task!r} and runner={engine_options['runner']!r} disagree; give runner only")
        self.llm_engine = LLMEngine(EngineConfig(model=model, dtype=dtype, max_model_len=max_model_len,
                                                 **engine_options), show_progress=show_progress)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> object:
        return self.llm_engine.tokenizer

    def chat_sampling_params(self, max_tokens: int = 16, **given: object) -> SamplingParams:
        """The sampling a chat starts from: temperature / top_p / top_k as the model's authors recommend
        (``generation_config.json`` or the embedded model's card: ``model_info()["sampling_defaults"]``, what
        the chat UI and ``lightinfer chat`` start from), else :data:`lightinfer.sampling_params.CHAT_SAMPLING`;
        ``given`` fields (any :class:`SamplingParams` field) override them.

        Raises:
            ValueError: a bad setting (see :meth:`SamplingParams.validate`).
        """
        return chat_sampling(self.llm_engine.checkpoint.sampling_defaults(), given, max_tokens)  # type: ignore[arg-type]

    @property
    def input_processor(self) -> InputProcessor:
        """The engine's :class:`lightinfer.inputs.InputProcessor` (tokenizing, chat template, checks)."""
        return self.llm_engine.input_processor

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched; results in input order.

        Args:
            prompts: a prompt or a list of them: a string, a token-id list, vLLM's ``{"prompt": text}`` /
                ``{"prompt_token_ids": ids}``, or a :class:`lightinfer.inputs.TokenizedPrompt`.
            sampling_params: one for all, or one per prompt (default: ``SamplingParams()``, vLLM's defaults:
                temperature 1, top-p 1, 16 tokens).
            use_tqdm: show a progress bar.
        Raises:
            ValueError: a bad prompt or setting (checked for every prompt before any work starts).
        """
        if (isinstance(prompts, (str, dict, TokenizedPrompt)) or not isinstance(prompts, Iterable)
                or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))):
            prompts = [prompts]  # type: ignore[list-item]  (one prompt; the input processor refuses other types)
        prompts = list(prompts)  # type: ignore[arg-type]
        params = _params_per_prompt(sampling_params, len(prompts))
        processor = self.input_processor
        requests = [processor.process(p, sp) for p, sp in zip(prompts, params)]  # all checked before any is queued
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template.

        Args:
            messages: ``[{"role", "content"}, ...]`` (OpenAI's shape: assistant ``tool_calls`` and
                ``{"role": "tool", "tool_call_id", "content"}`` results too), or a list of conversations.
            sampling_params: one for all, or one per conversation (default: :meth:`chat_sampling_params`: the
                model's recommended temperature / top-p / top-k, as a chat UI starts from, with vLLM's
                ``max_tokens=16``; pass ``SamplingParams()`` for vLLM's plain defaults).
            use_tqdm: show a progress bar.
            add_generation_prompt: end the prompt with the assistant's header (the reply is generated).
            tools: OpenAI tool definitions ``[{"type": "function", "function": {"name", "description",
                "parameters"}}]``, rendered by the chat template (or a fallback tool prompt). Each output
                then has ``tool_calls`` (its ``text`` is the text outside the calls; finish_reason
                "tool_calls" when it called any); a call, once started, always parses and matches its
                tool's ``parameters`` (constrained decoding).
            chat_template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}``).
            tool_choice: "auto" (default with tools: the model decides), "none", "required" (at least one
                call) or ``{"type": "function", "function": {"name": ...}}`` (exactly that call).
            parallel_tool_calls: allow several calls in one reply.
        Raises:
            ValueError: naming the field (bad tools, a tool_choice naming no tool, a tool message whose
                tool_call_id matches no earlier call...); see :func:`lightinfer.inputs.render_chat`, and
                :meth:`generate`.
        """
        if isinstance(messages, (str, dict)):
            raise ValueError(  # noqa: TRY004 - every bad input is a ValueError here
                f"chat() takes a conversation (a list of {{'role': ..., 'content': ...}} messages) or a "
                f"list of them, got {type(messages).__name__}; for a plain prompt use generate()")
        if not messages:
            raise ValueError("chat() got no messages: give a conversation (a list of {'role': ..., 'content': ...} "
                             "messages) or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        params = _params_per_prompt(self.chat_sampling_params() if sampling_params is None else sampling_params,
                                    len(conversations))
        prepared = [self.input_processor.process_chat(
            conv, sp, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,  # type: ignore[arg-type]
            add_generation_prompt=add_generation_prompt, chat_template_kwargs=chat_template_kwargs)
            for conv, sp in zip(conversations, params)]  # all checked before any is queued
        outputs = self._run([request for request, _ in prepared], use_tqdm)
        for out, (_, calling) in zip(outputs, prepared):
            if calling is None:
                continue
            for comp in out.outputs:
                parsed = calling.parse(comp.text)
                comp.text, comp.tool_calls = parsed.content or "", parsed.tool_calls
                if parsed.tool_calls and comp.finish_reason == "stop":
                    comp.finish_reason = "tool_calls"
        return outputs

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        dimensions: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Embed every prompt with a pooling (embedding) model, batched through the engine; results in input order.

        Each prompt is prefilled (in chunks when longer than the step's budget) and pooled as the model says
        (``model_info()["pooling"]``: its sentence-transformers files, else the last token, L2-normalised); its KV
        blocks are freed as soon as it is pooled.

        Args:
            prompts: a string, a token-id list, vLLM's prompt dicts, or a list of them; text is tokenized with
                the tokenizer's special tokens (as sentence-transformers encodes it), up to ``max_model_len`` tokens.
            dimensions: keep the first ``dimensions`` values of each vector and normalise again where the model
                normalises (Matryoshka; 1..hidden_size, or the model's ``matryoshka_dimensions``); None: all.
            use_tqdm: show a progress bar.
        Returns:
            one :class:`lightinfer.outputs.EmbeddingRequestOutput` per prompt: ``outputs.data`` fp32 ``[dims]``
            (CPU tensor), ``outputs.embedding`` the same as a list.
        Raises:
            ValueError: the model is not a pooling model (start it with ``runner="pooling"``), a bad prompt (empty,
                longer than ``max_model_len``, ids outside the vocabulary) or ``dimensions``; all are checked
                before any work starts.
        """
        if (isinstance(prompts, (str, dict, TokenizedPrompt)) or not isinstance(prompts, Iterable)
                or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))):
            prompts = [prompts]  # type: ignore[list-item]  (one prompt; the input processor refuses other types)
        prompts = list(prompts)  # type: ignore[arg-type]
        if not prompts:
            raise ValueError("embed() got no prompts: give a string, a token-id list, or a list of them")
        processor = self.input_processor
        processor.check_embeds()
        params = PoolingParams(dimensions=dimensions)
        requests = [processor.process_embedding(p, params) for p in prompts]  # all checked before any is queued
        return self._run(requests, use_tqdm, "embedding")  # type: ignore[return-value]

    def _run(self, requests: list[EngineRequest], use_tqdm: bool, what: str = "generating") -> list[RequestOutput]:
        engine = self.llm_engine
        order: dict[str, int] = {}
        for i, request in enumerate(requests):
            rid = f"llm-{next(self._ids)}"
            order[rid] = i
            engine.add_request(rid, request)
        results: list[RequestOutput | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc=what, disable=not use_tqdm)
        try:
            remaining = len(requests)
            while remaining:
                for out in engine.step(final_only=True):
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        remaining -= 1
                        bar.update(1)
        except BaseException:
            for rid in order:  # an interrupt must not leave requests holding KV blocks
                engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text pieces of one completion as they are generated (they join to the final text).

        Raises:
            ValueError: a bad prompt or setting, or an engine without a tokenizer (no text to
                stream: use :meth:`generate`, whose outputs carry the token ids).
        """
        engine = self.llm_engine
        if engine.tokenizer is None:
            raise ValueError("stream() yields text and this engine has no tokenizer (a dummy model from a bare "
                             "config folder, or skip_tokenizer_init): use generate() and read outputs[0].token_ids")
        rid = f"llm-{next(self._ids)}"
        engine.add_request(rid, prompt, sampling_params or SamplingParams())
        sent = 0
        try:
            while True:
                for out in engine.step():
                    if out.request_id != rid:
                        continue
                    text = out.outputs[0].text
                    if len(text) > sent:
                        yield text[sent:]
                        sent = len(text)
                    if out.finished:
                        return
        finally:
            engine.abort_request(rid)


def _params_per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                       num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams per prompt (a single one is shared; None: ``SamplingParams()``).

    Raises:
        ValueError: not SamplingParams, or a list of another length.
    """
    if sampling_params is None:
        sampling_params = SamplingParams()
    params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * num_prompts
    bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
    if bad is not None:
        raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(bad).__name__}; "
                         f"e.g. SamplingParams(max_tokens=64)")
    if len(params) != num_prompts:
        raise ValueError(f"{len(params)} sampling params for {num_prompts} prompts: give one, or one per prompt")
    return params


@dataclass
class Response:
    """LMDeploy-style result of one prompt (``pipe(...)``)."""

    text: str
    generate_token_len: int
    input_token_len: int
    finish_reason: str | None
    token_ids: list[int]
    index: int = 0


class Pipeline:
    """LMDeploy-style pipeline: ``pipe("hi")``, ``pipe([...])``, ``pipe(messages)``, ``pipe.stream_infer``.

    A prompt is a string (sent through the chat template when the model has one, as LMDeploy does)
    or a list of ``{"role", "content"}`` messages. A call without ``gen_config`` samples as the model's authors
    recommend (:meth:`LLM.chat_sampling_params`, as the chat UI does; keyword settings override it) with
    LMDeploy's 512-token limit.
    """

    def __init__(self, llm: LLM) -> None:
        if llm.tokenizer is None:
            raise ValueError("a pipeline takes text and messages, and this model has no tokenizer (a dummy model "
                             "from a bare config folder?): use LLM(...).generate with token-id prompts instead")
        self.llm = llm

    def _to_prompt(self, prompt: str | list[Message]) -> TokenizedPrompt | str:
        tok = self.llm.tokenizer
        processor = self.llm.input_processor
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not all(
                isinstance(m, dict) for m in prompt)):
            raise ValueError(f"a pipeline prompt is a string or a list of {{'role': ..., 'content': ...}} messages, "
                             f"got {type(prompt).__name__} {str(prompt)[:60]!r}; token ids go to LLM.generate")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if getattr(tok, "chat_template", None):
                return processor.render_chat([{"role": "user", "content": prompt}])
            return prompt
        return processor.render_chat(prompt)

    def _params(self, gen_config: SamplingParams | None, kwargs: dict) -> SamplingParams:
        """``gen_config`` as it is; else the model's recommended chat sampling with ``kwargs`` (any
        :class:`SamplingParams` field) over it and LMDeploy's 512-token default."""
        if gen_config is not None:
            return gen_config
        return self.llm.chat_sampling_params(**{"max_tokens": 512, **kwargs})

    def _batch(self, prompts: object) -> tuple[list[object], bool]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)):
            return [prompts], True
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(  # noqa: TRY004 - every bad input is a ValueError here
                f"a pipeline takes a prompt (a string or a list of messages) or a list of prompts, "
                f"got {type(prompts).__name__}")
        return list(prompts), False

    def __call__(self, prompts: object, gen_config: SamplingParams | None = None, **kwargs: object
                 ) -> Response | list[Response]:
        """Generate; a single prompt gives one :class:`Response`, a list gives a list."""
        batch, single = self._batch(prompts)
        sp = self._params(gen_config, kwargs)
        outs = self.llm.generate([self._to_prompt(p) for p in batch], sp, use_tqdm=False)  # type: ignore[arg-type]
        responses = [Response(o.outputs[0].text, len(o.outputs[0].token_ids), len(o.prompt_token_ids),
                              o.outputs[0].finish_reason, o.outputs[0].token_ids, i) for i, o in enumerate(outs)]
        return responses[0] if single else responses

    def stream_infer(self, prompt: str | list[Message], gen_config: SamplingParams | None = None,
                     **kwargs: object) -> Iterator[str]:
        """Yield text pieces for one prompt as they are generated."""
        sp = self._params(gen_config, kwargs)
        yield from self.llm.stream(self._to_prompt(prompt), sp)


def pipeline(model: str, **options: object) -> Pipeline:
    """An LMDeploy-style pipeline over ``LLM(model, **options)``."""
    return Pipeline(LLM(model, **options))  # type: ignore[arg-type]
