"""Several models behind one server: loaded when a request names one, unloaded when memory is needed or idle.

``lightinfer serve MODEL MODEL ...`` or ``--models-dir DIR`` serves a :class:`ModelPool` (the one-model server
keeps :class:`~lightinfer.entrypoints.served_models.SingleModel`). Each loaded model is its own
``AsyncLLMEngine`` (own engine thread, KV pool and batch). The rules:

* A request naming an unloaded model waits while it loads; requests for the loaded ones go on meanwhile. One model
  loads at a time; the others wait in ``load_queue`` order (``/stats``).
* At most ``max_loaded`` models are loaded, and their estimated memory stays within ``memory_budget_bytes``
  (:func:`estimate_model_bytes`: the engine's own host-memory arithmetic on a CPU, the weights plus the KV share
  on a GPU). To make room the least recently used model that is neither pinned nor busy (no request in its
  engine or being prepared) is unloaded; when every loaded model is busy, the load waits for one to finish.
* ``idle_unload_s``: a model without requests for that long is unloaded (pinned ones never are).
* A model that fails to load answers 503 with the reason to the requests naming it, and keeps answering so
  (no retry on each request) until its file changes or ``POST /models/load`` asks again; the others keep serving.

Unloading stops the model's engine thread and drops every reference to it; the memory then goes back to the
system (the CUDA caching allocator's blocks are released; on a CPU glibc's free lists are trimmed).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lightinfer.config import EngineConfig
from lightinfer.engine.cpu_malloc import trim_heap
from lightinfer.entrypoints import protocol as P
from lightinfer.entrypoints.openai_errors import OpenAIError
from lightinfer.entrypoints.openai_serving import OpenAIServing
from lightinfer.entrypoints.served_models import check_model_name, unknown_model_error

logger = logging.getLogger(__name__)


@dataclass
class ModelEntry:
    """One servable model and its state (event-loop side only)."""

    name: str
    source: str  # what EngineConfig.model takes: a folder, a .gguf file or the embedded model's name
    format: str  # gguf, awq, gptq, compressed-tensors, safetensors, embedded
    size_bytes: int | None  # the checkpoint's files on disk
    pinned: bool = False
    state: str = "unloaded"
    error: str | None = None
    error_mtime: float | None = None  # the source's mtime when it failed to load
    serving: OpenAIServing | None = None
    estimated_bytes: int | None = None
    leases: int = 0  # requests between resolving the model and submitting (or waiting for its load)
    waiting_for_load: int = 0
    last_used: float = field(default_factory=time.monotonic)
    loads: int = 0
    load_seconds: float | None = None
    attempts: int = 0  # loads tried (a request that waited behind a failed one does not try again)

    @property
    def engine(self) -> Any:
        return None if self.serving is None else self.serving.engine

    def busy(self) -> bool:
        """Requests are being prepared for it or run in its engine."""
        return self.leases > 0 or (self.engine is not None and self.engine.num_unfinished > 0)


def _format_of(path: Path) -> str:
    if path.suffix.lower() == ".gguf":
        return "gguf"
    try:
        import json

        qc = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return "unknown"
    method = str(qc.get("quant_method", "")).lower()
    return method or "safetensors"


def _size_of(path: Path) -> int | None:
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf"))
    except OSError:
        return None


def _mtime(source: str) -> float | None:
    path = Path(source)
    try:
        if path.is_file():
            return path.stat().st_mtime
        return max((f.stat().st_mtime for f in path.iterdir()), default=path.stat().st_mtime)
    except OSError:
        return None


def model_entry(source: str, name: str | None = None, pinned: bool = False) -> ModelEntry:
    """A :class:`ModelEntry` for ``source`` (folder, ``.gguf`` file or the embedded model's name), named ``name``
    or as ``lightinfer serve`` names a single model (the folder's name, the file's stem)."""
    from lightinfer.loader import EMBEDDED_MODELS

    if source.lower() in EMBEDDED_MODELS:
        from lightinfer.loader import resolve_model_path

        try:
            path = resolve_model_path(source)
            size = _size_of(path)
        except (OSError, ValueError):
            size = None
        return ModelEntry(name or source.lower(), source, "embedded (gguf)", size, pinned)
    path = Path(source).expanduser()
    default = path.stem if path.suffix == ".gguf" else path.name
    return ModelEntry(name or default, str(path), _format_of(path), _size_of(path), pinned)


def scan_models_dir(folder: str) -> list[ModelEntry]:
    """The models in ``folder``: each sub-folder with a ``config.json`` and each ``.gguf`` file (llama.cpp's
    ``mmproj*`` projector files left out), named by folder name / file stem, sorted by name.

    Raises:
        FileNotFoundError: no such folder. ValueError: it holds no model, or two share a name.
    """
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"--models-dir {folder}: no such folder")
    entries = [model_entry(str(p)) for p in sorted(root.iterdir())
               if (p.is_dir() and (p / "config.json").is_file())
               or (p.is_file() and p.suffix == ".gguf" and not p.name.lower().startswith("mmproj"))]
    if not entries:
        raise ValueError(f"--models-dir {folder} holds no model: put Hugging Face folders (with config.json) or "
                         ".gguf files in it")
    return entries


def estimate_model_bytes(config: EngineConfig) -> int:
    """Memory one loaded model will hold, in bytes, by the arithmetic the engine itself uses before loading.

    On a CPU: :meth:`CpuPlatform.memory_parts` (weights in the resolved dtype, the 4-/8-bit layers' CPU forms,
    the KV pool). On a GPU: the checkpoint's weights as ``lightinfer fit`` plans them, plus the KV pool the engine
    is given (``kv_cache_memory_bytes``; the pool's share of the budget otherwise).

    Raises:
        FileNotFoundError / ValueError: as opening the checkpoint does.
    """
    from types import SimpleNamespace

    from lightinfer.engine.llm_engine import resolve_config
    from lightinfer.engine.platform import CpuPlatform
    from lightinfer.loader import Checkpoint
    from lightinfer.models.registry import get_model_class

    checkpoint = Checkpoint(config.model, read_weights=False)
    resolved = resolve_config(config, checkpoint)
    if resolved.torch_device.type == "cpu":
        runner = SimpleNamespace(config=resolved, dtype=resolved.torch_dtype)
        return sum(CpuPlatform.memory_parts(runner, get_model_class(checkpoint.hf_config), checkpoint).values())
    from lightinfer.engine.fit_weights import checkpoint_plan

    return checkpoint_plan(checkpoint, resolved.torch_dtype).total + int(resolved.kv_cache_memory_bytes or 0)


def default_memory_budget(device: str) -> int | None:
    """What the pool's models may hold together: on a CPU 90% of the host's available memory now
    (``MemAvailable``), on a GPU its memory x 0.9; None where it cannot be told."""
    import torch

    from lightinfer.config import resolve_device
    from lightinfer.engine.memory import available_host_bytes

    dev = resolve_device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory * 0.9)
    available = available_host_bytes()
    return None if available is None else int(available * 0.9)


def release_memory() -> None:
    """Give freed memory back: collect cycles, empty CUDA's cache, trim glibc's heaps (``malloc_trim``)."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        logger.debug("emptying the CUDA cache failed", exc_info=True)
    trim_heap()


PARK_AFTER_S = 2.0  # an idle model's engine thread ends after this long (AsyncLLMEngine's park_after_s)


def reason_of(exc: Exception) -> str:
    """Why a model could not be loaded, for its requests: the message of the errors that explain themselves (a bad
    file or setting, a missing file, too little memory), else with the error's type."""
    if isinstance(exc, (ValueError, OSError, MemoryError)) and str(exc):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _load_engine(config: EngineConfig, max_waiting: int | None) -> Any:
    from lightinfer.engine.async_engine import AsyncLLMEngine

    return AsyncLLMEngine.from_config(config, show_progress=False, max_waiting=max_waiting, park_after_s=PARK_AFTER_S)


class ModelPool:
    """The served models of a many-model server (module docstring).

    Args:
        entries: the models, in the order ``/v1/models`` lists them (names unique).
        engine_config: the settings every model's engine gets (its ``model`` replaced per model).
        max_loaded: most models loaded at once (None: as many as the memory budget takes).
        memory_budget_bytes: what the loaded models' estimates may add up to (None: no limit).
        idle_unload_s: unload a model after this many seconds without requests (None: never).
        tool_call_parser: as ``--tool-call-parser``, for every model.
        loader: ``(config) -> AsyncLLMEngine``, started (tests pass fakes); default: load the checkpoint.
        estimator: ``(config) -> bytes`` (default :func:`estimate_model_bytes`).
    Raises:
        ValueError: no entries, a name used twice, ``max_loaded`` < 1, more pinned models than ``max_loaded``.
    """

    def __init__(self, entries: list[ModelEntry], engine_config: EngineConfig, *, max_loaded: int | None = None,
                 memory_budget_bytes: int | None = None, idle_unload_s: float | None = None,
                 tool_call_parser: str | None = None, loader: Callable[[EngineConfig], Any] | None = None,
                 estimator: Callable[[EngineConfig], int] | None = None) -> None:
        if not entries:
            raise ValueError("a model pool needs at least one model")
        seen: set[str] = set()
        for e in entries:
            if e.name in seen:
                raise ValueError(f"two models are served as {e.name!r}: give one another name "
                                 "(--served-model-name, one per model, in order)")
            seen.add(e.name)
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"--max-loaded-models must be at least 1, got {max_loaded}")
        pinned = [e.name for e in entries if e.pinned]
        if max_loaded is not None and len(pinned) > max_loaded:
            raise ValueError(f"{len(pinned)} models are pinned ({', '.join(pinned)}) but --max-loaded-models is "
                             f"{max_loaded}: pin fewer or allow more")
        if idle_unload_s is not None and idle_unload_s <= 0:
            raise ValueError(f"--idle-unload must be a positive time, got {idle_unload_s} s")
        self.entries = {e.name: e for e in entries}
        self.default_name = entries[0].name
        self.engine_config = engine_config
        self.max_loaded = max_loaded
        self.memory_budget_bytes = memory_budget_bytes
        self.idle_unload_s = idle_unload_s
        self.tool_call_parser = tool_call_parser
        self._loader = loader or (lambda cfg: _load_engine(cfg, engine_config.max_waiting))
        self._estimator = estimator or estimate_model_bytes
        self._load_lock: asyncio.Lock | None = None
        self.load_queue: list[str] = []  # models waiting to load, the first one loading
        self._idle_task: asyncio.Task | None = None
        self._on_load: list[Callable[[str, Any], None]] = []
        self._closed = False

    # ------------------------------------------------------------------ ServedModels
    def names(self) -> list[str]:
        return list(self.entries)

    def cards(self) -> list[P.ModelCard]:
        return [P.ModelCard(id=e.name, max_model_len=e.serving.max_model_len if e.serving else None,
                            state=e.state, format=e.format, size_bytes=e.size_bytes, pinned=e.pinned,
                            error=e.error) for e in self.entries.values()]

    def engines(self) -> list[Any]:
        return [e.engine for e in self.entries.values() if e.engine is not None]

    def loaded_names(self) -> list[str]:
        return [e.name for e in self.entries.values() if e.state == "loaded"]

    def entry(self, model: str) -> ModelEntry:
        """The entry named ``model``.

        Raises:
            OpenAIError: 400 for a non-text name, 404 ``model_not_found`` listing the served names.
        """
        entry = self.entries.get(check_model_name(model))
        if entry is None:
            raise unknown_model_error(model, self.names())
        return entry

    @asynccontextmanager
    async def use(self, model: str) -> AsyncIterator[OpenAIServing]:
        """The model's :class:`OpenAIServing`, loaded first if needed; it stays loaded while inside.

        Raises (on entering):
            OpenAIError: 404 / 400 as :meth:`entry`; 503 ``model_unavailable`` when it cannot be loaded (why).
        """
        entry = self.entry(model)
        entry.leases += 1
        entry.last_used = time.monotonic()
        try:
            serving = await self._ensure_loaded(entry)
            yield serving
        finally:
            entry.leases -= 1
            entry.last_used = time.monotonic()

    def add_load_listener(self, listener: Callable[[str, Any], None]) -> None:
        """Call ``listener(name, async_engine)`` on the event loop after each model loads (metrics attach here)."""
        self._on_load.append(listener)

    # ------------------------------------------------------------------ loading and unloading
    def _lock(self) -> asyncio.Lock:
        if self._load_lock is None:  # made on the event loop that uses it
            self._load_lock = asyncio.Lock()
        return self._load_lock

    async def _ensure_loaded(self, entry: ModelEntry) -> OpenAIServing:
        if entry.state == "loaded" and entry.serving is not None:
            return entry.serving
        if entry.state == "error" and _mtime(entry.source) == entry.error_mtime:
            raise self._load_error(entry)
        entry.waiting_for_load += 1
        try:
            await self.load(entry.name)
        finally:
            entry.waiting_for_load -= 1
        assert entry.serving is not None
        return entry.serving

    @staticmethod
    def _load_error(entry: ModelEntry) -> OpenAIError:
        return OpenAIError(503, f"the model `{entry.name}` could not be loaded: {entry.error}. The other models are "
                                "served; fix the model's files (or POST /models/load to try again)",
                           "server_error", param="model", code="model_unavailable")

    async def load(self, model: str, retry: bool = False) -> ModelEntry:
        """Load ``model`` (waiting for the loads queued before it and for room); returns its entry. ``retry``:
        try again even when a load of it failed while this call waited (``POST /models/load``).

        Raises:
            OpenAIError: 404 unknown; 503 when it fails to load, or cannot fit beside the pinned models.
        """
        entry = self.entry(model)
        if entry.name not in self.load_queue and entry.state != "loaded":
            self.load_queue.append(entry.name)
        attempts = entry.attempts
        try:
            async with self._lock():
                if entry.state == "loaded":
                    return entry
                if entry.state == "error" and entry.attempts != attempts and not retry:
                    raise self._load_error(entry)  # it failed while this request waited: the same reason
                entry.attempts += 1
                await self._make_room(entry)
                await self._load_now(entry)
        finally:
            if entry.name in self.load_queue:
                self.load_queue.remove(entry.name)
        if entry.state != "loaded":
            raise self._load_error(entry)
        return entry

    async def _make_room(self, entry: ModelEntry) -> None:
        loop = asyncio.get_running_loop()
        config = replace(self.engine_config, model=entry.source)
        if entry.estimated_bytes is None:
            try:  # opens the checkpoint's config and headers: a broken file fails here, before anything is unloaded
                entry.estimated_bytes = await loop.run_in_executor(None, self._estimator, config)
            except Exception as exc:  # noqa: BLE001 -- this model's requests get the reason; the others go on
                logger.error("cannot load %s: %s", entry.name, exc)
                self._fail(entry, reason_of(exc))
                raise self._load_error(entry) from None
        budget = self.memory_budget_bytes
        if budget is not None and entry.estimated_bytes > budget:
            self._fail(entry, f"it needs ~{entry.estimated_bytes / 2**30:.2f} GiB, more than the whole memory budget "
                              f"of {budget / 2**30:.2f} GiB")
            raise self._load_error(entry)
        while True:
            loaded = [e for e in self.entries.values() if e.state == "loaded"]
            used = sum(e.estimated_bytes or 0 for e in loaded)
            over_count = self.max_loaded is not None and len(loaded) >= self.max_loaded
            over_memory = budget is not None and used + entry.estimated_bytes > budget
            if not (over_count or over_memory):
                return
            movable = [e for e in loaded if not e.pinned]
            if not movable:
                why = "--max-loaded-models" if over_count else "the memory budget"
                self._fail(entry, f"every loaded model is pinned ({', '.join(e.name for e in loaded)}) and "
                                  f"{why} leaves no room", transient=True)
                raise self._load_error(entry)
            idle = [e for e in movable if not e.busy()]
            if idle:
                victim = min(idle, key=lambda e: e.last_used)
                logger.info("unloading %s (least recently used) to make room for %s", victim.name, entry.name)
                await self._unload(victim)
                continue
            await asyncio.sleep(0.05)  # every movable model is busy: wait for one to finish its requests

    def _fail(self, entry: ModelEntry, reason: str, transient: bool = False) -> None:
        entry.state, entry.error = "error", reason
        entry.error_mtime = None if transient else _mtime(entry.source)

    async def _load_now(self, entry: ModelEntry) -> None:
        loop = asyncio.get_running_loop()
        config = replace(self.engine_config, model=entry.source)
        entry.state, entry.error = "loading", None
        t0 = time.monotonic()
        logger.info("loading %s (%s)", entry.name, entry.source)
        engine = None
        try:
            engine = await loop.run_in_executor(None, self._loader, config)
            entry.serving = OpenAIServing(engine, entry.name, self.tool_call_parser)
        except Exception as exc:  # noqa: BLE001 -- this model's requests get the reason; the others go on
            logger.error("loading %s failed: %s", entry.name, exc)
            if engine is not None:
                await loop.run_in_executor(None, engine.shutdown)
            entry.serving = None
            self._fail(entry, reason_of(exc))
            release_memory()
            return
        entry.state, entry.loads = "loaded", entry.loads + 1
        entry.load_seconds = time.monotonic() - t0
        entry.last_used = time.monotonic()
        logger.info("loaded %s in %.1f s", entry.name, entry.load_seconds)
        for listener in self._on_load:
            listener(entry.name, engine)

    async def _unload(self, entry: ModelEntry) -> None:
        serving, entry.serving, entry.state = entry.serving, None, "unloaded"
        if serving is None:
            return
        engine = serving.engine
        serving.prep.shutdown(wait=False)
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        del serving, engine
        release_memory()
        logger.info("unloaded %s", entry.name)

    async def unload(self, model: str) -> ModelEntry:
        """Unload ``model`` now.

        Raises:
            OpenAIError: 404 unknown; 409 when it has requests running or being prepared (retry when they end).
        """
        entry = self.entry(model)
        async with self._lock():
            if entry.state != "loaded":
                return entry
            if entry.busy():
                n = entry.engine.num_unfinished if entry.engine is not None else 0
                raise OpenAIError(409, f"the model `{entry.name}` has {n or entry.leases} request(s) in progress; "
                                       "unload it when they have finished", param="model", code="model_busy")
            await self._unload(entry)
        return entry

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Load the pinned models and start the idle watch (the app's start-up)."""
        for entry in self.entries.values():
            if entry.pinned:
                await self.load(entry.name)
        if self.idle_unload_s is not None:
            self._idle_task = asyncio.create_task(self._watch_idle())

    async def _watch_idle(self) -> None:
        assert self.idle_unload_s is not None
        period = min(1.0, self.idle_unload_s / 4)
        while not self._closed:
            await asyncio.sleep(period)
            now = time.monotonic()
            for entry in list(self.entries.values()):
                if entry.state != "loaded" or entry.pinned:
                    continue
                if entry.busy():
                    entry.last_used = now
                elif now - entry.last_used >= self.idle_unload_s:
                    async with self._lock():
                        if entry.state == "loaded" and not entry.busy():
                            logger.info("unloading %s: idle for %.0f s", entry.name, now - entry.last_used)
                            await self._unload(entry)

    async def close(self) -> None:
        """Stop the idle watch and every engine (the app's shutdown)."""
        self._closed = True
        if self._idle_task is not None:
            self._idle_task.cancel()
        for entry in self.entries.values():
            if entry.serving is not None:
                await self._unload(entry)

    @property
    def is_running(self) -> bool:
        """Every loaded model's engine loop is alive (a pool with none loaded is healthy)."""
        return not self._closed and all(e.is_running for e in self.engines())

    def stats(self) -> dict[str, Any]:
        """``/stats`` of a many-model server: each model's state, its requests waiting for the load and its position
        in the load queue, and a loaded model's engine counters (``engine``, as a one-model ``/stats``)."""
        now = time.monotonic()
        models = {}
        for e in self.entries.values():
            models[e.name] = {
                "state": e.state, "format": e.format, "size_bytes": e.size_bytes, "pinned": e.pinned,
                "estimated_bytes": e.estimated_bytes, "error": e.error, "waiting_for_load": e.waiting_for_load,
                "load_queue_position": self.load_queue.index(e.name) if e.name in self.load_queue else None,
                "idle_seconds": None if e.state != "loaded" else round(now - e.last_used, 1),
                "loads": e.loads, "load_seconds": e.load_seconds,
                "engine": vars(e.engine.get_stats()) if e.engine is not None else None,
            }
        return {"models": models, "loaded": self.loaded_names(), "load_queue": list(self.load_queue),
                "max_loaded_models": self.max_loaded, "memory_budget_bytes": self.memory_budget_bytes,
                "idle_unload_seconds": self.idle_unload_s}
