"""Tools in conversations, through real chat templates (Qwen2.5, Qwen3, Llama 3.1, Mistral Nemo) and the
fallback prompt: rendering, the history of calls and results, the parser of each format (parallel calls
included), and the errors that name the field."""

from __future__ import annotations

import json

import pytest

from lightinfer.inputs import InputError, InputProcessor, normalize_messages, render_chat
from lightinfer.inputs.tools import mistral_call_id, reasoning_mode, template_renders_tools
from lightinfer.sampling_params import SamplingParams
from lightinfer.structured import GrammarBackend, detect_tool_call_format, parse_tool_calls
from tests.fixtures.chat_models import FAMILIES, chat_tokenizer
from tests.serving.serving_fakes import FakeTokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
ASK = [{"role": "user", "content": "Weather in Paris and time in Tokyo?"}]
FORMAT = {"qwen2.5": "hermes", "qwen3": "hermes", "llama3.1": "llama3_json", "mistral": "mistral"}


def _history(ids: tuple[str, str] = ("call_aaa", "call_bbb"), calls: int = 2) -> list[dict]:
    tool_calls = [{"id": ids[0], "type": "function",
                   "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                  {"id": ids[1], "type": "function", "function": {"name": "get_time", "arguments": {"tz": "JST"}}}]
    msgs = [*ASK, {"role": "assistant", "content": None, "tool_calls": tool_calls[:calls]},
            {"role": "tool", "tool_call_id": ids[0], "content": "sunny, 21 C"}]
    if calls > 1:
        msgs.append({"role": "tool", "tool_call_id": ids[1], "content": "09:00"})
    return msgs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_real_templates_render_tools_and_are_detected(family: str) -> None:
    tok = chat_tokenizer(family)
    assert template_renders_tools(tok)
    assert detect_tool_call_format(tok.chat_template).name == FORMAT[family]
    text = render_chat(tok, ASK, tools=[WEATHER, TIME]).prompt
    assert "get_weather" in text and "get_time" in text and "Current weather of a city" in text
    plain = render_chat(tok, ASK).prompt
    assert "get_weather" not in plain


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "mistral"])
def test_history_of_calls_and_results_renders_and_parses_back(family: str) -> None:
    tok = chat_tokenizer(family)
    msgs = _history()
    text = render_chat(tok, msgs, tools=[WEATHER, TIME]).prompt
    assert "sunny, 21 C" in text and "09:00" in text
    fmt = detect_tool_call_format(tok.chat_template)
    # the assistant turn as the template wrote it is what the model emits: the parser reads both calls back
    if fmt.name == "mistral":
        turn = "[TOOL_CALLS]" + text.split("[TOOL_CALLS]", 1)[1].split("</s>")[0]
    else:
        turn = text.split("<|im_start|>assistant", 1)[1].split("<|im_end|>")[0]
    parsed = parse_tool_calls(turn, fmt)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "JST"})]
    if family == "mistral":  # its template takes only 9-character ids: ours are mapped, consistently
        assert mistral_call_id("call_aaa") in text and "call_aaa" not in text
        assert text.count(mistral_call_id("call_bbb")) == 2


def test_llama_renders_one_call_and_its_parser_reads_parallel_calls() -> None:
    tok = chat_tokenizer("llama3.1")
    text = render_chat(tok, _history(calls=1), tools=[WEATHER, TIME]).prompt
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text and "ipython" in text
    with pytest.raises(InputError, match="single tool-calls"):  # the template's own limit, as a 400
        render_chat(tok, _history(), tools=[WEATHER, TIME])
    out = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; ' \
          '{"name": "get_time", "parameters": {"tz": "JST"}}'
    parsed = parse_tool_calls(out, "llama3_json")
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "get_time"] and parsed.content is None


def test_template_without_tools_gets_the_fallback_prompt() -> None:
    tok = FakeTokenizer()  # ChatML that renders only role and content
    assert not template_renders_tools(tok)
    text = render_chat(tok, [{"role": "system", "content": "Be brief."}, *_history()], tools=[WEATHER]).prompt
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and "<tools>" in system
    assert '"name": "get_weather"' in system and "<tool_call>" in system  # the format the parser reads
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    # both results in one user turn
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\n09:00" in text


def test_message_errors_name_the_field() -> None:
    bad_id = [*ASK, {"role": "tool", "tool_call_id": "call_zzz", "content": "x"}]
    with pytest.raises(InputError, match=r"messages\[1\].tool_call_id: 'call_zzz' matches no tool call") as e:
        normalize_messages(bad_id)
    assert e.value.param == "messages[1].tool_call_id"
    with pytest.raises(InputError, match="needs the id"):
        normalize_messages([*ASK, {"role": "tool", "content": "x"}])
    broken = _history()
    broken[1]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    with pytest.raises(InputError, match=r"messages\[1\].tool_calls\[0\].function.arguments: is not valid JSON"):
        normalize_messages(broken)
    later = [*ASK, {"role": "tool", "tool_call_id": "call_aaa", "content": "x"}, *_history()[1:2]]
    with pytest.raises(InputError, match="matches no tool call"):  # a result before its call
        normalize_messages(later)


def test_reasoning_mode_from_template_and_prompt() -> None:
    qwen3 = chat_tokenizer("qwen3")
    prompt = render_chat(qwen3, ASK, tools=[WEATHER]).prompt
    assert reasoning_mode(qwen3.chat_template, prompt, None) == "optional"
    off = render_chat(qwen3, ASK, tools=[WEATHER], chat_template_kwargs={"enable_thinking": False}).prompt
    assert reasoning_mode(qwen3.chat_template, off, {"enable_thinking": False}) is None
    assert reasoning_mode("<think>", "...<|Assistant|><think>\n", None) == "open"  # R1 distills
    assert reasoning_mode(chat_tokenizer("qwen2.5").chat_template, prompt, None) is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_process_chat_builds_the_tool_grammar(family: str) -> None:
    tok = chat_tokenizer(family)
    backend = GrammarBackend(tok)
    inputs = InputProcessor(tok, 288, 4096, grammar_backend=lambda: backend)
    request, calling = inputs.process_chat(ASK, SamplingParams(max_tokens=64), tools=[WEATHER],
                                           tool_choice="required")
    assert calling is not None and calling.format.name == FORMAT[family] and calling.choice.mode == "required"
    p = request.sampling_params
    assert p.structured_outputs is calling.grammar and p.skip_special_tokens is False
    assert backend.cache_info()["size"] == 1  # compiled where the request was prepared
    none_req, none_calling = inputs.process_chat(ASK, SamplingParams(), tools=[WEATHER], tool_choice="none")
    assert none_calling is None and "get_weather" not in none_req.prompt
    with pytest.raises(InputError, match="cannot be combined") as e:
        inputs.process_chat(ASK, SamplingParams(structured_outputs={"json_object": True}), tools=[WEATHER],
                            tool_choice="required")
    assert e.value.param == "tool_choice"
    with pytest.raises(InputError, match="regex constraint cannot be combined") as e:
        inputs.process_chat(ASK, SamplingParams(structured_outputs={"regex": "a+"}), tools=[WEATHER])
    assert e.value.param == "tool_choice"
    # "auto" with a JSON response format: the answer is that JSON, or calls (tool_grammar.with_answer_format)
    both, both_calling = inputs.process_chat(ASK, SamplingParams(structured_outputs={"json_object": True}),
                                             tools=[WEATHER])
    assert both_calling is not None and "reply_json | calls" in both.sampling_params.structured_outputs.grammar
    with pytest.raises(InputError) as e:
        inputs.process_chat(ASK, SamplingParams(), tools=[WEATHER], tool_choice={"type": "function",
                                                                                 "function": {"name": "nope"}})
    assert e.value.param == "tool_choice.function.name"
    with pytest.raises(InputError) as e:
        inputs.process_chat(ASK, SamplingParams(), tools=[{"type": "code_interpreter"}])
    assert e.value.param == "tools[0].type"
