"""``speculative_config``: which drafts an engine proposes and how many, as vLLM spells it.

Given as a :class:`SpeculativeConfig`, a dict, a JSON string or the path of a JSON file (``lightinfer serve
--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'``, ``LLM(speculative_config={...})``)::

    method                   "ngram": prompt lookup, the continuation of the longest recent match of the last
                             tokens in the sequence's own prompt and output (no model, no memory beyond an index);
                             "suffix": the most frequent continuation of the last tokens over the sequence's own
                             tokens and the recent outputs of all requests, as long as it stays likely (agent
                             loops, repeated tool calls; ``engine/spec/suffix.py``)
    num_speculative_tokens   most draft tokens verified per sequence and step (1..16); the engine drafts fewer,
                             or none, where its measured step costs say that is faster (``policy.py``)
    prompt_lookup_max        ngram: longest n-gram matched (1..16)
    prompt_lookup_min        ngram: shortest n-gram matched (1..prompt_lookup_max)
    suffix_decoding_max_tree_depth       suffix: longest context matched, in tokens (1..64)
    suffix_decoding_max_cached_requests  suffix: finished requests whose outputs are kept for matching (0..100000;
                                         0: only the request's own tokens)
    suffix_decoding_min_token_prob       suffix: a draft grows while the product of its tokens' observed
                                         frequencies stays at or above this (0..1)

Methods vLLM also names (``draft_model``, ``eagle3``, ``eagle``, ``medusa``, ``mtp``) are refused with the list of
those this engine runs.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METHODS = ("ngram", "suffix")
OTHER_METHODS = ("draft_model", "eagle3", "eagle", "medusa", "mtp")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """What the engine drafts (module docstring).

    Attributes:
        method: "ngram" or "suffix".
        num_speculative_tokens: most drafts per sequence and step.
        prompt_lookup_max / prompt_lookup_min: ngram's longest and shortest n-gram matched.
        suffix_decoding_max_tree_depth / _max_cached_requests / _min_token_prob: suffix's longest context, its
            cache of finished outputs, and the score a draft stops below.
    Raises:
        ValueError: a value out of range, naming the field and what it takes.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    suffix_decoding_max_tree_depth: int = 8
    suffix_decoding_max_cached_requests: int = 64
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            known = "not supported" if self.method in OTHER_METHODS else "unknown"
            raise ValueError(f"speculative_config.method {self.method!r} is {known}; lightinfer runs: "
                             f"{', '.join(METHODS)}")
        for name, low, high in (("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
                                ("prompt_lookup_max", 1, MAX_SPECULATIVE_TOKENS),
                                ("prompt_lookup_min", 1, self.prompt_lookup_max),
                                ("suffix_decoding_max_tree_depth", 1, 64),
                                ("suffix_decoding_max_cached_requests", 0, 100_000)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"speculative_config.{name} must be an integer in [{low}, {high}], got {value!r}")
        prob = self.suffix_decoding_min_token_prob
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            raise ValueError(f"speculative_config.suffix_decoding_min_token_prob must be a number in [0, 1], got "
                             f"{prob!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A config from what a user gives: None, a config, a dict, a JSON object's text or a JSON file's path.

        Raises:
            ValueError: not JSON, not an object, an unknown key (the message lists the known ones), or a bad
                value (see the class).
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = _read_json(value)
        if not isinstance(value, dict):
            # ValueError, not TypeError: a user's setting, reported as bad input by the CLI and the API
            raise ValueError(f"speculative_config must be a JSON object (a dict), got {type(value).__name__}")  # noqa: TRY004
        method = value.get("method", "ngram")
        if method not in METHODS:  # before the keys: a draft model's config names keys of its own
            cls(method=method)
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(known)}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        """The settings as a plain dict (``model_info()``, ``/stats``)."""
        return dataclasses.asdict(self)


EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4}'


def _read_json(text: str) -> object:
    """The JSON in ``text``: a JSON value when it starts as one, else the contents of the file it names.

    Raises:
        ValueError: invalid JSON (with the file's name where it came from one), or no such file.
    """
    text = text.strip()
    if text.startswith(("{", "[", '"')) or not text:
        source, body = "speculative_config", text
    else:
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"speculative_config: no such file: {text} (give a JSON object, e.g. {EXAMPLE}, or "
                             f"the path of a file holding one)")
        source, body = f"speculative_config file {text}", path.read_text()
    try:
        return json.loads(body)
    except json.JSONDecodeError as err:
        raise ValueError(f"{source}: not valid JSON ({err}); e.g. {EXAMPLE}") from None
