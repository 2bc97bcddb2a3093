"""RoPE parameters read from a transformers config, and the frequency scalings of long-context models.

One :class:`RopeSpec` per attention layer type says how positions become rotation angles: the base
``theta``, how many of the head's dimensions rotate (``rotary_dim``: Phi-4-mini rotates 3/4 of them),
and a scaling of the frequencies (``rope_type``):

==========  ==================================================================================  ==========================
rope_type   inverse frequencies (``inv = theta ** (-2i / R)``, i < R / 2)                         cos/sin multiplied by
==========  ==================================================================================  ==========================
default     ``inv``                                                                             1
linear      ``inv / factor`` (position interpolation)                                           1
dynamic     NTK: ``theta' = theta * (factor * L / mpe - (factor - 1)) ** (R / (R - 2))`` for     1
            sequences of ``L > mpe`` tokens, ``inv`` below
yarn        a per-frequency blend of ``inv`` and ``inv / factor`` (ramp between beta_fast and   ``0.1 ln(factor) + 1``
            beta_slow rotations over the original length)                                       (or attention_factor)
longrope    ``inv / short_factor[i]`` or ``inv / long_factor[i]``                               ``sqrt(1 + ln f / ln L0)``
llama3      low frequencies ``/ factor``, high kept, a smooth ramp between                      1
==========  ==================================================================================  ==========================

(mpe = ``max_position_embeddings``, L0 = ``original_max_position_embeddings``.) The formulas are those of
the papers (Chen et al. 2023; bloc97 2023; Peng et al. 2023 "YaRN"; Ding et al. 2024 "LongRoPE"; Meta's
Llama 3.1) as transformers implements them (``modeling_rope_utils``); the tests hold every type to it.

Two types depend on the sequence length in transformers, which a paged, prefix-cached engine cannot follow
(a cached block's keys must not change with the request that reuses them). Like vLLM, lightinfer fixes the
choice once per engine, from ``max_model_len``:

* ``longrope``: the long factors when ``max_model_len > L0`` (transformers uses them for any sequence
  longer than L0, so the two agree on such sequences), the short ones otherwise (agreeing on every sequence);
* ``dynamic``: plain frequencies when ``max_model_len <= mpe`` (exactly transformers' on every sequence), else
  the NTK base of a ``max_model_len``-token sequence (transformers' for a sequence of that length).

The longest sequence a config allows (:func:`rope_max_positions`, what ``max_model_len`` defaults to and is
checked against) is the config's own: ``mpe`` for default, llama3 and longrope (whose configs already give
the extended length), ``mpe * factor`` for linear and dynamic, ``L0 * factor`` for yarn (vLLM's rule; like
vLLM, Gemma 3's ``mpe``, 128k, is taken as it is: its global layers' linear x8 is already counted in it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Older spellings transformers still reads.
_ALIASES = {"su": "longrope", "ntk": "dynamic"}


@dataclass(frozen=True)
class RopeSpec:
    """How one layer type's positions become rotation angles (module docstring).

    Attributes:
        theta: the base.
        rope_type: one of :data:`ROPE_TYPES`.
        params: the scaling's own fields (``factor``, ``short_factor``, ...), empty for default.
        head_dim: the attention head size; rotary_dim: how many leading dims of each head rotate (even).
        max_position_embeddings: the config's ``max_position_embeddings``.
        scaled_max_position: ``max_position_embeddings`` already counts the scaling (Gemma 3).
    """

    theta: float
    rope_type: str
    head_dim: int
    rotary_dim: int
    max_position_embeddings: int
    params: dict = field(default_factory=dict)
    scaled_max_position: bool = False

    @property
    def original_max_position(self) -> int:
        """``original_max_position_embeddings`` (the pretraining length), else ``max_position_embeddings``."""
        return int(self.params.get("original_max_position_embeddings") or self.max_position_embeddings)

    def max_positions(self) -> int:
        """The longest sequence this RoPE is meant for (module docstring)."""
        factor = float(self.params.get("factor") or 1.0)
        if self.scaled_max_position:
            return self.max_position_embeddings
        if self.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * factor)
        if self.rope_type == "yarn":
            return int(self.original_max_position * factor)
        return self.max_position_embeddings


def _layer_params(hf_config: object, layer_type: str | None) -> tuple[dict, dict]:
    """``(params, legacy)``: the config's RoPE dict for ``layer_type`` (transformers >= 5 nests one per layer
    type for Gemma 3) and the pre-5 fields as a dict."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) or v is None for v in params.values()):  # nested per layer type
        params = params.get(layer_type or "full_attention") or {}
    legacy = dict(getattr(hf_config, "rope_scaling", None) or {})
    return dict(params), legacy


def rope_spec(hf_config: object, layer_type: str | None = None) -> RopeSpec:
    """The :class:`RopeSpec` of ``hf_config`` (of its ``layer_type`` layers: ``"sliding_attention"`` or
    ``"full_attention"`` where they differ, as in Gemma 3).

    Raises:
        ValueError: a RoPE type lightinfer does not know (the message lists those it does), or a scaling
            without the fields its type needs.
    """
    c = hf_config
    params, legacy = _layer_params(c, layer_type)
    if not params.get("rope_type") and not params.get("type"):
        params = {**params, **legacy}
    kind = str(params.get("rope_type", params.get("type", "default")) or "default")
    kind = _ALIASES.get(kind, kind)
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope scaling type {kind!r} (rope_scaling / rope_parameters in config.json) is not "
                         f"supported; lightinfer runs: {', '.join(ROPE_TYPES)}")
    theta = params.get("rope_theta")
    if theta is None and layer_type == "sliding_attention":
        theta = getattr(c, "rope_local_base_freq", None)
    if theta is None:
        theta = getattr(c, "rope_theta", None) or 10000.0
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    partial = params.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None)) or 1.0
    rotary_dim = int(head_dim * float(partial))
    rotary_dim -= rotary_dim % 2
    mpe = int(getattr(c, "max_position_embeddings", 0) or 8192)
    extra = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")}
    if kind in ("yarn", "longrope", "llama3") and "original_max_position_embeddings" not in extra:
        original = getattr(c, "original_max_position_embeddings", None)
        extra["original_max_position_embeddings"] = int(original) if original else mpe
    required = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                "longrope": ("short_factor", "long_factor"), "llama3": ("factor",)}.get(kind, ())
    missing = [k for k in required if extra.get(k) is None]
    if missing:
        raise ValueError(f"rope scaling {kind!r} needs {', '.join(missing)} in rope_scaling / rope_parameters")
    if kind == "longrope":
        for name in ("short_factor", "long_factor"):
            if len(extra[name]) != rotary_dim // 2:
                raise ValueError(f"rope scaling 'longrope': {name} has {len(extra[name])} entries, the rotary "
                                 f"dimension {rotary_dim} needs {rotary_dim // 2}")
    scaled = "gemma3" in str(getattr(c, "model_type", ""))
    return RopeSpec(float(theta), kind, int(head_dim), rotary_dim, mpe, extra, scaled)


def layer_types_of(hf_config: object) -> list[str]:
    """Each layer's type, ``"full_attention"`` or ``"sliding_attention"`` (transformers' ``layer_types``;
    configs without it: every layer sliding when a ``sliding_window`` is set, as Mistral's and Phi-3's)."""
    n = int(hf_config.num_hidden_layers)
    types = getattr(hf_config, "layer_types", None)
    if types:
        return [str(t) for t in types[:n]]
    sliding = getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", True)
    return ["sliding_attention" if sliding else "full_attention"] * n


def rope_max_positions(hf_config: object) -> int:
    """The longest sequence the config supports (the largest over its layer types; module docstring).

    Raises:
        ValueError: as :func:`rope_spec`.
    """
    return max(rope_spec(hf_config, t).max_positions() for t in sorted(set(layer_types_of(hf_config))))


# ----------------------------------------------------------------------------- frequencies


def _base_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _llama3(inv: torch.Tensor, p: dict) -> torch.Tensor:
    factor = float(p["factor"])
    low, high = float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
    old_len = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_mid, mid, scaled)


def _yarn(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    p, dim, base = spec.params, spec.rotary_dim, spec.theta
    original = spec.original_max_position
    factor = float(p.get("factor") or spec.max_position_embeddings / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = _base_inv_freq(base, dim)
    keep = 1 - ramp  # 1: the original frequency (high frequencies), 0: interpolated by `factor`
    return extrapolated / factor * (1 - keep) + extrapolated * keep, float(attention)


def _longrope(spec: RopeSpec, long: bool) -> tuple[torch.Tensor, float]:
    p = spec.params
    original = spec.original_max_position
    factor = float(p.get("factor") or spec.max_position_embeddings / original)
    attention = p.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(p["long_factor" if long else "short_factor"], dtype=torch.float32)
    shape = torch.arange(0, spec.rotary_dim, 2, dtype=torch.int64).float() / spec.rotary_dim
    return 1.0 / (ext * spec.theta**shape), float(attention)


def inv_freq_and_scale(spec: RopeSpec, max_model_len: int | None = None) -> tuple[torch.Tensor, float]:
    """``(inverse frequencies fp32 [rotary_dim // 2], cos/sin multiplier)`` for an engine whose longest
    sequence is ``max_model_len`` (None: the choice transformers makes for sequences within the original
    length; module docstring)."""
    inv = _base_inv_freq(spec.theta, spec.rotary_dim)
    p, kind = spec.params, spec.rope_type
    if kind == "linear":
        return inv / float(p["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv, p), 1.0
    if kind == "yarn":
        return _yarn(spec)
    if kind == "longrope":
        return _longrope(spec, long=max_model_len is not None and max_model_len > spec.original_max_position)
    if kind == "dynamic" and max_model_len is not None and max_model_len > spec.max_position_embeddings:
        factor, mpe, dim = float(p["factor"]), spec.max_position_embeddings, spec.rotary_dim
        base = spec.theta * (factor * max_model_len / mpe - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    return inv, 1.0
