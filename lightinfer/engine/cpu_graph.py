"""Recorded decode steps on the CPU: a forward's C calls, replayed for the next steps of that batch size.

On the CPU a decode step of a small model spends more time in Python than in its arithmetic: each of the
~270 C ops of a SmolLM2-135M step (``kernels/cpu_native.py``: norms, RoPE + KV store, attention, SiLU·mul,
the 4- and 8-bit products) costs a few microseconds of argument checks, output allocation and module calls
around a call that itself may take less. Like a CUDA graph on the GPU (``cuda_graph.py``), the first decode
step of each batch size runs eagerly while its C calls are recorded (``cpu_native.recording``); later steps
of that size load their inputs into the same static buffers and repeat the calls, nothing else::

    step of n decodes ──▶ static buffers (ids, positions, slots, context_lens, block tables; the embedding
                          rows gathered eagerly into inputs_embeds) ──▶ graph for n?
        no  ──▶ eager forward, recorded ──▶ plan: pointers into one arena ──▶ graph for n (or refused)
        yes ──▶ the step's inputs within the recorded limits? ──▶ replay the calls ──▶ hidden [n, hidden]
                                                             └─▶ no: eager forward on the static buffers

Only what the C ops compute can be replayed, so the recording watches every torch op of the forward
(a ``TorchDispatchMode``): one that computes (a torch fallback of an op, an op with no C twin, a
prefill-sized GEMM) refuses the graph for that size, which then always runs eagerly (the reason logged at debug level and kept in ``refused``). Tensors
the forward allocates are laid out in one arena per graph, by lifetime (a tensor's bytes are reused once
its last reader has run), and the recorded pointers rewritten into it; a pointer that is neither in the
arena nor in a tensor the model, its KV cache or the runner holds refuses the graph too. The graph keeps
those tensors referenced, so their memory cannot be freed under it.

Sizes are captured exactly (no padding: a padded row costs real work on a CPU) and lazily, from 1 to one
below the rows where a 4-bit product switches to torch's dense GEMM (``cpu_native.dense_rows``), or to the
largest decode batch where the dense path is a C op too (AMX: ``cpu_native.dense_path_native``). Replays are
bit-identical to the eager forward: the same C calls with the same arguments, except that decode attention's
work buffer is sized for the longest context the step's tables can hold. ``enforce_eager`` turns them off.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightinfer.engine.cuda_graph import DecodeGraphRunner
from lightinfer.engine.step_inputs import StepInputs
from lightinfer.kernels import cpu_native
from lightinfer.kernels.native_record import Recording
from lightinfer.layers.weight_forms import LinearWeight

logger = logging.getLogger("lightinfer")

# aten ops that only make a tensor or a view of one: nothing to replay
META_OPS = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "view", "_unsafe_view", "reshape", "slice", "split",
    "split_with_sizes", "unflatten", "as_strided", "detach", "alias", "transpose", "permute", "expand", "select",
    "squeeze", "unsqueeze", "t", "unbind", "narrow",
})
FACTORY_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty"})
ALIGN = 64  # bytes: each arena tensor starts on a cache line
BOUND_KEYS = ("positions", "slots", "context", "blocks")


class CaptureRefused(Exception):
    """A recorded forward cannot be replayed; the message says why."""


@dataclass
class CpuDecodeGraph:
    """One batch size's recorded forward.

    Attributes:
        calls: ``(op name, arguments)`` in order, pointers rewritten into ``arena``.
        output: ``[bs, hidden]``, a view into ``arena``: the hidden states after a :meth:`replay`.
        bounds: the recording's input limits (``native_record.Recording.bounds``) and the cache's ``block_size``.
        arena: the bytes of every tensor the forward allocated, laid out by lifetime.
        keep: the model's, cache's and runner's tensors the calls point into (kept alive).
    """

    calls: list[tuple[str, tuple[Any, ...]]]
    output: torch.Tensor
    bounds: dict[str, int]
    arena: torch.Tensor
    keep: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        lib = cpu_native.library()
        assert lib is not None  # a recording needs the library
        # one C call for all of them where the ops' extension module has li_replay, else a loop over the ops
        self._replay = lib.replay
        self._packed = cpu_native.pack_calls(self.calls) if lib.replay is not None else None
        self._bound = [(getattr(lib, name), args) for name, args in self.calls]

    def replay(self) -> torch.Tensor:
        """Repeat the calls on the static buffers' current contents; returns :attr:`output`."""
        if self._packed is not None:
            self._replay(self._packed.data_ptr(), len(self.calls))
        else:
            for fn, args in self._bound:
                fn(*args)
        return self.output


class _Watch(TorchDispatchMode):
    """Sees every torch op of a recorded forward: keeps what the factory ops allocate (alive until the plan,
    so that no two of them share an address) and notes the first op that computes outside a range check."""

    def __init__(self, rec: Recording) -> None:
        super().__init__()
        self.rec = rec
        self.allocations: list[torch.Tensor] = []
        self.refused: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in FACTORY_OPS:
            self.allocations.append(out)
        elif name not in META_OPS and self.refused is None and not self.rec.in_check:
            self.refused = f"the forward computes {func} outside the C ops"
        return out


class _Ranges:
    """Byte ranges of tensors' storages, merged where they overlap; ``find(p)`` -> the range holding ``p``."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        spans: list[tuple[int, int, torch.Tensor]] = []
        for t in tensors:
            if t.layout != torch.strided or t.is_mkldnn:  # opaque (a prepacked oneDNN weight): no C op reads it
                continue
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr():
                spans.append((st.data_ptr(), st.data_ptr() + st.nbytes(), t))
        spans.sort(key=lambda s: s[0])
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.owners: list[list[torch.Tensor]] = []
        for start, end, t in spans:
            if self.ends and start < self.ends[-1]:
                self.ends[-1] = max(self.ends[-1], end)
                self.owners[-1].append(t)
            else:
                self.starts.append(start)
                self.ends.append(end)
                self.owners.append([t])

    def find(self, p: int) -> int | None:
        i = bisect.bisect_right(self.starts, p) - 1
        return i if i >= 0 and p < self.ends[i] else None


def held_tensors(roots: Iterable[Any], depth: int = 4) -> list[torch.Tensor]:
    """Every tensor reachable from ``roots``: the modules' parameters, buffers and attributes (the linears'
    weight forms by what they say they read, ``LinearWeight.tensors()``; lightinfer's other objects, such as a
    MoE layer's expert copies and ``PagedKV`` caches, looked into up to ``depth`` levels), and tensors, tuples,
    lists and dicts among the roots."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(obj: Any, left: int) -> None:
        if isinstance(obj, torch.Tensor):
            out.append(obj)
            return
        if left == 0 or id(obj) in seen or obj is None or isinstance(obj, (int, float, str, bool)):
            return
        seen.add(id(obj))
        if isinstance(obj, LinearWeight):
            out.extend(obj.tensors())
            return
        if isinstance(obj, (list, tuple)):
            items: Iterable[Any] = obj
        elif isinstance(obj, dict):
            items = obj.values()
        elif isinstance(obj, nn.Module):
            items = (v for k, v in vars(obj).items() if k != "_modules")  # submodules: modules() visits them
        elif type(obj).__module__.startswith("lightinfer") and hasattr(obj, "__dict__"):
            items = vars(obj).values()
        else:
            return
        for item in items:
            walk(item, left - 1)

    for root in roots:
        for obj in (root.modules() if isinstance(root, nn.Module) else (root,)):
            walk(obj, depth)
    return out


def plan_graph(rec: Recording, allocations: list[torch.Tensor], output: torch.Tensor,
               static: _Ranges, block_size: int) -> CpuDecodeGraph:
    """Lay out the recorded forward's tensors in one arena and rewrite the calls' pointers into it.

    Args:
        rec: the recording (calls, bounds).
        allocations: what the forward allocated, each still alive (distinct addresses).
        output: the forward's result, one of ``allocations`` (or a view of one), contiguous.
        static: the tensors outside the forward that a pointer may name (weights, caches, static inputs).
        block_size: tokens per KV block of the engine's cache (one KV-cache group: every layer's).
    Raises:
        CaptureRefused: a pointer into neither, a non-contiguous or foreign output, or missing input limits.
    """
    missing = [k for k in BOUND_KEYS if k not in rec.bounds]
    if missing:
        raise CaptureRefused(f"no RoPE + KV store or decode attention in C was recorded (no {missing})")
    if not output.is_contiguous():
        raise CaptureRefused("the forward's output is not contiguous")
    local = _Ranges(allocations)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    keep: dict[int, list[torch.Tensor]] = {}
    rewrites: list[list[tuple[int, int, int]]] = []  # per call: (arg index, range, byte offset in it)
    for i, (name, args) in enumerate(rec.calls):
        mine = []
        for k in cpu_native.pointer_args(name):
            p = args[k]
            if not p:
                continue
            r = local.find(p)
            if r is not None:
                first.setdefault(r, i)
                last[r] = i
                mine.append((k, r, p - local.starts[r]))
                continue
            s = static.find(p)
            if s is None:
                raise CaptureRefused(f"{name}'s argument {k} points into memory the graph cannot keep")
            keep[s] = static.owners[s]
        rewrites.append(mine)
    out_range = local.find(output.data_ptr())
    if out_range is None or out_range not in first:
        raise CaptureRefused("the forward's output was not written by a C op")
    last[out_range] = len(rec.calls)  # read after the replay

    offsets, total = _place({r: (local.ends[r] - local.starts[r], first[r], last[r]) for r in first})
    arena = torch.empty(total + ALIGN, dtype=torch.uint8)
    base = -arena.data_ptr() % ALIGN  # bytes into the arena where the aligned layout starts
    calls = []
    for (name, args), mine in zip(rec.calls, rewrites):
        new = list(args)
        for k, r, into in mine:
            new[k] = arena.data_ptr() + base + offsets[r] + into
        calls.append((name, tuple(new)))
    at = base + offsets[out_range] + output.data_ptr() - local.starts[out_range]
    view = arena[at: at + output.numel() * output.element_size()].view(output.dtype).view(output.shape)
    bounds = {**rec.bounds, "block_size": block_size}
    return CpuDecodeGraph(calls, view, bounds, arena, [t for owners in keep.values() for t in owners])


def _place(sizes: dict[int, tuple[int, int, int]]) -> tuple[dict[int, int], int]:
    """Offsets for tensors ``key -> (bytes, first use, last use)`` such that two whose uses overlap (call
    indices, inclusive) never share a byte: largest first, each at the lowest aligned gap. Returns
    ``(offsets, total bytes)``."""
    placed: list[tuple[int, int, int, int]] = []  # (offset, bytes, first, last)
    offsets: dict[int, int] = {}
    for key, (nbytes, lo, hi) in sorted(sizes.items(), key=lambda kv: -kv[1][0]):
        size = -(-nbytes // ALIGN) * ALIGN
        at = 0
        for off, n, f, l in sorted(p for p in placed if p[2] <= hi and lo <= p[3]):
            if at + size <= off:
                break
            at = max(at, off + n)
        placed.append((at, size, lo, hi))
        offsets[key] = at
    return offsets, max((off + n for off, n, _, _ in placed), default=0)


def inputs_within(bounds: dict[str, int], step: StepInputs) -> bool:
    """Whether ``step``'s positions, slots, context lengths and used block-table entries are within the limits
    a graph was recorded with (the C ops check them only while recording)."""
    if min(step.positions) < 0 or max(step.positions) >= bounds["positions"] or \
            max(step.slot_mapping) >= bounds["slots"]:
        return False
    if min(step.context_lens) < 1 or max(step.context_lens) > bounds["context"]:
        return False
    block_size, num_blocks = bounds["block_size"], bounds["blocks"]
    for length, table in zip(step.context_lens, step.block_tables):
        used = table[: -(-length // block_size)]
        if len(used) * block_size < length or min(used) < 0 or max(used) >= num_blocks:
            return False
    return True


class CpuDecodeGraphRunner(DecodeGraphRunner):
    """Decode steps of 1 to ``max_batch_size`` sequences replayed from recordings (module docstring).

    Args:
        model: the causal LM; ``model(None, positions, inputs_embeds)`` must run the C ops.
        max_batch_size: the largest batch recorded (below ``cpu_native.dense_rows`` unless
            ``cpu_native.dense_path_native``).
        max_blocks_per_seq: block table width, ``ceil(max_model_len / block_size)``.
        block_size: tokens per KV block.
        hidden_size, dtype: the model's output width and activation dtype.
    """

    def __init__(self, model: nn.Module, max_batch_size: int, max_blocks_per_seq: int, block_size: int,
                 hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__(model, max_batch_size, max_blocks_per_seq, hidden_size, dtype, torch.device("cpu"), False,
                         host_embedding=model.embed_tokens, batch_sizes=list(range(1, max_batch_size + 1)))
        self.block_size = block_size
        self.max_context = max_blocks_per_seq * block_size
        self.cpu_graphs: dict[int, CpuDecodeGraph] = {}
        self.refused: dict[int, str] = {}  # batch size -> why it runs eagerly
        self.num_replays = 0
        self._static: _Ranges | None = None

    @torch.inference_mode()
    def run(self, step: StepInputs) -> torch.Tensor:
        """Run ``step`` (see :meth:`can_run`): replayed when its size has a graph and its inputs are within
        the graph's limits, else eagerly (recorded the first time for a size).

        Returns:
            ``[num_decodes, hidden]`` in row order of ``step``, valid until the next :meth:`run`.
        """
        bs = self.load(step)
        self.num_runs += 1
        graph = self.cpu_graphs.get(bs)
        if graph is not None:
            if inputs_within(graph.bounds, step):
                self.num_replays += 1
                return graph.replay()
            return self._eager(bs)
        if bs in self.refused:
            return self._eager(bs)
        return self._record(bs)

    def _eager(self, bs: int) -> torch.Tensor:
        self._forward(bs)
        return self.hidden[:bs]

    def _record(self, bs: int) -> torch.Tensor:
        """The step's forward, recorded; its graph kept for the next steps of ``bs`` sequences."""
        if self._static is None:
            self._static = _Ranges(held_tensors([self.model, self._i64, self._i32, self.inputs_embeds]))
        with contextlib.ExitStack() as stack:
            try:
                rec = stack.enter_context(cpu_native.recording(self.max_context))
            except RuntimeError as err:  # another thread is recording: this step runs eagerly, not recorded
                logger.debug("lightinfer: decode step of %d not recorded: %s", bs, err)
                return self._eager(bs)
            watch = stack.enter_context(_Watch(rec))
            out = self._model_forward(bs)
        try:
            if watch.refused is not None:
                raise CaptureRefused(watch.refused)
            self.cpu_graphs[bs] = plan_graph(rec, watch.allocations, out, self._static, self.block_size)
        except CaptureRefused as err:
            # debug, not info: a `lightinfer generate` would print it in the middle of its streamed answer;
            # runner.refused keeps the reason
            logger.debug("lightinfer: CPU decode steps of %d sequences run eagerly, not replayed (%s)", bs, err)
            self.refused[bs] = str(err)
        return out
