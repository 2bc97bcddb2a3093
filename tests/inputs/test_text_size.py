"""The cheap length check (issue 19 item 4): a text that cannot fit the context whatever its tokenization is
refused from its length in characters, before the tokenizer or the chat template ever sees it; a text that
might fit is never refused by it."""

from __future__ import annotations

import pytest

from lightinfer.inputs import InputError, InputProcessor
from lightinfer.inputs.text import NORMALIZER_SLACK, longest_token_chars
from lightinfer.sampling_params import SamplingParams
from tests.serving.serving_fakes import FakeTokenizer

MAX_LEN = 64


class CountingTokenizer(FakeTokenizer):
    """The fake byte-level tokenizer, counting how often it is asked to encode."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return super().encode(text, add_special_tokens)


def test_longest_token_bounds_characters_per_token() -> None:
    assert longest_token_chars(FakeTokenizer()) == len("<|im_start|>")  # bytes are 1 character, markers 12

    class Normalizing(FakeTokenizer):
        class backend_tokenizer:  # transformers names the attribute so
            normalizer = object()

    assert longest_token_chars(Normalizing()) == 12 * NORMALIZER_SLACK
    assert longest_token_chars(object()) is None  # no vocabulary: no bound, nothing refused by length


def test_far_too_long_text_is_refused_before_tokenizing() -> None:
    tok = CountingTokenizer()
    inputs = InputProcessor(tok, 258, MAX_LEN)
    limit = 12 * MAX_LEN  # at least limit / 12 = MAX_LEN tokens: cannot leave room for one more
    with pytest.raises(InputError, match=f"'prompt' holds {limit:,} characters") as err:
        inputs.tokenize("x" * limit)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
    with pytest.raises(InputError, match="'messages' holds"):
        inputs.render_chat([{"role": "system", "content": "s" * (limit // 2)},
                            {"role": "user", "content": [{"type": "text", "text": "u" * (limit // 2)}]}])
    assert tok.calls == 0
    # One character less might still fit (e.g. 12-character tokens only): it goes on to the tokenizer,
    # whose exact count decides.
    with pytest.raises(InputError, match="the prompt has 767 tokens"):
        inputs.process("x" * (limit - 1), SamplingParams())
    assert tok.calls == 1


def test_the_bound_survives_copy_and_is_computed_once() -> None:
    inputs = InputProcessor(FakeTokenizer(), 258, MAX_LEN)
    other = inputs.copy()
    assert other.max_token_chars == inputs.max_token_chars == 12
    assert InputProcessor(None, 258, MAX_LEN).max_token_chars is None
    InputProcessor(None, 258, MAX_LEN).check_text_size(10**9)  # no tokenizer: no bound to apply
