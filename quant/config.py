"""QuantConfig: the settings of one offline quantization run, validated on construction.

The settings travel with the checkpoint as its ``config.json``'s ``quantization_config``
(:meth:`QuantConfig.to_hf_dict`), the AutoAWQ "gemm" block that vLLM, TGI and transformers
read (see ``../shared/DESIGN.md``, "Formats"); they are never encoded in a file name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GROUP_SIZES = (128, 64, 32)  # tried in this order when group_size is "auto"
METHODS = ("awq", "rtn")
# Checkpoint formats ``quantize`` writes; the first is the default (lightinfer/formats/ct_writer.py says why).
FORMATS = ("compressed-tensors", "awq")
SUPPORTED_W_BITS = (4,)


def _parse_group_size(value: int | str) -> int | str:
    """``"auto"`` stays ``"auto"``; ``"64"`` / ``64`` -> 64; anything else -> ValueError."""
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"group_size must be 'auto' or one of {GROUP_SIZES}, got {value!r}") from None
    if isinstance(value, bool) or value not in GROUP_SIZES:
        raise ValueError(
            f"group_size {value!r} is not supported: use 'auto' or one of {', '.join(map(str, GROUP_SIZES))} "
            "(the group sizes the W4A16 kernels and the AutoAWQ format support)"
        )
    return value


@dataclass
class QuantConfig:
    """How to quantize a model.

    Attributes:
        w_bit: weight bits; only 4 (W4A16).
        group_size: input channels sharing one scale and zero: "auto" (the largest of
            128 / 64 / 32 that divides every quantized layer's ``in_features``) or 128, 64, 32.
        zero_point: asymmetric quantization with an integer zero point; must be True (the
            AutoAWQ "gemm" format stores zeros).
        method: "awq" (activation-aware scale + clip search, Lin et al., MLSys 2024) or
            "rtn" (round to nearest, the baseline).
        calib: calibration text: None for the built-in English prose of the Python docs
            (``pydoc_data.topics``), or a path to a ``.txt`` / ``.jsonl`` (field ``text``).
        num_samples: calibration sequences (AWQ only).
        seq_len: tokens per calibration sequence.
        modules_to_not_convert: name fragments of linears left in full precision.
        n_grid: points of the scale-exponent grid and of the clip-ratio grid.
        max_shrink: the clip search tries ranges shrunk by up to this fraction.
        device: compute device of the layer-by-layer search: "auto", "cpu", "cuda[:i]".
        format: the checkpoint written: "compressed-tensors" (``pack-quantized``, asymmetric int4:
            llm-compressor's format, which vLLM and SGLang load natively and transformers through the
            maintained ``compressed-tensors`` package; the default) or "awq" (AutoAWQ "gemm": for
            readers of AWQ only, e.g. TGI; AutoAWQ itself is archived). The same numbers either way.

    Raises:
        ValueError: naming the bad value and what is allowed.
    """

    w_bit: int = 4
    group_size: int | str = "auto"
    zero_point: bool = True
    method: str = "awq"
    calib: str | None = None
    num_samples: int = 16
    seq_len: int = 512
    modules_to_not_convert: list[str] = field(default_factory=lambda: ["lm_head"])
    n_grid: int = 20
    max_shrink: float = 0.5
    device: str = "auto"
    format: str = FORMATS[0]

    def __post_init__(self) -> None:
        if isinstance(self.w_bit, bool) or self.w_bit not in SUPPORTED_W_BITS:
            raise ValueError(
                f"w_bit {self.w_bit!r} is not supported: only 4-bit weights (W4A16, the AutoAWQ gemm format)"
            )
        self.group_size = _parse_group_size(self.group_size)
        if self.zero_point is not True:
            raise ValueError("zero_point must be True: the AutoAWQ gemm format stores asymmetric zero points")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.num_samples, int) or self.num_samples < 1:
            raise ValueError(f"num_samples must be an integer >= 1, got {self.num_samples!r}")
        if not isinstance(self.seq_len, int) or not 16 <= self.seq_len <= 32768:
            raise ValueError(f"seq_len must be an integer in [16, 32768], got {self.seq_len!r}")
        if not isinstance(self.n_grid, int) or not 2 <= self.n_grid <= 200:
            raise ValueError(f"n_grid must be an integer in [2, 200], got {self.n_grid!r}")
        if not 0.0 <= self.max_shrink < 1.0:
            raise ValueError(f"max_shrink must be in [0, 1), got {self.max_shrink!r}")
        if isinstance(self.modules_to_not_convert, str):
            self.modules_to_not_convert = [self.modules_to_not_convert]
        self.modules_to_not_convert = list(self.modules_to_not_convert or [])

    def skips(self, name: str) -> bool:
        """True when the linear ``name`` (e.g. ``lm_head``, ``mlp.down_proj``) stays in full precision:
        an entry equal to the name, to one of its dotted parts, or to a dotted prefix or suffix of it
        (the rule the engine's loader applies to ``modules_to_not_convert``)."""
        parts = name.split(".")
        return any(m == name or m in parts or name.startswith(m + ".") or name.endswith("." + m)
                   for m in self.modules_to_not_convert)

    def resolve_group_size(self, in_features: dict[str, int]) -> tuple[int, str]:
        """Pick the group size for layers with these ``in_features`` (name -> K).

        Returns:
            ``(group_size, reason)``, the reason a sentence for the summary.
        Raises:
            ValueError: the chosen size does not divide some layer's K (naming the layer and the
                sizes that would work), or no supported size divides every layer.
        """
        def working(sizes: tuple[int, ...]) -> list[int]:
            return [g for g in sizes if all(k % g == 0 for k in in_features.values())]

        ok = working(GROUP_SIZES)
        if self.group_size != "auto":
            g = int(self.group_size)
            bad = [(n, k) for n, k in in_features.items() if k % g]
            if bad:
                name, k = bad[0]
                hint = f"group sizes that would work: {', '.join(map(str, ok))}" if ok else "no supported size works"
                raise ValueError(
                    f"--group-size {g} does not divide in_features={k} of layer {name!r} "
                    f"({len(bad)} layer(s) affected); {hint}"
                )
            return g, f"group size {g} chosen by the user"
        if not ok:
            name, k = min(in_features.items(), key=lambda kv: kv[1] % 32 == 0)
            raise ValueError(
                f"no supported group size ({GROUP_SIZES}) divides in_features={k} of layer {name!r}; "
                "this model cannot be stored in the AutoAWQ gemm format"
            )
        g = ok[0]
        if g == GROUP_SIZES[0]:
            return g, f"group size {g}: the default, it divides every quantized layer's in_features"
        skipped = [s for s in GROUP_SIZES if s > g]
        offenders = sorted({k for k in in_features.values() if any(k % s for s in skipped)})
        return g, (
            f"group size {g}: the largest of {GROUP_SIZES} dividing every quantized layer's in_features "
            f"({', '.join(map(str, skipped))} does not divide in_features {offenders})"
        )

    def to_hf_dict(self, group_size: int) -> dict[str, Any]:
        """The ``quantization_config`` block of ``config.json`` (AutoAWQ gemm), for a resolved group size."""
        return {
            "quant_method": "awq",
            "bits": self.w_bit,
            "group_size": int(group_size),
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": list(self.modules_to_not_convert) or None,
        }
