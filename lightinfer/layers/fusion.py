"""The fusion pass: after loading, rewire a model's linears for inference.

Models describe the network in Hugging Face terms (separate ``q_proj``/``k_proj``/``v_proj``,
``gate_proj``/``up_proj``, one module per checkpoint tensor group), because that is how
checkpoints are named and how the quantizer walks a layer. Two speed-ups need a different
wiring, and this pass applies both so that no model file has to know about them:

1. **Projection fusion.** Linears that read the same input become one linear whose output is
   the concatenation of theirs (``layers.linear.fuse_linears``): one GEMM launch instead of two
   or three, the activations read once, and no ``torch.cat`` afterwards.
2. **Split-K deferral.** A W4A16 GEMM that splits K over programs leaves fp32 partial sums that
   a reduction kernel adds up. Where the op that reads the GEMM's output loads it element by
   element anyway (the fused residual add + RMSNorm, SiLU·mul, RoPE + KV-cache write), that op
   can sum the partials as it loads them; the producer then skips the reduction launch
   (``defer_reduce``: it returns :class:`SplitKPartials`, see ``W4A16Linear.forward``).

How a model takes part: a module declares ``fusion_plan = FusionPlan(...)`` (a class attribute,
or an instance attribute when it depends on the config), naming submodules by their attribute
paths relative to that module. Two kinds of entries, both statements about the network, not
about kernels:

- ``Fuse(target, parts)``: the ``parts`` read one input. The pass sets attribute ``target`` to
  one linear computing ``cat([p(x) for p in parts], -1)`` and sets the parts to None; the
  model's forward uses ``target`` when it is not None. Parts that cannot share one GEMM (a dense
  layer next to 4-bit ones, e.g. from ``modules_to_not_convert``) are left as they are.
- ``Feeds(producer, consumer)``: the producer's output goes, unchanged, into ``consumer``.
  ``consumer`` is a submodule path, and the pass defers the producer's reduction only if that
  module's class says it takes partials (``accepts_split_k_partials = True``: ``RMSNorm`` as the
  ``x`` of its residual form ``norm(x, residual)``, ``SiluAndMul``, ``Attention`` through
  ``forward_qkv``); any other consumer is a declaration error, reported when the pass runs.
  Or ``consumer`` is :data:`RESIDUAL`: the output is the block's contribution to the residual
  stream, returned by ``forward_fused`` and added by the next block's (or the final) fused add +
  RMSNorm. Declare only edges where nothing sits between the two (no split, no norm, no scale).

Fuses run first, over the whole model, then feeds, so a ``Feeds`` may name a fused target. The
pass is idempotent. A layer that can leave partials says so by having a ``defer_reduce``
attribute (``W4A16Linear``); dense layers never do, so a dense model is only fused. A new
architecture (Gemma's pre/post norms, a MoE's experts, Phi-3's checkpoint-fused ``qkv_proj``)
writes its own small plan; a new layer that can sum partials sets the class attribute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lightinfer.kernels import SplitKPartials
from lightinfer.layers.linear import fuse_linears

RESIDUAL = "<residual stream>"
"""``Feeds`` consumer: the block returns the output for the next fused add + RMSNorm to add."""


@dataclass(frozen=True)
class Fuse:
    """Linears ``parts`` (paths) read one input; fused into one linear at attribute ``target``."""

    target: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class Feeds:
    """The output of linear ``producer`` goes, as it is, into ``consumer`` (a path or :data:`RESIDUAL`)."""

    producer: str
    consumer: str


@dataclass(frozen=True)
class FusionPlan:
    """What one module declares for :func:`fuse_model` (see the module docstring)."""

    fuse: tuple[Fuse, ...] = ()
    feeds: tuple[Feeds, ...] = ()


@dataclass
class FusionReport:
    """What :func:`fuse_model` did, by full module path (``model.layers.0.self_attn.qkv_proj``)."""

    fused: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)


def _lookup(module: nn.Module, path: str, owner: str) -> nn.Module | None:
    """The submodule at dotted ``path`` (None where an attribute on the way is None).

    Raises:
        AttributeError: a name on the path does not exist (a typo in a plan).
    """
    obj: object = module
    for name in path.split("."):
        if obj is None:
            return None
        if not hasattr(obj, name):
            kind = type(obj).__name__
            raise AttributeError(f"{owner}.fusion_plan names {path!r}, but {kind} has no {name!r}")
        obj = getattr(obj, name)
    return obj  # type: ignore[return-value]


def _set(module: nn.Module, path: str, value: nn.Module | None) -> None:
    parent, _, name = path.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, name, value)


def _plans(model: nn.Module) -> list[tuple[str, nn.Module, FusionPlan]]:
    return [(name, m, m.fusion_plan) for name, m in model.named_modules()
            if isinstance(getattr(m, "fusion_plan", None), FusionPlan)]


def _full(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix else path


def _fuse(prefix: str, module: nn.Module, plan: FusionPlan, report: FusionReport) -> None:
    owner = type(module).__name__
    for rule in plan.fuse:
        parts = [_lookup(module, p, owner) for p in rule.parts]
        if any(p is None for p in parts):  # already fused (the pass ran before)
            continue
        fused = fuse_linears(parts)
        if fused is None:  # the parts cannot share one GEMM: they stay
            continue
        _set(module, rule.target, fused)
        for p in rule.parts:
            _set(module, p, None)
        report.fused.append(_full(prefix, rule.target))


def _check_consumer(module: nn.Module, edge: Feeds) -> None:
    """Raises TypeError unless ``edge.consumer`` exists and takes split-K partials."""
    if edge.consumer == RESIDUAL:
        return
    owner = type(module).__name__
    consumer = _lookup(module, edge.consumer, owner)
    where = f"{owner}.fusion_plan: {edge.producer!r} feeds {edge.consumer!r}"
    if consumer is None:
        raise TypeError(f"{where}, which is None")
    kind = type(consumer).__name__
    if not getattr(type(consumer), "accepts_split_k_partials", False):
        raise TypeError(f"{where}, but {kind} does not take split-K partials; drop that Feeds entry "
                        f"(or give {kind} accepts_split_k_partials = True if it sums them)")


def _defer(prefix: str, module: nn.Module, plan: FusionPlan, report: FusionReport) -> None:
    for edge in plan.feeds:
        producer = _lookup(module, edge.producer, type(module).__name__)
        _check_consumer(module, edge)
        if producer is None or not hasattr(producer, "defer_reduce"):  # unfused, or a dense layer
            continue
        producer.defer_reduce = True
        report.deferred.append(_full(prefix, edge.producer))


@torch.no_grad()
def fuse_model(model: nn.Module) -> FusionReport:
    """Apply every ``fusion_plan`` in ``model``, in place (after the weights are loaded; the
    Hugging Face names of fused parts no longer exist afterwards).

    Returns:
        :class:`FusionReport` with the fused targets and the deferred producers.
    Raises:
        AttributeError: a plan names a submodule that does not exist.
        TypeError: a ``Feeds`` consumer whose class does not take split-K partials.
    """
    report = FusionReport()
    plans = _plans(model)
    for prefix, module, plan in plans:
        _fuse(prefix, module, plan, report)
    for prefix, module, plan in plans:  # after every fuse: a Feeds may name a fused target
        _defer(prefix, module, plan, report)
    return report


def materialize(y: torch.Tensor | SplitKPartials) -> torch.Tensor:
    """``y`` as a tensor: split-K partials a producer left for its consumer, summed (for a
    block called on its own, outside the model loop whose next norm would sum them)."""
    return y.reduced() if isinstance(y, SplitKPartials) else y
