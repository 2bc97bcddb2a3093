"""Incremental detokenization that never splits a UTF-8 character and holds back stop strings."""

from __future__ import annotations

# Prompt tokens decoded in front of the output: SentencePiece tokenizers drop a word's leading
# space when it is decoded alone, so each piece is decoded with a little left context.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns one completion's token ids into text, a piece at a time.

    With a fast (Rust ``tokenizers``) tokenizer this is the library's own ``DecodeStream``,
    primed with the last prompt tokens so that a first word keeps its leading space (~1 us per
    token). Otherwise the prefix/read-offset scheme (as in Hugging Face TGI / vLLM's slow path):
    decode the tokens since ``prefix_offset`` and emit only what extends the text of
    ``[prefix_offset, read_offset)`` (two full ``decode`` calls per token, ~6 us). Either way a
    token that leaves an incomplete UTF-8 character waits for the next one.

    Attributes:
        text: the output text so far (full, before stop-string trimming).
    """

    def __init__(self, tokenizer: object | None, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self._stream, self._backend = _decode_stream(tokenizer, self.tokens, skip_special_tokens)
        self._pending: list[int] = []  # DecodeStream: ids not yet turned into text

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:  # an engine without a tokenizer: ids only, no text
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Append one generated id; returns the new text (possibly empty)."""
        if self._stream is not None:
            piece = self._stream.step(self._backend, token_id)
            if piece is None:
                self._pending.append(token_id)
                return ""
            self._pending.clear()
            self.text += piece
            return piece
        self.tokens.append(token_id)
        prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            piece = new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            self.text += piece
            return piece
        return ""

    def flush(self) -> str:
        """At the end: whatever is still pending (an incomplete character is emitted as is)."""
        if self._stream is not None:
            piece = self._decode(self._pending) if self._pending else ""
            self._pending.clear()
            self.text += piece
            return piece
        prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset:])
        piece = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.text += piece
        return piece


def _decode_stream(tokenizer: object | None, context: list[int], skip_special_tokens: bool) -> tuple[object, object]:
    """``(DecodeStream primed with context, backend tokenizer)`` for a fast tokenizer whose
    ``decode`` is the backend's (no clean-up pass); ``(None, None)`` otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None, None
    try:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens), backend
    except (ImportError, TypeError):  # tokenizers < 0.22: no DecodeStream, or no priming ids
        return None, None


def find_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string in ``text[search_from:]``: ``(index, stop)`` or None."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, search_from))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def stop_holdback(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that could still grow into a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold
