"""Incremental detokenization: the DecodeStream path and the offset path give decode()'s text."""

from __future__ import annotations

from lightinfer.engine.detokenizer import IncrementalDetokenizer
from tests.conftest import requires_smollm2, write_tiny_checkpoint

TEXTS = [" Paris, France.", "Paris", "\n\nHello 我很感谢你的热情 🎉!", "  two  spaces\tand a tab", "naïve café 😀😀",
         "<|im_end|> after a special token"]


def _check(tokenizer: object, prompt: str) -> None:
    context = tokenizer.encode(prompt, add_special_tokens=False)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for skip in (True, False):
            fast = IncrementalDetokenizer(tokenizer, context, skip)
            slow = IncrementalDetokenizer(tokenizer, context, skip)
            slow._stream = None  # force the offset path
            pieces = [fast.add_token(t) for t in ids] + [fast.flush()]
            slow_pieces = [slow.add_token(t) for t in ids] + [slow.flush()]
            want = tokenizer.decode(ids, skip_special_tokens=skip)
            assert "".join(pieces) == fast.text == want, (text, skip)
            assert "".join(slow_pieces) == slow.text == want, (text, skip)
            assert all("\ufffd" not in p for p in pieces)


@requires_smollm2
def test_smollm2_tokenizer_streams_exactly() -> None:
    from lightinfer.loader import Checkpoint

    tok = Checkpoint("smollm2-135m-instruct").load_tokenizer()
    assert IncrementalDetokenizer(tok, [1, 2])._stream is not None  # the fast path is the one in use
    _check(tok, "The capital of France is")


def test_byte_level_tokenizer_streams_exactly(tmp_path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(write_tiny_checkpoint(tmp_path / "m"))
    _check(tok, "ab")


def test_incomplete_character_at_the_end_is_flushed(tmp_path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(write_tiny_checkpoint(tmp_path / "m"))
    ids = tok.encode("é", add_special_tokens=False)  # two byte tokens
    assert len(ids) == 2
    d = IncrementalDetokenizer(tok, [], True)
    assert d.add_token(ids[0]) == ""  # half a character waits
    assert d.flush() == tok.decode(ids[:1])  # the end comes: emitted as is
    assert d.text.endswith("\ufffd")
