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
prefill-sized GEMM) refuses the graph for that size, which then always runs eagerly (the reason kept in
``refused``, led by what the first C op that declined said: ``cpu_native``'s contract is that an op either makes
its call or declines with a reason). Tensors
the forward allocates are laid out in one arena per graph, by lifetime (a tensor's bytes are reused once
its last reader has run), and the recorded pointers rewritten into it; a pointer that is neither in the
arena nor in a tensor the model, its KV cache or the runner holds refuses the graph too. The graph keeps
those tensors referenced, so their memory cannot be freed under it.

Sizes are captured exactly (no padding: a padded row costs real work on a CPU) and lazily, from 1 to one
below the rows where a 4-bit product switches to torch's dense GEMM (``cpu_native.dense_rows``), or to the
largest decode batch where the dense path is a C op too (AMX: ``cpu_native.dense_path_native``). Replays are
bit-identical to the eager forward: the same C calls with the same arguments, except that decode attention's
work buffer is sized for the longest context the step's tables can hold, and that each call is given the
step's thread count (``torch.get_num_threads()``, which ``cpu_threads.py`` lowers while other processes hold
cores; a size recorded on fewer threads than a step has is recorded again). ``enforce_eager`` turns them off.

What is replayed is said once at start-up: the runner records a batch of one padding row then
(:meth:`CpuDecodeGraphRunner.probe`, writing nothing into the cache; that graph serves the later steps of one
sequence), and :func:`log_replay_plan` logs the sizes that are replayed and why the others, or the whole model,
run eagerly; :func:`replay_report` is the same as data (``model_info()["cpu_decode_replay"]``, ``/stats``).
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
        threads: the most threads any call was given (``cpu_native.THREADED_OPS``' last argument): the work
            buffers hold that many threads' parts, so a replay may pass fewer, never more.
        descriptors: the KV-cache structs (``native_abi.LiKvCache``) the calls point to (kept alive: the
            calls hold only their addresses).
    """

    calls: list[tuple[str, tuple[Any, ...]]]
    output: torch.Tensor
    bounds: dict[str, int]
    arena: torch.Tensor
    keep: list[torch.Tensor] = field(default_factory=list)
    descriptors: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        lib = cpu_native.library()
        assert lib is not None  # a recording needs the library
        self.threads = max([args[-1] for name, args in self.calls if name in cpu_native.THREADED_OPS], default=1)
        # one C call for all of them where the ops' extension module has li_replay, else a loop over the ops
        self._replay = lib.replay
        self._lib = lib
        self._packed, self._bound = self._prepare(self.calls)
        self._by_threads: dict[int, tuple[torch.Tensor | None, list[tuple[Any, tuple[Any, ...]]]]] = {}

    def _prepare(self, calls: list[tuple[str, tuple[Any, ...]]]) -> tuple[torch.Tensor | None,
                                                                           list[tuple[Any, tuple[Any, ...]]]]:
        packed = cpu_native.pack_calls(calls) if self._replay is not None else None
        return packed, [(getattr(self._lib, name), args) for name, args in calls]

    def calls_for(self, threads: int) -> list[tuple[str, tuple[Any, ...]]]:
        """:attr:`calls` with each thread count capped at ``threads`` (>= 1, at most :attr:`threads`)."""
        if not 1 <= threads <= self.threads:
            raise ValueError(f"a graph recorded on {self.threads} threads replays on 1 to {self.threads}, "
                             f"not {threads}")
        return [(name, (*args[:-1], min(args[-1], threads)) if name in cpu_native.THREADED_OPS else args)
                for name, args in self.calls]

    def replay(self, threads: int | None = None) -> torch.Tensor:
        """Repeat the calls on the static buffers' current contents, on ``threads`` threads (default: as recorded;
        at most :attr:`threads`); returns :attr:`output`."""
        packed, bound = self._packed, self._bound
        if threads is not None and threads != self.threads:
            if threads not in self._by_threads:
                self._by_threads[threads] = self._prepare(self.calls_for(threads))
            packed, bound = self._by_threads[threads]
        if packed is not None:
            self._replay(packed.data_ptr(), len(self.calls))
        else:
            for fn, args in bound:
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
    descriptors: dict[int, Any] = {}  # the KV-cache structs the calls point to, by address
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
        for k in cpu_native.descriptor_args(name):
            desc = cpu_native.kv_descriptor(args[k])
            if desc is None:
                raise CaptureRefused(f"{name}'s argument {k} is not a KV-cache descriptor the C ops made")
            for p in desc.pointers():  # the cache's tensors: held by the model, kept like any static pointer
                s = static.find(p) if p else -1
                if s is None:
                    raise CaptureRefused(f"{name}'s KV cache points into memory the graph cannot keep")
                if s >= 0:
                    keep[s] = static.owners[s]
            descriptors[args[k]] = desc
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
    return CpuDecodeGraph(calls, view, bounds, arena, [t for owners in keep.values() for t in owners],
                          list(descriptors.values()))


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
        threads = torch.get_num_threads()  # the engine's count for this step (cpu_threads.py may change it)
        if graph is not None and threads > graph.threads:
            # recorded on fewer threads (while other processes held cores): its work buffers are too small for
            # more, so this size is recorded again
            del self.cpu_graphs[bs]
            graph = None
        if graph is not None:
            if inputs_within(graph.bounds, step):
                self.num_replays += 1
                return graph.replay(threads)
            return self._eager(bs)
        if bs in self.refused:
            return self._eager(bs)
        return self._record(bs)

    @torch.inference_mode()
    def probe(self) -> None:
        """Record a decode step of one padding row now (slot -1: nothing written into the KV cache; context 1
        over block 0), so that whether this model's steps replay is known at start-up (:attr:`refused` holds
        why not); the graph, if any, serves the later steps of one sequence."""
        self._pad_all_rows()
        if self.inputs_embeds is not None:
            self.inputs_embeds[:1].zero_()
        self._record(1)

    def reset(self) -> None:
        """Forget every recording and refusal (and the tensors the model holds): for a model changed after
        start-up, whose next steps are then recorded anew."""
        self.cpu_graphs.clear()
        self.refused.clear()
        self._static = None

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
            said = "; ".join(f"{op} declined: {reason}" for op, reason in dict.fromkeys(rec.declined))
            why = f"{said} ({err})" if said else str(err)
            # debug, not info: a `lightinfer generate` would print it in the middle of its streamed answer; the
            # start-up probe's refusal is logged at info (log_replay_plan), and runner.refused keeps every reason
            logger.debug("lightinfer: CPU decode steps of %d sequences run eagerly, not replayed (%s)", bs, why)
            self.refused[bs] = why
        return out


NOT_A_CPU_ENGINE = "not a CPU engine (a CUDA engine replays CUDA graphs)"


def replay_unavailable(device: torch.device, enforce_eager: bool, num_kv_groups: int, dtype: torch.dtype,
                       backend: str) -> str | None:
    """Why an engine records no CPU decode step at all, or None when it does (``model_runner._cpu_graph_runner``).

    Args:
        device: the engine's device. enforce_eager: the engine's setting. num_kv_groups: its KV-cache groups
            (sliding-window layers keep their own). dtype: its activation dtype. backend: the small ops'
            backend (``layers.ops.backend_name``).
    """
    if device.type != "cpu":
        return NOT_A_CPU_ENGINE
    if enforce_eager:
        return "enforce_eager is set"
    if dtype != torch.bfloat16:
        return (f"{str(dtype).replace('torch.', '')} activations: only bf16 engines replay (fp32 multiplies by "
                "torch's GEMM, and the C ops take no fp16)")
    if backend != "torch_cpu":
        return f"the {backend} backend runs the small ops, not the C ops"
    if num_kv_groups != 1:
        return (f"{num_kv_groups} KV-cache groups (sliding-window and full-attention layers keep separate pools; "
                "a recording holds one)")
    if cpu_native.library() is None:
        return f"the C ops are unavailable ({cpu_native.status})"
    return None


def eager_above(max_batch_size: int, max_decode_batch: int, dtype: torch.dtype) -> str | None:
    """Why decode batches above ``max_batch_size`` (up to ``max_decode_batch``) run eagerly; None when none do."""
    if max_batch_size >= max_decode_batch:
        return None
    return (f"batches of {max_batch_size + 1} or more sequences: the 4-bit products take torch's dense GEMM from "
            f"{cpu_native.dense_rows(dtype)} rows, which a replay cannot repeat")


def replay_report(runner: CpuDecodeGraphRunner | None, unavailable: str | None,
                  above: str | None = None) -> dict[str, Any]:
    """Which CPU decode steps are replayed, as data (``model_info()["cpu_decode_replay"]``, ``/stats``).

    Args:
        runner: the engine's runner, or None when it has none.
        unavailable: why it has none (:func:`replay_unavailable`).
        above: why batches above the runner's largest size run eagerly (:func:`eager_above`).
    Returns:
        ``enabled`` (bool); ``batch_sizes``: the sizes recorded at their first step, ``[1, max]``, or ``[]``;
        ``replayed``: the sizes that have a graph now; ``refused``: size (a string) -> why it runs eagerly;
        ``eager``: why the sizes outside ``batch_sizes`` (or all of them) run eagerly, None when none do.
    """
    if runner is None:
        return {"enabled": False, "batch_sizes": [], "replayed": [], "refused": {}, "eager": unavailable}
    return {"enabled": True, "batch_sizes": [1, runner.max_batch_size], "replayed": sorted(runner.cpu_graphs),
            "refused": {str(k): v for k, v in sorted(runner.refused.items())}, "eager": above}


def log_replay_plan(report: dict[str, Any]) -> None:
    """One info line at start-up: which CPU decode batch sizes are replayed, and why the others are not."""
    if not report["enabled"]:
        logger.info("lightinfer: CPU decode steps run eagerly, not replayed: %s", report["eager"])
        return
    lo, hi = report["batch_sizes"]
    if report["refused"]:
        logger.info("lightinfer: CPU decode steps run eagerly, not replayed: this model's step of one sequence "
                    "was refused: %s", next(iter(report["refused"].values())))
        return
    above = f"; {report['eager']}, run eagerly" if report["eager"] else ""
    logger.info("lightinfer: CPU decode steps of %d-%d sequences are replayed (each size recorded at its first "
                "step)%s", lo, hi, above)
