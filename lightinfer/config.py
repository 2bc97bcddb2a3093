"""EngineConfig: the one settings object every part of the engine takes."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

import torch

from lightinfer.kernels import KV_BLOCK_SIZES
from lightinfer.kernels.switches import CPU_W4_NAMES
from lightinfer.speculative_config import SpeculativeConfig

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
KV_CACHE_DTYPES = ("auto", "int8")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("awq",)
RUNNERS = ("auto", "generate", "pooling")  # vLLM's names
CPU_DEFAULT_KV_CACHE_BYTES = 512 * 2**20  # a CPU has no memory profiler of ours: a fixed default
DEFAULT_MAX_MODEL_LEN = 8192  # max_model_len=None: the model's context, capped here (its KV pool must hold one)


# A CPU engine computes one request's prompt in chunks of at most this many tokens (about 3-6 s of a 135M 4-bit
# model on two cores): a long prompt then delays the others by one chunk, not by its whole prefill.
CPU_LONG_PREFILL_TOKENS = 512


def parse_bytes(value: int | str | None) -> int | None:
    """``"8GiB"``, ``"512MB"``, ``"1.5G"`` or an int -> bytes (binary units for G/M/K). None stays None."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", str(value), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read a memory size from {value!r}; write e.g. 8GiB, 512MiB or a byte count")
    factor = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2).upper()]
    return int(float(m.group(1)) * factor)


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> cuda when available, else cpu; anything else is passed to ``torch.device``.
    A CUDA device always gets its index (``cuda`` -> ``cuda:<current>``).

    Raises:
        ValueError: a name torch does not know, a device type other than cpu/cuda, or cuda without a GPU.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device name; use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; lightinfer runs on cpu or cuda (CUDA GPUs)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but torch sees no CUDA GPU; use device='cpu'")
        if dev.index is None:  # tensors report "cuda:0", and torch.device("cuda") != torch.device("cuda:0")
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"`` -> fp32 on CPU, bf16 on GPUs that support it, else fp16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_auto_dtype(quantized: bool, lowbit: bool | None = None) -> torch.dtype:
    """What ``dtype="auto"`` means on a CPU: bf16 for a 4-/8-bit checkpoint where torch's CPU int4 GEMM runs
    (its fast path takes bf16 activations, and the weights then stay low-bit: ``kernels/cpu_lowbit.py``)
    unless ``lowbit`` is False (``EngineConfig.cpu_lowbit``; None: the ``LIGHTINFER_CPU_LOWBIT`` switch) and
    asks for the exact path; fp32 otherwise (a dense checkpoint, or the exact path: low-bit weights dequantized
    once to fp32)."""
    from lightinfer.kernels import switches
    from lightinfer.kernels.cpu_lowbit import int4_gemm_available

    if lowbit is None:
        lowbit = switches.current().cpu_lowbit
    if quantized and lowbit and int4_gemm_available() and torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        return torch.bfloat16
    return torch.float32


def choose_max_model_len(model_max_len: int, requested: int | None) -> int:
    """The engine's ``max_model_len`` in tokens: ``requested``, or the model's context ``model_max_len`` capped at
    :data:`DEFAULT_MAX_MODEL_LEN`.

    Raises:
        ValueError: ``requested`` exceeds ``model_max_len`` (the message gives the limit).
    """
    if requested is None:
        return min(int(model_max_len), DEFAULT_MAX_MODEL_LEN)
    if requested > model_max_len:
        raise ValueError(f"max_model_len={requested} exceeds what this model supports ({model_max_len}: "
                         f"max_position_embeddings, with its RoPE scaling); use at most {model_max_len}")
    return int(requested)


@dataclass
class EngineConfig:
    """Engine settings, validated in ``__post_init__``.

    Attributes:
        model: a Hugging Face folder, a ``.gguf`` file or ``smollm2-135m-instruct``.
        dtype: activation / weight dtype: "auto", "float32", "float16", "bfloat16". "auto": bf16 on GPUs
            that have it, else fp16; on a CPU bf16 for a 4-/8-bit checkpoint (its weights then stay
            low-bit, :func:`cpu_auto_dtype`), fp32 for a dense one.
        device: "auto", "cpu" or "cuda[:i]".
        max_model_len: longest sequence (prompt + output) in tokens; None = the model's own limit
            (``max_position_embeddings``, with its RoPE scaling: ``layers/rope_scaling.py``) capped at 8192.
        block_size: tokens per KV block.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        long_prefill_token_threshold: most prompt tokens one request computes in a step (vLLM's name), so that a
            long prompt is cut into chunks and the requests behind it join the batch in between instead of
            waiting for its whole prefill; 0 = no cap (a chunk takes the rest of the budget); None = auto:
            :data:`CPU_LONG_PREFILL_TOKENS` on a CPU (where a 2,048-token step takes tens of seconds), no cap
            on a GPU.
        kv_cache_dtype: "auto" (the model dtype) or "int8" (per-token asymmetric, see DESIGN.md).
        kv_cache_memory_bytes: KV pool size in bytes (overrides the two below).
        num_kv_blocks: KV pool size in blocks, per KV-cache group (a model with sliding-window layers
            has one pool for them and one for the others; overrides every size above; tests, benchmarks).
        gpu_memory_utilization: share of the GPU's memory the engine may use (weights included).
        max_vram: absolute cap on the engine's GPU memory, e.g. "8GiB".
        enable_prefix_caching: reuse full KV blocks of identical prefixes.
        enforce_eager: every forward eager: no CUDA graphs on a GPU (``cuda_graph.py``), no replayed decode
            steps on a CPU (``cpu_graph.py``).
        seed: seed of the shared generator that requests without their own ``seed`` sample from: an engine
            started with a seed gives the same outputs to the same requests in the same order, every run.
            None: drawn from the OS at start, so unseeded requests differ between runs and processes (as
            "random" promises; a request's own ``seed`` stays reproducible either way). Dummy weights use it
            too, or a fixed seed when it is None, so they are the same in every run.
        max_waiting: most queued requests before new ones are refused (serving).
        load_format: "auto" (read the weights) or "dummy" (random weights of the config, built
            on the device in the run-time layout; benchmarks of real shapes without a file).
        quantization: "awq" or None (the checkpoint's own). With ``load_format="dummy"``,
            "awq" builds 4-bit layers; with real weights it only asserts the checkpoint is AWQ.
        skip_tokenizer_init: no tokenizer: prompts must be token ids, outputs carry ids and
            empty text (implied for a dummy model whose folder has no tokenizer files).
        embedding_on_host: on CUDA, keep the input embedding table in host memory (only rows
            are gathered, 8 KiB per token over PCIe) to give its GPU memory to the KV cache.
            None = yes unless it is tied to the LM head (which needs it on the GPU).
        cpu_experts: mixture-of-experts models: keep the experts of the first N MoE layers in host
            memory and compute them on the CPU (hidden states copied to the host and back for those
            layers; no CUDA graphs then). 0 = every expert on the device (engine/moe_placement.py).
        threads: CPU threads of a CPU engine's steps (``torch.set_num_threads``; the C ops follow it). A number
            fixes it. ``"auto"`` (the default; None means the same): ``OMP_NUM_THREADS`` when set, else the cores
            this process may run on (``os.sched_getaffinity``), fewer while other processes keep some of them
            busy, measured every quarter second (``engine/cpu_threads.py``).
        cpu_lowbit: CPU engines with 16-bit activations keep 4-/8-bit layers low-bit (True) or dequantize them
            once into dense weights (False: the exact path, 4-8x the weights' memory; ``dtype="auto"`` then
            means fp32). None = the ``LIGHTINFER_CPU_LOWBIT`` environment switch (default True).
        cpu_w4: CPU engines' product of 4-bit layers: "c" (the C product, activations int16 per block of 32),
            "int8" (activations int8 per block of 32: faster, each layer's output moves by ~1%) or "torch"
            (torch's int4 GEMM with bf16 activations, and its int8 GEMM for an 8-bit LM head). None = the
            ``LIGHTINFER_CPU_W4`` environment switch (default "c"). ``kernels/switches.py``.
        speculative_config: speculative decoding (vLLM's name): a :class:`SpeculativeConfig`, a dict, a JSON
            object's text or a JSON file's path, e.g. ``{"method": "ngram", "num_speculative_tokens": 4}``
            (``lightinfer/speculative_config.py``, ``engine/spec/``); None = off. Greedy output is identical
            with it on; sampled output has the same distribution.
        runner: "generate" (text generation), "pooling" (an embedding model: each prompt is prefilled and pooled
            into one vector, ``LLM.embed`` / ``/v1/embeddings``; generation requests are refused; no prefix cache)
            or "auto" (the default): "pooling" when the checkpoint says it is an embedding model (a
            sentence-transformers ``modules.json`` with a Pooling module, an architecture without an LM head
            such as ``Qwen3Model``, or safetensors weights without ``lm_head.weight`` and no tied head), else
            "generate". vLLM's name and values; ``LLM(..., task="embed")`` is its older spelling.

    :meth:`resolve` turns the settings and the checkpoint's facts into a resolved, frozen config: every "auto"
    and None decided (``dtype``, ``device``, ``max_model_len``, ``cpu_lowbit``, ``cpu_w4``), before anything is
    built; the engine, the model runner and all after them read only that one.
    """

    model: str
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int | None = None
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | str | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    max_vram: int | str | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int | None = None
    max_waiting: int = 256
    load_format: str = "auto"
    quantization: str | None = None
    skip_tokenizer_init: bool = False
    embedding_on_host: bool | None = None
    cpu_experts: int = 0
    threads: int | str | None = "auto"
    cpu_lowbit: bool | None = None
    cpu_w4: str | None = None
    speculative_config: SpeculativeConfig | dict | str | None = None
    runner: str = "auto"

    def __setattr__(self, name: str, value: object) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"cannot set {name}: this EngineConfig is resolved and frozen (EngineConfig.resolve); "
                f"change the settings with dataclasses.replace(config, {name}=...) and build a new engine")
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64) or None (random: drawn from the OS at "
                             f"start), got {self.seed!r}")
        if isinstance(self.cpu_experts, bool) or not isinstance(self.cpu_experts, int) or self.cpu_experts < 0:
            raise ValueError(f"cpu_experts must be an integer >= 0 (MoE layers whose experts stay in host memory), "
                             f"got {self.cpu_experts!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.embedding_on_host is not None and not isinstance(self.embedding_on_host, bool):
            raise ValueError(f"embedding_on_host must be True, False or None (auto), got {self.embedding_on_host!r}")
        if self.block_size not in KV_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {KV_BLOCK_SIZES} tokens, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= block_size ({self.block_size})"
            )
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.long_prefill_token_threshold is not None and (
                isinstance(self.long_prefill_token_threshold, bool) or not isinstance(self.long_prefill_token_threshold, int)
                or self.long_prefill_token_threshold < 0):
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0 (0: no cap) or None (auto), got "
                             f"{self.long_prefill_token_threshold!r}")
        if self.threads is None:
            self.threads = "auto"
        if self.threads != "auto" and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                       or self.threads < 1):
            raise ValueError(f"threads must be a positive number of CPU threads or 'auto' (the usable cores, fewer "
                             f"while other processes keep them busy), got {self.threads!r}")
        if self.cpu_lowbit is not None and not isinstance(self.cpu_lowbit, bool):
            raise ValueError(f"cpu_lowbit must be True (4-/8-bit layers stay low-bit on a CPU), False (dequantized "
                             f"once: the exact path) or None (the LIGHTINFER_CPU_LOWBIT switch), got {self.cpu_lowbit!r}")
        if self.cpu_w4 is not None and self.cpu_w4 not in CPU_W4_NAMES:
            raise ValueError(f"cpu_w4 must be one of {', '.join(CPU_W4_NAMES)} (the CPU's 4-bit product) or None "
                             f"(the LIGHTINFER_CPU_W4 switch, default c), got {self.cpu_w4!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)} (pooling: an embedding model), got "
                             f"{self.runner!r}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.kv_cache_memory_bytes = parse_bytes(self.kv_cache_memory_bytes)
        self.max_vram = parse_bytes(self.max_vram)
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        self.torch_device = resolve_device(self.device)
        self.torch_dtype = resolve_dtype(self.dtype, self.torch_device)
        if self.long_prefill_token_threshold is None:
            self.long_prefill_token_threshold = CPU_LONG_PREFILL_TOKENS if self.torch_device.type == "cpu" else 0

    @property
    def resolved(self) -> bool:
        """Whether this config came out of :meth:`resolve` (every automatic setting decided; frozen)."""
        return bool(self.__dict__.get("_frozen"))

    def resolve(self, *, model_max_len: int, quantized: bool, pooling_model: bool = False) -> EngineConfig:
        """A resolved, frozen copy of this config (this one is left as it is): ``dtype`` the dtype's name
        (:func:`resolve_dtype`; on a CPU :func:`cpu_auto_dtype` for "auto"), ``device`` the device with its
        index, ``max_model_len`` a number of tokens (:func:`choose_max_model_len`), ``cpu_lowbit`` and
        ``cpu_w4`` the value in force (the field, else the environment switch), ``long_prefill_token_threshold``
        a number, ``runner`` "generate" or "pooling" (a pooling engine has ``enable_prefix_caching`` False: its
        requests keep no KV after their prefill). ``torch_dtype`` / ``torch_device`` as ever. Resolving a
        resolved config returns it.

        Args:
            model_max_len: the checkpoint's context in tokens (``max_position_embeddings`` with its RoPE
                scaling: ``layers.rope_scaling.rope_max_positions``).
            quantized: the checkpoint's linears are 4-/8-bit (it has a quantization config).
            pooling_model: the checkpoint says it is an embedding model (what ``runner="auto"`` follows).
        Raises:
            ValueError: ``max_model_len`` beyond ``model_max_len``; speculative decoding asked of a pooling engine.
        """
        if self.resolved:
            return self
        from lightinfer.kernels import switches

        env = switches.current()
        cpu_lowbit = env.cpu_lowbit if self.cpu_lowbit is None else self.cpu_lowbit
        cpu_w4 = env.cpu_w4 if self.cpu_w4 is None else self.cpu_w4
        dtype = self.torch_dtype
        if self.dtype == "auto" and self.torch_device.type == "cpu":  # known once the checkpoint is open
            dtype = cpu_auto_dtype(quantized, cpu_lowbit)
        name = str(dtype).replace("torch.", "")
        runner = self.runner if self.runner != "auto" else "pooling" if pooling_model else "generate"
        if runner == "pooling" and self.speculative_config is not None:
            raise ValueError("speculative_config is for text generation; a pooling (embedding) engine generates "
                             "nothing: leave it out")
        out = dataclasses.replace(
            self, dtype=name if name in _DTYPES else dtype, device=str(self.torch_device),
            max_model_len=choose_max_model_len(model_max_len, self.max_model_len),
            cpu_lowbit=cpu_lowbit, cpu_w4=cpu_w4, runner=runner,
            enable_prefix_caching=self.enable_prefix_caching and runner == "generate")
        object.__setattr__(out, "_frozen", True)
        return out

    def kernel_switches(self) -> dict[str, object]:
        """The engine-role kernel switches (``kernels/switches.py``) this config sets: ``{name: value}`` for
        ``switches.override`` while the engine prepares its weights; a None (unresolved) field is left out."""
        from lightinfer.kernels import switches

        return {n: v for n in switches.engine_switches() if (v := getattr(self, n)) is not None}
