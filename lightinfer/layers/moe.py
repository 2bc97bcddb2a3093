"""Mixture-of-experts layers: the router (``Router``, ``select_experts``) and the stacked experts (``FusedMoE``).

A MoE feed-forward block replaces one dense MLP by E expert MLPs and a router that sends each token to
``top_k`` of them, weighting their outputs (Shazeer et al. 2017; Mixtral, Qwen-MoE). The experts' weights
are stored stacked, ``[E, ...]`` per projection (``lightinfer.kernels.moe``), in one of two layouts:

* dense: ``w13_weight [E, 2 I, H]`` (each expert's gate rows, then its up rows) and ``w2_weight [E, H, I]``;
* W4: the W4 run-time layout of each expert stacked, ``w13_qweight [E, 2 I, H // 8]``, ``w13_scales`` /
  ``w13_zeros [E, H // G, 2 I]``, ``w2_qweight [E, H, I // 8]``, ``w2_scales`` / ``w2_zeros [E, I // G, H]``.

One launch of the fused kernel then reaches any expert, and a checkpoint that stacks its experts (GGUF's
``blk.N.ffn_gate_exps``) loads without reshuffling; per-expert checkpoints (Hugging Face's
``mlp.experts.{e}.gate_proj``, AWQ / GPTQ / compressed-tensors too) load into slices of the stacks through
:mod:`.moe_loading`'s views. The router always stays dense (and computes in fp32).

``--cpu-experts N``: the experts of the first N MoE layers can live in host memory
(:func:`experts_in_host_memory` while the model is built); such a layer copies its hidden states to the host,
computes its experts with the ``torch_cpu`` backend there and copies the result back, whatever device the
rest of the model runs on.

Memory: once the experts are prepared for the CPU GEMMs (:meth:`FusedMoE.pack_for_cpu`: a CPU engine, or the
host layers of a GPU engine) their W4 stacks are released, each buffer replaced by a tensor of the same shape
and dtype on the ``meta`` device: the prepared copy (``kernels/moe_cpu.py``) is the only one computed from, so
the experts are held once. Shapes stay (the stacks' sizes and ``check_moe_args`` still work); byte counts of
what is resident count a meta tensor 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from lightinfer.kernels import ExpertWeights, get_backend
from lightinfer.kernels.moe_cpu import CpuExperts, added_copy_nbytes, w4_stack_nbytes
from lightinfer.layers.ops import backend_name, ops_for

_host_layers: frozenset[int] = frozenset()


@contextlib.contextmanager
def experts_in_host_memory(layer_ids: set[int] | frozenset[int]) -> Iterator[None]:
    """While the block runs, the :class:`FusedMoE` of decoder layers ``layer_ids`` is built in host memory
    (whatever the default device, except ``meta``) and computes on the CPU. Not thread-safe."""
    global _host_layers
    previous, _host_layers = _host_layers, frozenset(layer_ids)
    try:
        yield
    finally:
        _host_layers = previous


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: the ``top_k`` most probable experts of each token and their weights.

    Args:
        router_logits: ``[T, E]``.
        top_k: experts per token.
        renormalize: divide the chosen probabilities by their sum (Mixtral; Qwen-MoE's ``norm_topk_prob``),
            which equals a softmax over the top-k logits; else keep the full-softmax probabilities.
    Returns:
        ``(topk_weights fp32 [T, top_k], topk_ids int64 [T, top_k])``.
    """
    probs = torch.softmax(router_logits.to(torch.float32), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def check_top_k(num_experts: int, top_k: int, where: str = "config") -> None:
    """Raises ValueError unless ``1 <= top_k <= num_experts``."""
    if not 1 <= int(top_k) <= int(num_experts):
        raise ValueError(f"{where}: num_experts_per_tok={top_k} must be between 1 and the number of experts "
                         f"({num_experts}); a token cannot be routed to more experts than the layer has. "
                         f"Fix config.json")


class Router(nn.Module):
    """The router (Hugging Face ``gate``): ``weight [E, H]``, logits ``x @ weight^T`` in fp32 (never quantized)."""

    def __init__(self, hidden_size: int, num_experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = hidden_size, num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> fp32 logits ``[T, E]``."""
        return F.linear(x.to(torch.float32), self.weight.to(torch.float32))


class FusedMoE(nn.Module):
    """The experts of one MoE layer, stacked (module docstring): ``forward(x [T, H], topk_weights, topk_ids)``
    -> ``[T, H]``, the routing-weighted sum of each token's experts' ``down(silu(gate(x)) * up(x))``.

    Args:
        num_experts, hidden_size, intermediate_size: E, H and I (one expert's MLP width).
        dtype: activation dtype (dense weights, W4 scales and zeros).
        group_size: the W4 group size of the gate/up stack (K = H), or None for a dense stack;
            ``down_group_size`` the same for the down stack (K = I). The stacks may differ (a GGUF Q4_K_M file
            stores some layers' down experts in Q6_K, which load dense).
        prefix: the experts' checkpoint prefix (``model.layers.0.mlp.experts``); expert e's projections are
            ``{prefix}.{e}.{name}`` for the three ``proj_names`` (gate, up, down: Mixtral's are w1, w3, w2).
        layer_idx: the decoder layer (for :func:`experts_in_host_memory`).
    """

    STACKS = ("w13", "w2")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 group_size: int | None, down_group_size: int | None, prefix: str,
                 proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), layer_idx: int = -1) -> None:
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        self.prefix, self.proj_names, self.layer_idx = prefix, proj_names, layer_idx
        self.on_host = layer_idx in _host_layers and torch.get_default_device().type != "meta"
        dev = torch.device("cpu") if self.on_host else None
        self.group_sizes = {"w13": group_size or 0, "w2": down_group_size or 0}
        for name, (n, k) in (("w13", (2 * i, h)), ("w2", (h, i))):
            g = self.group_sizes[name]
            if g:
                if k % g or k % 8 or n % 8:
                    raise ValueError(f"{prefix}: a {k} -> {n} expert projection does not fit 4-bit groups of {g}")
                self.register_buffer(f"{name}_qweight", torch.zeros(e, n, k // 8, dtype=torch.int32, device=dev))
                self.register_buffer(f"{name}_scales", torch.zeros(e, k // g, n, dtype=dtype, device=dev))
                self.register_buffer(f"{name}_zeros", torch.zeros(e, k // g, n, dtype=dtype, device=dev))
            else:
                setattr(self, f"{name}_weight",
                        nn.Parameter(torch.empty(e, n, k, dtype=dtype, device=dev), requires_grad=False))
        self._prepared: tuple[object | None, object | None] = (None, None)  # a backend's own copy (moe_cpu.py)
        # Where the W4 stacks lived before pack_for_cpu released them to the meta device (None: not released);
        # the module's device from then on, since the stacks' own device now says meta.
        self._released_from: torch.device | None = None

    def is_quantized(self, stack: str) -> bool:
        """Whether stack ``"w13"`` (gate/up) or ``"w2"`` (down) is W4 (else dense)."""
        return bool(self.group_sizes[stack])

    @property
    def quantized(self) -> bool:
        """Whether any stack is W4."""
        return any(self.group_sizes.values())

    @property
    def group_size(self) -> int:
        """The gate/up stack's W4 group size (0: dense)."""
        return self.group_sizes["w13"]

    @property
    def down_group_size(self) -> int:
        """The down stack's W4 group size (0: dense)."""
        return self.group_sizes["w2"]

    @property
    def stacked_parameter_names(self) -> tuple[str, ...]:
        """Names of the dense stacks' parameters, which no checkpoint holds by these names (the loader skips them)."""
        return tuple(f"{s}_weight" for s in self.STACKS if not self.is_quantized(s))

    def _stack(self, name: str, prepared: object | None) -> ExpertWeights:
        if self.is_quantized(name):
            return ExpertWeights(qweight=getattr(self, f"{name}_qweight"), scales=getattr(self, f"{name}_scales"),
                                 zeros=getattr(self, f"{name}_zeros"), prepared=prepared)
        return ExpertWeights(weight=getattr(self, f"{name}_weight"), prepared=prepared)

    def expert_weights(self) -> tuple[ExpertWeights, ExpertWeights]:
        """``(w13, w2)`` as the ops take them (views of this module's tensors)."""
        return self._stack("w13", self._prepared[0]), self._stack("w2", self._prepared[1])

    @property
    def released(self) -> bool:
        """Whether :meth:`pack_for_cpu` released the W4 stacks (meta tensors now; the prepared copy computes)."""
        return self._released_from is not None

    def _refuse_if_released(self, what: str) -> None:
        if self.released:
            raise RuntimeError(f"{self.prefix}: cannot {what}: the W4 expert stacks were released after the CPU "
                               f"preparation (pack_for_cpu; they are meta tensors now, only the prepared copy "
                               f"holds the weights). Build and load the model again instead")

    def weights_changed(self) -> None:
        """Drop prepared copies (after a load or an in-place change of the stacked tensors).

        Raises:
            RuntimeError: the stacks were released (:attr:`released`): the prepared copy is then the only copy of
                the weights, and dropping it would leave nothing to compute from (nor could a load have written
                into meta tensors).
        """
        self._refuse_if_released("change the expert weights")
        self._prepared = (None, None)

    def __getstate__(self) -> dict:
        """Copies and pickles leave the prepared CPU copy behind (oneDNN's packed tensors cannot be copied); it is
        made again from the stacks on the first forward.

        Raises:
            RuntimeError: the stacks were released (:attr:`released`): a copy would hold meta stacks and no
                prepared copy, i.e. no weights at all, so it is refused rather than failing later.
        """
        self._refuse_if_released("copy or pickle the layer")
        return {**self.__dict__, "_prepared": (None, None)}

    def pack_for_cpu(self) -> None:
        """Prepare the experts for the CPU GEMMs once (``kernels/moe_cpu.py``), for activations of this layer's
        dtype, then release the W4 stacks (module docstring; every CPU form of a W4 stack, int4, prepacked fp32
        or dequantized dense, is a copy of it): a no-op for experts in GPU memory and when already prepared.
        Dense stacks are kept (prepared in their own dtype, the copy is the stack itself)."""
        if self.released or self.device.type != "cpu":
            return
        from lightinfer.kernels.moe_cpu import prepare_experts

        w13, w2 = self.expert_weights()
        self._prepared = tuple(p if isinstance(p, CpuExperts) and p.dtype == self.dtype else prepare_experts(w, self.dtype)
                               for w, p in ((w13, w13.prepared), (w2, w2.prepared)))
        if self.quantized:
            self._released_from = self.device
            for stack in self.STACKS:
                if self.is_quantized(stack):
                    for part in ("qweight", "scales", "zeros"):
                        name = f"{stack}_{part}"
                        setattr(self, name, torch.empty_like(getattr(self, name), device="meta"))

    def released_nbytes(self) -> int:
        """Bytes the W4 stacks released by :meth:`pack_for_cpu` held (by their shapes); 0 when none were."""
        if not self.released:
            return 0
        return sum(t.numel() * t.element_size() for w in self.expert_weights() if w.is_quantized
                   for t in w.tensors())

    def cpu_added_nbytes(self) -> int:
        """Bytes the CPU preparation added to this layer's memory: :meth:`prepared_nbytes` less
        :meth:`released_nbytes` (0 for int4 copies: the same sizes; a dense stack's fp32 copy whole)."""
        return self.prepared_nbytes() - self.released_nbytes()

    def prepared_nbytes(self) -> int:
        """Bytes the CPU copies of the stacks (``kernels/moe_cpu.py``: prepacked fp32, int4 or dense) that
        :meth:`pack_for_cpu` or a first CPU forward made really hold; 0 before any. A dense stack prepared in
        its own dtype is the stack itself, not a copy, and counts 0. (A first CPU forward without
        :meth:`pack_for_cpu`, e.g. a test's, keeps the stacks beside its copy.)"""
        own = {t.untyped_storage().data_ptr() for t in (*self.parameters(recurse=False), *self.buffers(recurse=False))
               if not t.is_meta}  # a released stack shares nothing
        total = 0
        for p in self._prepared:
            weight = getattr(p, "weight", None)
            if p is None or (weight is not None and weight.untyped_storage().data_ptr() in own):
                continue
            total += p.nbytes()
        return total

    def cpu_copy_nbytes(self) -> int:
        """Bytes :meth:`pack_for_cpu` will add to this layer's memory for activations of its dtype: the copies'
        size (``kernels.moe_cpu.prepared_copy_nbytes``) less the W4 stacks it releases
        (``kernels.moe_cpu.added_copy_nbytes``), by the kernel's rule on the stacks' shapes: nothing is
        prepared, and a meta-device module works. Equals :meth:`cpu_added_nbytes` once they are made."""
        return sum(added_copy_nbytes(w.is_quantized, self.dtype, w.num_experts, w.out_features, w.in_features,
                                     w.group_size) for w in self.expert_weights())

    @property
    def device(self) -> torch.device:
        """Where the experts compute: the stacks' device, or where they lived before :meth:`pack_for_cpu`
        released them (the CPU)."""
        return self._released_from or self.expert_weights()[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.expert_weights()[0].dtype

    def _check_released_can_compute(self, x: torch.Tensor) -> None:
        """Released stacks (:attr:`released`) leave the prepared copies as the only weights: only the ``torch_cpu``
        backend reads them, and only for activations of the dtype they were made for (they cannot be made
        again from meta tensors). Raises RuntimeError otherwise, rather than computing from meta tensors."""
        made_for = self._prepared[0].dtype
        if x.dtype != made_for:
            raise RuntimeError(f"{self.prefix}: activations are {x.dtype} but the experts were prepared for "
                               f"{made_for} and their W4 stacks released (pack_for_cpu); they cannot be prepared "
                               f"again. Build the engine with dtype={str(made_for).replace('torch.', '')}")
        if not self.on_host and backend_name(x) != "torch_cpu":
            raise RuntimeError(f"{self.prefix}: the {backend_name(x)} backend reads the W4 expert stacks, which "
                               f"were released once the torch_cpu backend's copy was made (pack_for_cpu). Build "
                               f"the engine with that backend forced (use_backend / triton_on_cpu around LLM(...))")

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, ``topk_weights`` float ``[T, top_k]``, ``topk_ids`` int ``[T, top_k]`` -> ``[T, H]``.

        Raises:
            RuntimeError: the stacks were released (:meth:`pack_for_cpu`) and ``x``'s dtype is not the one the
                copies were prepared for, or another backend than ``torch_cpu`` is forced for this layer.
        """
        w13, w2 = self.expert_weights()
        if self.released:
            self._check_released_can_compute(x)
        if self.on_host:  # hidden states to the host and back; the CPU computes these experts
            y = get_backend("torch_cpu").fused_moe(x.to("cpu"), w13, w2, topk_weights.to("cpu"), topk_ids.to("cpu"))
            y = y.to(x.device)
        else:
            y = ops_for(x).fused_moe(x, w13, w2, topk_weights, topk_ids)
        self._prepared = (w13.prepared, w2.prepared)  # what the op prepared, kept for the next call
        return y


def expert_group_sizes(num_experts: int, hidden_size: int, intermediate_size: int, quant_config: dict | None,
                       prefix: str, proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                       ) -> tuple[int | None, int | None]:
    """How each expert stack is stored: the run-time W4 group size of the gate/up stack (K = ``hidden_size``)
    and of the down stack (K = ``intermediate_size``), or None for a dense stack. A stack is W4 when all its
    projections ``{prefix}.{e}.{name}`` are 4-bit with one group size (``formats.scheme.linear_format``), else
    dense (8-bit codes, e.g. GGUF Q6_K, are dequantized once at load; a stack mixing 4-bit and other experts
    too). The one decision :func:`make_experts` builds by and :func:`experts_nbytes` counts by.

    Raises:
        ValueError: a stack whose experts are 4-bit with different group sizes.
    """
    from lightinfer.formats.scheme import linear_format

    groups: list[int | None] = []
    for names, k in ((proj_names[:2], hidden_size), (proj_names[2:], intermediate_size)):
        kinds = {(fmt.kind, fmt.runtime_group_size(k) if fmt.kind == "w4" else 0)
                 for e in range(num_experts if quant_config is not None else 0) for name in names
                 for fmt in (linear_format(quant_config, f"{prefix}.{e}.{name}"),)}
        if len({g for kind, g in kinds if kind == "w4"}) > 1:
            raise ValueError(f"{prefix}: the experts' {'/'.join(names)} projections are 4-bit with several group "
                             f"sizes ({sorted(g for _, g in kinds)}); one stacked tensor needs one")
        groups.append(kinds.pop()[1] if len(kinds) == 1 and next(iter(kinds))[0] == "w4" else None)
    return groups[0], groups[1]


def make_experts(num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 quant_config: dict | None, prefix: str, proj_names: tuple[str, str, str] = ("gate_proj", "up_proj",
                                                                                             "down_proj"),
                 layer_idx: int = -1) -> FusedMoE:
    """The :class:`FusedMoE` for experts stored as ``quant_config`` says, each stack W4 or dense as
    :func:`expert_group_sizes` decides.

    Raises:
        ValueError: a stack whose experts are 4-bit with different group sizes.
    """
    group, down_group = expert_group_sizes(num_experts, hidden_size, intermediate_size, quant_config, prefix,
                                           proj_names)
    return FusedMoE(num_experts, hidden_size, intermediate_size, dtype, group, down_group, prefix, proj_names,
                    layer_idx)


def experts_nbytes(num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                   quant_config: dict | None, prefix: str,
                   proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> tuple[int, int]:
    """Bytes of the :class:`FusedMoE` :func:`make_experts` would build, by arithmetic on the same decision
    (:func:`expert_group_sizes`; nothing is built).

    Returns:
        ``(stored, cpu_copy)``: the stacks' parameters (W4: int4 codes and a scale and zero per group in
        ``dtype``; dense: ``dtype``), and the bytes the CPU copy ``kernels/moe_cpu.py`` prepares of them for
        activations of ``dtype`` adds beyond the W4 stacks it releases
        (:func:`~lightinfer.kernels.moe_cpu.added_copy_nbytes`, on the rule the kernel prepares by: int4 codes
        plus scale/offset pairs, 0 added; a dense or prepacked fp32 fallback, its size less the W4 stack; none
        for dense 16-bit experts). ``stored + cpu_copy`` is what a CPU engine holds for them.
    Raises:
        ValueError: as :func:`expert_group_sizes`.
    """
    elem = torch.empty(0, dtype=dtype).element_size()
    e, h, i = num_experts, hidden_size, intermediate_size
    groups = expert_group_sizes(e, h, i, quant_config, prefix, proj_names)
    stored = copy = 0
    for g, (n, k) in zip(groups, ((2 * i, h), (h, i))):
        stored += w4_stack_nbytes(dtype, e, n, k, g) if g else e * n * k * elem
        copy += added_copy_nbytes(bool(g), dtype, e, n, k, g or 0)
    return stored, copy
