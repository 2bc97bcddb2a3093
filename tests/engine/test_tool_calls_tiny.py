"""LLM.chat with tools on tiny random-weight Qwen2 / Qwen3 / Llama / Mistral models with their real chat
templates: whatever the (random) model prefers, the grammar makes every call parse and match its tool."""

from __future__ import annotations

import json

import jsonschema
import pytest

from lightinfer import LLM, SamplingParams
from tests.fixtures.chat_models import write_chat_checkpoint

# bounded arguments: a random model would otherwise write one string until the token limit
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "JST", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "Weather in Paris and time in Tokyo?"}]
NO_THINKING = {"enable_thinking": False}  # a random model would think until the token limit


@pytest.fixture(scope="module", params=["qwen2.5", "qwen3", "llama3.1", "mistral"])
def llm(request, tmp_path_factory) -> LLM:
    path = write_chat_checkpoint(tmp_path_factory.mktemp(request.param) / "m", request.param)
    return LLM(str(path), num_kv_blocks=256, max_model_len=2048)


def _check_calls(calls: list, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.name in names and call.id
        jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])


def test_required_and_named_calls_are_valid(llm: LLM) -> None:
    """``required`` lets a model make one call or more: a random one may go on calling until the token limit
    (then no parsed calls are promised), so of six seeded answers every finished one must hold valid calls and
    end as ``tool_calls``, and at least one must finish."""
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=300) for s in range(6)]
    outs = llm.chat([ASK] * 6, params, tools=[WEATHER, TIME], tool_choice="required",
                    chat_template_kwargs=NO_THINKING, use_tqdm=False)
    finished = 0
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason in ("tool_calls", "length"), (c.finish_reason, c.text, c.token_ids)
        assert "<|im_end|>" not in c.text and "<|eot_id|>" not in c.text
        if c.finish_reason == "tool_calls":
            finished += 1
            _check_calls(c.tool_calls, {"get_weather", "get_time"})
        else:
            assert len(c.token_ids) == 300
    assert finished >= 1, [o.outputs[0].text[:80] for o in outs]
    named = llm.chat(ASK, SamplingParams(temperature=0.8, seed=7, max_tokens=300), tools=[WEATHER, TIME],
                     tool_choice={"type": "function", "function": {"name": "get_time"}},
                     chat_template_kwargs=NO_THINKING, use_tqdm=False)[0].outputs[0]
    assert len(named.tool_calls) == 1 and named.finish_reason == "tool_calls"
    _check_calls(named.tool_calls, {"get_time"})


def test_auto_is_text_or_valid_calls(llm: LLM) -> None:
    outs = llm.chat([ASK] * 2, [SamplingParams(temperature=1.0, seed=s, max_tokens=120) for s in range(2)],
                    tools=[WEATHER, TIME], chat_template_kwargs=NO_THINKING, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.tool_calls is not None
        if c.tool_calls:  # a call that started is complete and valid
            _check_calls(c.tool_calls, {"get_weather", "get_time"})
        else:
            assert c.finish_reason in ("stop", "length")


def test_multi_turn_with_results_and_no_tools_left(llm: LLM) -> None:
    first = llm.chat(ASK, SamplingParams(temperature=0.8, seed=1, max_tokens=300), tools=[WEATHER, TIME],
                     tool_choice="required", parallel_tool_calls=False, chat_template_kwargs=NO_THINKING,
                     use_tqdm=False)[0].outputs[0]
    assert len(first.tool_calls) == 1
    call = first.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": first.text or None, "tool_calls": [call.to_openai()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    final = llm.chat(history, SamplingParams(temperature=0.8, seed=2, max_tokens=8), tools=[WEATHER, TIME],
                     tool_choice="none", chat_template_kwargs=NO_THINKING, use_tqdm=False)[0].outputs[0]
    assert final.tool_calls is None and final.token_ids  # tool_choice "none": a plain reply, nothing parsed
