"""InputProcessor: prompts and settings -> checked EngineRequests (fake byte-level tokenizer, no model)."""

from __future__ import annotations

import threading

import pytest

from lightinfer.inputs import EngineRequest, InputError, InputProcessor, TokenizedPrompt
from lightinfer.sampling_params import SamplingParams
from tests.serving.serving_fakes import FakeTokenizer

VOCAB, MAX_LEN = 258, 64


@pytest.fixture
def inputs() -> InputProcessor:
    return InputProcessor(FakeTokenizer(), VOCAB, MAX_LEN)


def test_every_prompt_form_gives_text_and_ids(inputs: InputProcessor) -> None:
    text = inputs.tokenize("hello")
    assert text == TokenizedPrompt("hello", list(b"hello"))
    assert inputs.tokenize(list(b"hi")) == TokenizedPrompt("hi", list(b"hi"))  # ids: decoded for the text
    assert inputs.tokenize({"prompt": "hello"}) == text
    assert inputs.tokenize({"prompt_token_ids": list(b"hi")}).prompt_token_ids == list(b"hi")
    chat = inputs.render_chat([{"role": "user", "content": "hi"}])
    assert inputs.tokenize(chat) is chat  # already tokenized: taken as it is
    assert InputProcessor(None, VOCAB, MAX_LEN).tokenize([1, 2]) == TokenizedPrompt("", [1, 2])


@pytest.mark.parametrize("prompt, needle", [
    ("", "the prompt is empty"),
    ([], "the prompt is empty"),
    (5, "a prompt is a string, a list of token ids"),
    ({"text": "x"}, r"'prompt' \(text\) or 'prompt_token_ids'.*\['text'\]"),
    ("a\ud800", "the prompt is not valid Unicode text"),
    ([1, VOCAB], f"token id {VOCAB} is outside the vocabulary \\[0, {VOCAB}\\)"),
    ([1, -1], "token id -1 is outside"),
    ([1, "2"], "token id '2' is outside"),
    (TokenizedPrompt("x", [VOCAB + 5]), f"token id {VOCAB + 5} is outside"),
])
def test_bad_prompts(inputs: InputProcessor, prompt, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        inputs.tokenize(prompt)


def test_text_needs_a_tokenizer() -> None:
    with pytest.raises(ValueError, match="no tokenizer.*token-id lists"):
        InputProcessor(None, VOCAB, MAX_LEN).tokenize("hello")


def test_process_checks_settings_then_prompt_and_the_context(inputs: InputProcessor) -> None:
    params = SamplingParams(max_tokens=4)
    request = inputs.process("hello", params)
    assert request == EngineRequest("hello", list(b"hello"), params)
    with pytest.raises(InputError, match="the prompt has 64 tokens but max_model_len is 64") as e:
        inputs.process("x" * MAX_LEN, params)
    assert e.value.code == "context_length_exceeded"
    assert inputs.process("x" * (MAX_LEN - 1), params).prompt_token_ids == list(b"x" * (MAX_LEN - 1))
    with pytest.raises(ValueError, match=r"stop_token_ids \[300\] are outside the vocabulary"):
        inputs.process("hello", SamplingParams(stop_token_ids=[300]))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        InputProcessor(None, VOCAB, MAX_LEN).process([1, 2], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        inputs.process("hello", {"max_tokens": 2})
    changed = SamplingParams()
    changed.max_tokens = 0  # a dataclass can be changed after its checks ran
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        inputs.process("hello", changed)


def test_context_room_as_openai_counts_it(inputs: InputProcessor) -> None:
    assert inputs.check_context(60, None) == 4 and inputs.check_context(60, 4) == 4
    with pytest.raises(InputError, match=r"maximum context length is 64 tokens; you requested 65 tokens \(60 in "
                                         r"the prompt, 5 for the completion\)") as e:
        inputs.check_context(60, 5, "messages")
    assert (e.value.param, e.value.code) == ("messages", "context_length_exceeded")
    with pytest.raises(InputError, match="maximum context length"):
        inputs.check_context(64, None)


def test_copy_has_its_own_tokenizer(inputs: InputProcessor) -> None:
    """Front ends on other threads work on a copy: HF fast tokenizers are not safe to share."""
    other = inputs.copy()
    assert other.tokenizer is not inputs.tokenizer
    assert (other.vocab_size, other.max_model_len) == (VOCAB, MAX_LEN)
    results = []
    thread = threading.Thread(target=lambda: results.append(other.process("hi", SamplingParams())))
    thread.start()
    thread.join()
    assert results[0].prompt_token_ids == list(b"hi")
