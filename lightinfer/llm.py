"""The offline Python API: ``LLM(...).generate / .chat`` (vLLM style) and ``pipeline`` (LMDeploy style)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from lightinfer.config import EngineConfig
from lightinfer.engine.detokenizer import check_text
from lightinfer.engine.llm_engine import LLMEngine
from lightinfer.outputs import RequestOutput
from lightinfer.sampling_params import SamplingParams

Message = dict[str, object]
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # as the OpenAI API takes them
PromptType = str | list[int] | dict  # dict: vLLM style {"prompt": ...} or {"prompt_token_ids": ...}


def message_text(content: object) -> str:
    """A chat message's text: a plain string, or the text parts of a list of content blocks
    (OpenAI / Gradio style ``[{"type": "text", "text": ...}, ...]``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict) and isinstance(block.get("text"), str):
                parts.append(block["text"])
        return "".join(parts)
    if isinstance(content, dict) and isinstance(content.get("text"), str):
        return content["text"]
    raise ValueError(f"message content must be a string or a list of text blocks, got {type(content).__name__}")


def apply_chat_template(tokenizer: object, messages: list[Message]) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, ready for the reply.

    Raises:
        ValueError: no messages, a message without role/content or with an unknown role, text that is not
            valid Unicode, or a tokenizer without a template.
    """
    if isinstance(messages, (str, dict)) or not messages:
        raise ValueError("a conversation is a non-empty list of {'role': ..., 'content': ...} messages"
                         + (f", got {type(messages).__name__}" if messages else ", got an empty one"))
    clean = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(f"message role {m['role']!r} is not one of {', '.join(CHAT_ROLES)}")
        role = "system" if m["role"] == "developer" else str(m["role"])  # OpenAI's newer name for system
        clean.append({"role": role, "content": check_text(message_text(m["content"]), f"a {role} message")})
    if tokenizer is None:
        raise ValueError("this engine has no tokenizer (skip_tokenizer_init or a dummy model): chat needs one")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
    ids = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


class LLM:
    """Offline batched generation.

    Args:
        model: a Hugging Face folder, a ``.gguf`` file or ``smollm2-135m-instruct``.
        dtype: "auto", "float32", "float16" or "bfloat16".
        max_model_len: longest prompt + output in tokens.
        **engine_options: any other :class:`lightinfer.config.EngineConfig` field
            (``kv_cache_dtype="int8"``, ``max_num_seqs``, ``gpu_memory_utilization``, ...).

    Raises:
        FileNotFoundError / ValueError: see :class:`lightinfer.engine.llm_engine.LLMEngine`.
    """

    def __init__(self, model: str, dtype: str = "auto", max_model_len: int | None = None, **engine_options: object) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, dtype=dtype, max_model_len=max_model_len,
                                                 **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> object:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched; results in input order.

        Args:
            prompts: a string, a list of strings, or a list of token-id lists.
            sampling_params: one for all, or one per prompt (default: ``SamplingParams()``).
            use_tqdm: show a progress bar.
        Raises:
            ValueError: a bad prompt or setting (checked for every prompt before any work starts).
        """
        if (isinstance(prompts, (str, dict)) or not isinstance(prompts, Iterable)
                or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))):
            prompts = [prompts]  # type: ignore[list-item]  (one prompt; encode_prompt refuses other types)
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
        if bad is not None:
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(bad).__name__}; "
                             f"e.g. SamplingParams(max_tokens=64)")
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts: give one, or one per prompt")
        for p, sp in zip(prompts, params):  # validate all before queueing any
            sp.validate()
            self.llm_engine.encode_prompt(p)
        return self._run([(p, sp) for p, sp in zip(prompts, params)], use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template.

        Raises:
            ValueError: see :func:`apply_chat_template`, and :meth:`generate`.
        """
        if isinstance(messages, (str, dict)):
            raise ValueError(  # noqa: TRY004 - every bad input is a ValueError here
                f"chat() takes a conversation (a list of {{'role': ..., 'content': ...}} messages) or a "
                f"list of them, got {type(messages).__name__}; for a plain prompt use generate()")
        if not messages:
            raise ValueError("chat() got no messages: give a conversation (a list of {'role': ..., 'content': ...} "
                             "messages) or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        ids = [apply_chat_template(self.tokenizer, conv) for conv in conversations]  # type: ignore[arg-type]
        return self.generate(ids, sampling_params, use_tqdm)

    def _run(self, items: list[tuple[PromptType, SamplingParams]], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        order: dict[str, int] = {}
        for i, (prompt, sp) in enumerate(items):
            rid = f"llm-{next(self._ids)}"
            order[rid] = i
            engine.add_request(rid, prompt, sp)
        results: list[RequestOutput | None] = [None] * len(items)
        bar = tqdm(total=len(items), desc="generating", disable=not use_tqdm)
        try:
            remaining = len(items)
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
    or a list of ``{"role", "content"}`` messages.
    """

    def __init__(self, llm: LLM) -> None:
        if llm.tokenizer is None:
            raise ValueError("a pipeline takes text and messages, and this model has no tokenizer (a dummy model "
                             "from a bare config folder?): use LLM(...).generate with token-id prompts instead")
        self.llm = llm

    def _to_ids(self, prompt: str | list[Message]) -> list[int] | str:
        tok = self.llm.tokenizer
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not all(
                isinstance(m, dict) for m in prompt)):
            raise ValueError(f"a pipeline prompt is a string or a list of {{'role': ..., 'content': ...}} messages, "
                             f"got {type(prompt).__name__} {str(prompt)[:60]!r}; token ids go to LLM.generate")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if getattr(tok, "chat_template", None):
                return apply_chat_template(tok, [{"role": "user", "content": prompt}])
            return prompt
        return apply_chat_template(tok, prompt)

    @staticmethod
    def _params(gen_config: SamplingParams | None, kwargs: dict) -> SamplingParams:
        """The given settings; else ``SamplingParams(**kwargs)`` with LMDeploy's 512-token default."""
        if gen_config is not None:
            return gen_config
        return SamplingParams(**{"max_tokens": 512, **kwargs})  # type: ignore[arg-type]

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
        outs = self.llm.generate([self._to_ids(p) for p in batch], sp, use_tqdm=False)  # type: ignore[arg-type]
        responses = [Response(o.outputs[0].text, len(o.outputs[0].token_ids), len(o.prompt_token_ids),
                              o.outputs[0].finish_reason, o.outputs[0].token_ids, i) for i, o in enumerate(outs)]
        return responses[0] if single else responses

    def stream_infer(self, prompt: str | list[Message], gen_config: SamplingParams | None = None,
                     **kwargs: object) -> Iterator[str]:
        """Yield text pieces for one prompt as they are generated."""
        sp = self._params(gen_config, kwargs)
        yield from self.llm.stream(self._to_ids(prompt), sp)


def pipeline(model: str, **options: object) -> Pipeline:
    """An LMDeploy-style pipeline over ``LLM(model, **options)``."""
    return Pipeline(LLM(model, **options))  # type: ignore[arg-type]
