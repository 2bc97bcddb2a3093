"""InputProcessor: prompts, chat messages and settings -> :class:`EngineRequest`, checked once.

Every front end goes through it (``LLM``, the OpenAI API, the chat UI, the CLI) and the engine
takes its result without looking again; ``LLMEngine.add_request`` given a plain prompt runs it
itself. One processor holds one tokenizer: Hugging Face fast tokenizers are not safe to share
between threads, so a front end working on another thread takes :meth:`InputProcessor.copy`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from lightinfer.inputs.chat import Message, render_chat
from lightinfer.inputs.data import EngineRequest, InputError, PoolingParams, PromptType, TokenizedPrompt
from lightinfer.inputs.pooling import EMBEDDINGS_REFUSED, GENERATION_REFUSED, PoolerConfig
from lightinfer.inputs.text import check_text, longest_token_chars
from lightinfer.inputs.tools import ToolCalling, reasoning_mode
from lightinfer.sampling_params import SamplingParams
from lightinfer.structured.backend import GrammarBackend
from lightinfer.structured.tool_formats import ToolCallFormat, detect_tool_call_format
from lightinfer.structured.tool_grammar import build_tool_call_grammar
from lightinfer.structured.tool_spec import parse_tool_choice, parse_tools


class InputProcessor:
    """Tokenizes and checks requests for one engine.

    Args:
        tokenizer: the model's tokenizer, or None (an engine that takes and returns token ids only).
        vocab_size: the model's vocabulary size (ids must be below it).
        max_model_len: the context length in tokens (a prompt must leave room for one new token).
        grammar_backend: returns the engine's (thread-safe, shared) grammar backend, which compiles
            ``structured_outputs`` here, where the request is prepared, into the cache the engine's
            matchers copy from; None: constraints are checked but compiled by the engine.
        tool_call_parser: the tool-call format to use whatever the chat template shows (a
            ``--tool-call-parser`` name); None: detected from the template.
        pooler_config: set for a pooling (embedding) engine: how it pools; embedding requests
            (:meth:`process_embedding`) are then taken and generation requests refused. None: a generative
            engine, which refuses embedding requests.
    Raises:
        ValueError: an unknown ``tool_call_parser``.
    """

    _UNKNOWN = -1  # max_token_chars not computed yet

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int,
                 grammar_backend: Callable[[], GrammarBackend] | None = None,
                 tool_call_parser: str | None = None, pooler_config: PoolerConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.pooler_config = pooler_config
        self.vocab_size = int(vocab_size)
        self.max_model_len = int(max_model_len)
        self.grammar_backend = grammar_backend
        self.tool_call_parser = tool_call_parser
        template = getattr(tokenizer, "chat_template", None)
        self.tool_call_format: ToolCallFormat = detect_tool_call_format(
            template if isinstance(template, str) else None, tool_call_parser)
        self._max_token_chars: int | None = self._UNKNOWN

    def copy(self, tool_call_parser: str | None = None) -> InputProcessor:
        """A processor with its own copy of the tokenizer, for use on another thread (sharing the grammar
        backend); ``tool_call_parser`` overrides this one's."""
        other = InputProcessor(copy.deepcopy(self.tokenizer), self.vocab_size, self.max_model_len,
                               self.grammar_backend, tool_call_parser or self.tool_call_parser, self.pooler_config)
        other._max_token_chars = self.max_token_chars
        return other

    # ------------------------------------------------------------------ cheap checks (no tokenizing)
    @property
    def max_token_chars(self) -> int | None:
        """The most input characters one token stands for (:func:`lightinfer.inputs.text.longest_token_chars`),
        computed once; None without a tokenizer or a vocabulary to bound it."""
        if self._max_token_chars == self._UNKNOWN:
            self._max_token_chars = None if self.tokenizer is None else longest_token_chars(self.tokenizer)
        return self._max_token_chars

    def check_text_size(self, num_chars: int, param: str = "prompt") -> None:
        """Refuse, without tokenizing, a text of ``num_chars`` characters that cannot fit the context whatever
        its tokenization (it is at least ``num_chars / max_token_chars`` tokens). Costs nothing, so front ends
        call it on their event loop before handing a request to a tokenizing thread: a 4 MB body is refused
        at once instead of holding the tokenizer (and the GIL) for seconds.

        Raises:
            InputError: code ``context_length_exceeded``, naming ``param``.
        """
        per_token = self.max_token_chars
        if per_token is None or num_chars < per_token * self.max_model_len:
            return
        raise InputError(f"'{param}' holds {num_chars:,} characters, which is more than {self.max_model_len:,} "
                         f"tokens whatever the tokenization (a token stands for at most {per_token} characters) "
                         f"but this model's maximum context length is {self.max_model_len} tokens; shorten it",
                         param=param, code="context_length_exceeded")

    def check_messages_size(self, messages: Any, param: str = "messages") -> None:
        """:meth:`check_text_size` on the total text of chat ``messages`` (the template only adds to it);
        messages that are not a list of dicts are left to :meth:`render_chat`'s checks."""
        if isinstance(messages, (list, tuple)):
            self.check_text_size(sum(_content_chars(m.get("content")) for m in messages if isinstance(m, dict)),
                                 param)

    # ------------------------------------------------------------------ prompts
    def tokenize(self, prompt: PromptType) -> TokenizedPrompt:
        """Text and ids of ``prompt``: text is encoded (with the tokenizer's special tokens, e.g. BOS),
        ids are decoded for the text, a :class:`TokenizedPrompt` is taken as it is; the ids are checked
        against the vocabulary (the length against the context is :meth:`process`'s check).

        Also takes vLLM's prompt dicts: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``.

        Raises:
            ValueError: empty prompt, text that is not valid Unicode, ids outside the vocabulary, a dict
                without either key, or another type.
        """
        if isinstance(prompt, TokenizedPrompt):
            self._check_ids(prompt.prompt_token_ids)
            return prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a dict prompt needs 'prompt' (text) or 'prompt_token_ids' (a list of ids), "
                                 f"got keys {sorted(prompt)}")
        if not isinstance(prompt, (str, list, tuple)):
            raise ValueError(  # noqa: TRY004 - every bad input is a ValueError here
                f"a prompt is a string, a list of token ids or a {{'prompt': ...}} / "
                f"{{'prompt_token_ids': ...}} dict, got {type(prompt).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give at least one character or token id")
            self.check_text_size(len(prompt))
            check_text(prompt, "the prompt")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (skip_tokenizer_init, or dummy weights from a config "
                                 "folder without tokenizer files): give prompts as token-id lists")
            return TokenizedPrompt(prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True)))
        ids = list(prompt)
        self._check_ids(ids)
        return TokenizedPrompt(self.tokenizer.decode(ids) if self.tokenizer is not None else "", ids)

    def render_chat(self, messages: list[Message], *, add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None) -> TokenizedPrompt:
        """The conversation through the chat template (see :func:`lightinfer.inputs.chat.render_chat`);
        its length is checked where it is used (:meth:`process`, :meth:`check_context`); a conversation far
        beyond the context is refused before the template runs (:meth:`check_messages_size`)."""
        self.check_messages_size(messages)
        return render_chat(self.tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                           chat_template_kwargs=chat_template_kwargs, tool_format=self.tool_call_format)

    def _check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty; give at least one character or token id")
        if all(isinstance(t, int) for t in ids) and 0 <= min(ids) and max(ids) < self.vocab_size:
            return  # the common case, without a Python loop over the ids
        bad = next(t for t in ids if not isinstance(t, int) or not (0 <= t < self.vocab_size))
        raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")

    def check_length(self, prompt: TokenizedPrompt) -> TokenizedPrompt:
        """``prompt`` if it leaves room for one new token within ``max_model_len``.

        Raises:
            InputError: code ``context_length_exceeded``.
        """
        n = len(prompt.prompt_token_ids)
        if n >= self.max_model_len:
            raise InputError(f"the prompt has {n} tokens but max_model_len is {self.max_model_len}: shorten it "
                             f"(or raise max_model_len) so that at least one token can be generated",
                             param="prompt", code="context_length_exceeded")
        return prompt

    def check_context(self, prompt_len: int, max_tokens: int | None, param: str = "prompt") -> int:
        """Room for the completion, as OpenAI's API counts it: the prompt plus ``max_tokens`` must fit.

        Args:
            prompt_len: prompt tokens.
            max_tokens: the completion's wished length (None: as long as fits).
            param: the request field that holds the prompt, named in the error.
        Returns:
            the tokens left for the completion (> 0).
        Raises:
            InputError: code ``context_length_exceeded``, naming ``param``.
        """
        room = self.max_model_len - prompt_len
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            asked = f"; you requested {prompt_len + (max_tokens or 0)} tokens ({prompt_len} in the prompt, " \
                    f"{max_tokens or 0} for the completion)"
            raise InputError(f"This model's maximum context length is {self.max_model_len} tokens{asked}. Shorten "
                             f"the prompt or lower max_tokens.", param=param, code="context_length_exceeded")
        return room

    # ------------------------------------------------------------------ settings
    def check_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` validated, and checked against this engine (tokenizer, vocabulary).

        Raises:
            ValueError: not a SamplingParams, a bad value, stop strings without a tokenizer, or stop token ids
                outside the vocabulary.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(  # noqa: TRY004 - every bad input is a ValueError here
                f"sampling_params must be a SamplingParams, got {type(params).__name__}; "
                f"e.g. SamplingParams(max_tokens=64)")
        params.validate()  # fields may have been changed since construction
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer and this engine has none; use stop_token_ids")
        too_big = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if too_big:  # they index the logits row (banned before min_tokens): out of range on the GPU is fatal
            raise ValueError(f"stop_token_ids {too_big} are outside the vocabulary (ids 0..{self.vocab_size - 1})")
        if params.structured_outputs is not None and self.grammar_backend is not None:
            # compiled here (a front end's preparation thread), so the engine only copies the result
            self.grammar_backend().compile(params.structured_outputs)
        return params

    # ------------------------------------------------------------------ chat with tools
    def render_chat_tools(self, messages: list[Message], *, tools: list[dict[str, Any]] | None = None,
                          tool_choice: Any = None, parallel_tool_calls: bool = True, add_generation_prompt: bool = True,
                          chat_template_kwargs: dict[str, Any] | None = None,
                          ) -> tuple[TokenizedPrompt, ToolCalling | None]:
        """The conversation through the template with its tools, and how the reply is constrained and read
        (see :meth:`process_chat`, which is this plus :meth:`ToolCalling.constrain` and :meth:`process`).

        Returns:
            ``(prompt, tool_calling)``; ``tool_calling`` is None without tools or with tool_choice "none"
            (the tools are then left out of the prompt: the model is not to call them).
        Raises:
            InputError: naming the field (``tools[1].type``, ``tool_choice.function.name``,
                ``messages[3].tool_call_id``, ``tools[0].function.parameters`` ...), or see :meth:`render_chat`;
                param ``model`` from a pooling engine (:meth:`check_generates`).
        """
        self.check_generates()
        try:
            specs = parse_tools(tools)
            choice = parse_tool_choice(tool_choice, specs)
        except ValueError as e:
            raise InputError(str(e), param=str(e).split(":", 1)[0]) from None
        active = bool(specs) and choice.mode != "none"
        prompt = self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                  tools=list(tools or []) if active else None, chat_template_kwargs=chat_template_kwargs)
        if not active:
            return prompt, None
        backend = self.grammar_backend() if self.grammar_backend is not None else None
        try:
            grammar = build_tool_call_grammar(
                specs, tool_choice, self.tool_call_format, parallel_tool_calls,
                special_tokens=backend.special_token_id if backend is not None else None,
                reasoning=reasoning_mode(getattr(self.tokenizer, "chat_template", None), prompt.prompt,
                                         chat_template_kwargs))
        except ValueError as e:
            raise InputError(str(e), param=str(e).split(":", 1)[0]) from None
        assert grammar is not None  # tools and a choice other than "none"
        return prompt, ToolCalling(self.tool_call_format, tuple(specs), choice, grammar)

    def process_chat(self, messages: list[Message], params: SamplingParams, *,
                     tools: list[dict[str, Any]] | None = None, tool_choice: Any = None,
                     parallel_tool_calls: bool = True, add_generation_prompt: bool = True,
                     chat_template_kwargs: dict[str, Any] | None = None) -> tuple[EngineRequest, ToolCalling | None]:
        """One chat turn as an engine request, with tools: they are rendered (by the template, or the
        fallback tool prompt), and unless ``tool_choice`` is "none" the reply is constrained so that a call,
        once started, is valid ("auto"), or is forced ("required", or a named function).

        Args:
            messages: the conversation (assistant ``tool_calls`` and ``tool`` results included).
            params: the settings (see :meth:`ToolCalling.constrain` for what tools change).
            tools: OpenAI ``tools``; tool_choice: OpenAI ``tool_choice`` (default "auto" with tools).
            parallel_tool_calls: allow several calls in one reply.
            add_generation_prompt / chat_template_kwargs: see :func:`render_chat`.
        Returns:
            ``(request, tool_calling)``: ``tool_calling`` parses the reply; None without tools or with
            tool_choice "none".
        Raises:
            InputError: see :meth:`render_chat_tools`, :meth:`ToolCalling.constrain` and :meth:`process`.
        """
        prompt, calling = self.render_chat_tools(
            messages, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
            add_generation_prompt=add_generation_prompt, chat_template_kwargs=chat_template_kwargs)
        if calling is not None:
            params = calling.constrain(params)
        return self.process(prompt, params), calling

    # ------------------------------------------------------------------ requests
    def process(self, prompt: PromptType, params: SamplingParams) -> EngineRequest:
        """One engine-ready request: settings checked (:meth:`check_params`), then the prompt
        tokenized and checked (:meth:`tokenize`, :meth:`check_length`).

        Raises:
            ValueError: see those; nothing is queued anywhere. InputError (param ``model``) from a pooling
                engine (:meth:`check_generates`).
        """
        self.check_generates()
        self.check_params(params)
        tokenized = self.check_length(self.tokenize(prompt))
        return EngineRequest(tokenized.prompt, tokenized.prompt_token_ids, params)


    # ------------------------------------------------------------------ embeddings
    def check_generates(self) -> None:
        """Refuse generation on a pooling engine.

        Raises:
            InputError: param ``model``, "this model serves embeddings: use /v1/embeddings ..."."""
        if self.pooler_config is not None:
            raise InputError(GENERATION_REFUSED, param="model")

    def check_embeds(self) -> None:
        """Refuse embeddings on a generative engine.

        Raises:
            InputError: param ``model``, saying how to start the model for embeddings."""
        if self.pooler_config is None:
            raise InputError(EMBEDDINGS_REFUSED, param="model")

    def process_embedding(self, prompt: PromptType, params: PoolingParams | None = None,
                          param: str = "prompt") -> EngineRequest:
        """One embedding request: the prompt tokenized (:meth:`tokenize`; text gets the tokenizer's special
        tokens, as sentence-transformers encodes it) and checked, ``params.dimensions`` checked against the
        model (:meth:`PoolerConfig.output_dimensions`). The prompt may fill the whole context
        (``max_model_len`` ids): nothing is generated after it.

        Args:
            prompt: text, token ids, vLLM's prompt dicts or a :class:`TokenizedPrompt`.
            params: the request's settings (default ``PoolingParams()``).
            param: the request field that holds the prompt, named in errors (the API's ``input``).
        Returns:
            an :class:`EngineRequest` with ``pooling_params`` set.
        Raises:
            InputError / ValueError: a generative engine (:meth:`check_embeds`), an empty or unreadable prompt,
                ids outside the vocabulary, a prompt longer than ``max_model_len`` (code
                ``context_length_exceeded``, naming ``param``), bad ``dimensions`` (naming ``dimensions``).
        """
        self.check_embeds()
        params = PoolingParams() if params is None else params
        if not isinstance(params, PoolingParams):
            raise ValueError(  # noqa: TRY004 - every bad input is a ValueError here
                f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        assert self.pooler_config is not None
        self.pooler_config.output_dimensions(params.dimensions)
        try:
            tokenized = self.tokenize(prompt)
        except ValueError as exc:  # the field as the caller names it (the API's ``input``)
            raise InputError(str(exc).replace("'prompt'", f"'{param}'"), param=param,
                             code=getattr(exc, "code", None)) from None
        n = len(tokenized.prompt_token_ids)
        if n > self.max_model_len:
            raise InputError(f"'{param}' has {n} tokens but this model's maximum context length is "
                             f"{self.max_model_len} tokens: shorten it", param=param, code="context_length_exceeded")
        return EngineRequest(tokenized.prompt, tokenized.prompt_token_ids, SamplingParams(max_tokens=1), params)


def _content_chars(content: Any) -> int:
    """Characters of a message's content: a string, or the text of a list of content blocks."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, (list, tuple)):
        return sum(_content_chars(block.get("text") if isinstance(block, dict) else block) for block in content)
    return 0
