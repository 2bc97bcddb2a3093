"""``lightinfer chat MODEL``: a chat in the terminal, as ``ollama run`` offers.

The reply streams as it is generated; the conversation is kept and sent again each turn (the oldest turns
are left out, with a notice, when it outgrows the context); ``/reset`` forgets it, ``/exit`` (or Ctrl-D)
leaves, and Ctrl-C stops a reply without leaving: while a reply streams, SIGINT only sets a flag that the
loop checks between engine steps, so the engine is never interrupted half-way through a step and the
stopped request is aborted cleanly (its KV blocks freed) before the next prompt.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TextIO

from lightinfer.cli.common import add_engine_args, add_parser, engine_kwargs
from lightinfer.sampling_params import SamplingParams, chat_sampling

PROMPT = ">>> "
HELP = ("/reset  forget the conversation\n"
        "/exit   leave (also /bye, /quit, Ctrl-D)\n"
        "/help   this list\n"
        "Ctrl-C stops a reply (not the program).")


def register(subparsers: Any) -> None:
    """Add the ``chat`` subcommand (it sets ``func(args) -> exit code``)."""
    c = add_parser(subparsers, "chat", "chat with MODEL in the terminal (streamed replies, history, /reset, /exit)",
                   "An interactive chat through the model's chat template: replies stream, the conversation is "
                   "kept, /reset forgets it, /exit or Ctrl-D leaves, Ctrl-C stops a reply (not the program).")
    c.add_argument("model", help="Hugging Face folder, .gguf file, or smollm2-135m-instruct")
    add_engine_args(c)
    c.add_argument("--system", default=None, help="system prompt (default: none)")
    c.add_argument("--max-tokens", type=int, default=512, help="most tokens in one reply")
    c.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the model's recommendation, as the chat UI starts from, else 0.7)")
    c.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling mass, in (0, 1] (default: the model's recommendation, else 0.95)")
    c.add_argument("--top-k", type=int, default=None,
                   help="keep the k most likely tokens; -1 = all (default: the model's recommendation, else 50)")
    c.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    """Load the model and chat on stdin/stdout until /exit or end of input; returns the exit code."""
    from lightinfer.llm import LLM

    given = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k))
             if v is not None}
    SamplingParams(max_tokens=args.max_tokens, seed=args.seed, **given)  # bad settings fail before the model loads
    print(f"lightinfer: loading {args.model} ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    llm = LLM(args.model, **engine_kwargs(args))
    engine = llm.llm_engine
    # the settings not given: the model's recommendation where it has one (SmolLM2's card: 0.2 / 0.9; at
    # 0.7 it answers simple questions in French nonsense), as the chat UI starts from
    params = chat_sampling(engine.checkpoint.sampling_defaults(), given, args.max_tokens, args.seed)
    if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
        raise ValueError(f"{args.model} has no tokenizer with a chat template, so it cannot chat; use "
                         f"`lightinfer generate {args.model} --prompt TEXT` for plain completions")
    print(f"lightinfer: ready in {time.monotonic() - t0:.1f} s. Type a message; /help lists the commands.",
          file=sys.stderr, flush=True)
    return ChatSession(engine, params, system=args.system or "").run()


class ChatSession:
    """One terminal conversation with an engine (``LLMEngine`` or anything with its interface).

    Args:
        engine: the engine; this session is its only user.
        params: sampling settings of every reply (``max_tokens`` is lowered when the context is short).
        system: the system prompt ("" for none).
    """

    def __init__(self, engine: Any, params: SamplingParams, system: str = "") -> None:
        self.engine = engine
        self.params = params
        self.system = system
        self.turns: list[dict[str, str]] = []
        self._stop = threading.Event()
        self._count = 0

    def run(self, read: Callable[[str], str] | None = None, out: TextIO | None = None) -> int:
        """Prompt, read (default ``input``), reply, until /exit or end of input. Returns 0."""
        read, out = read or input, out or sys.stdout
        while True:
            try:
                line = read(PROMPT)
            except EOFError:
                out.write("\n")
                return 0
            except KeyboardInterrupt:  # at the prompt: nothing to stop
                out.write("\n(Ctrl-C stops a reply; /exit or Ctrl-D leaves)\n")
                continue
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                command = text.split()[0].lower()
                if command in ("/exit", "/bye", "/quit"):
                    return 0
                if command in ("/reset", "/clear"):
                    self.turns = []
                    out.write("(the conversation is forgotten)\n")
                elif command in ("/help", "/?"):
                    out.write(HELP + "\n")
                else:
                    out.write(f"unknown command {command}; /help lists them\n")
                continue
            self.reply(line, out)

    def reply(self, message: str, out: TextIO) -> str:
        """Stream the reply to ``message`` to ``out`` and keep both in the history; returns the reply's text
        (partial when Ctrl-C stopped it). A message the model cannot take is reported, not raised."""
        from lightinfer.inputs import fit_context

        inputs = self.engine.input_processor
        turns = [*self.turns, {"role": "user", "content": message}]
        try:
            prompt, dropped, max_new = fit_context(inputs.tokenizer, self.system, turns, inputs.max_model_len,
                                                   self.params.max_tokens)
            request = inputs.process(prompt, replace(self.params, max_tokens=max_new))
        except ValueError as exc:
            out.write(f"error: {exc}\n")
            return ""
        if dropped:
            out.write(f"(the conversation is longer than the context: the {dropped} oldest messages are left out)\n")
        self._count += 1
        rid = f"chat-{self._count}"
        text, stopped = "", False
        self.engine.add_request(rid, request)
        previous = self._catch_sigint()
        try:
            while self.engine.has_unfinished_requests():
                if self._stop.is_set():
                    stopped = True
                    break
                for output in self.engine.step():
                    if output.request_id != rid:
                        continue
                    new = output.outputs[0].text
                    out.write(new[len(text):])
                    out.flush()
                    text = new
        finally:
            self.engine.abort_request(rid)  # stopped (or failed): free its KV blocks now
            self._restore_sigint(previous)
        out.write("\n[stopped]\n" if stopped else "\n")
        self.turns = [*turns[dropped:], {"role": "assistant", "content": text}]  # dropped ones stay out
        return text

    # ------------------------------------------------------------------ Ctrl-C during a reply
    def _catch_sigint(self) -> Any:
        self._stop.clear()
        if threading.current_thread() is not threading.main_thread():
            return None  # signals go to the main thread only; a caller elsewhere stops with .stop()
        return signal.signal(signal.SIGINT, lambda *_: self._stop.set())

    def _restore_sigint(self, previous: Any) -> None:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)

    def stop(self) -> None:
        """Stop the reply in progress (what Ctrl-C does), from any thread."""
        self._stop.set()
