"""AsyncLLMEngine: one background thread drives ``LLMEngine.step()``; many asyncio clients stream.

::

    client coroutines (HTTP, Gradio)            engine thread (the only caller of LLMEngine)
    ─────────────────────────────────           ─────────────────────────────────────────────
    add_request() ──► command queue ──────────► engine.add_request()  ─► accepted / ValueError
                                                loop: engine.step() ─► RequestOutputs
    async for out in stream ◄── call_soon_threadsafe(stream.put) ◄──┘
    abort()       ──► command queue ──────────► engine.abort_request()  (frees its KV blocks)

The engine is not thread-safe, so every call to it happens on that one thread; clients only
touch thread-safe queues and a stats snapshot. No lock is held around generation: all clients'
requests run in the same continuous batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from lightinfer.inputs import EngineRequest, InputProcessor, PromptType
from lightinfer.outputs import RequestOutput
from lightinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lightinfer.config import EngineConfig
    from lightinfer.engine.llm_engine import EngineStats

logger = logging.getLogger(__name__)

_FINISHED = object()  # end-of-stream sentinel put after an abort
_MAX_CONSECUTIVE_STEP_FAILURES = 5  # then the engine is declared dead instead of spinning


class EngineOverloadedError(RuntimeError):
    """More than ``max_waiting`` requests are queued; the request was refused (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down, or failed repeatedly); no request can be served."""


class RequestFailedError(RuntimeError):
    """An engine step failed while this request was in it; the request was aborted."""


class RequestObserver(Protocol):
    """Receives per-request timing from the engine thread (e.g. Prometheus metrics)."""

    def on_first_token(self, seconds: float) -> None: ...
    def on_inter_token(self, seconds: float) -> None: ...
    def on_finished(self, finish_reason: str, seconds: float) -> None: ...
    def on_rejected(self) -> None: ...


class EngineCore(Protocol):
    """What the engine thread calls on the engine it serves: ``LLMEngine``'s interface (tests serve a fake)."""

    config: EngineConfig
    tokenizer: Any  # a Hugging Face tokenizer, or None for a checkpoint served from token ids
    input_processor: InputProcessor

    def add_request(self, request_id: str, prompt: PromptType | EngineRequest,
                    sampling_params: SamplingParams | None = None) -> None: ...
    def abort_request(self, request_id: str) -> RequestOutput | None: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def get_stats(self) -> EngineStats: ...
    def model_info(self) -> dict[str, Any]: ...


# ---------------------------------------------------------------- commands: client threads -> engine thread
@dataclass(frozen=True)
class AddRequest:
    """Hand a request to the engine; ``accepted`` resolves once the engine took it (or with its ValueError)."""

    request_id: str
    prompt: PromptType | EngineRequest
    sampling_params: SamplingParams | None
    stream: RequestStream
    accepted: concurrent.futures.Future[None]


@dataclass(frozen=True)
class AbortRequest:
    """Abort a request (unknown or finished ids are ignored); its stream ends."""

    request_id: str


@dataclass(frozen=True)
class Wake:
    """Wake an idle engine thread so it sees the stop flag (sent by :meth:`AsyncLLMEngine.shutdown`)."""


EngineCommand = AddRequest | AbortRequest | Wake


class RequestStream:
    """The asyncio side of one request: an async iterator of cumulative ``RequestOutput``s.

    Filled from the engine thread with :meth:`put`. When the reader is slower than the engine,
    queued outputs are collapsed to the newest one (outputs are cumulative, nothing is lost).
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._done = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the reader runs on."""
        return self._loop

    def put(self, item: RequestOutput | BaseException | object) -> None:
        """Thread-safe: hand an output, an exception or the end sentinel to the reader."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the client's event loop is closed: nobody is reading any more
            pass

    def put_nowait(self, item: RequestOutput | BaseException | object) -> None:
        """On the reader's event loop only: queue ``item`` for the reader."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not self._queue.empty() and isinstance(item, RequestOutput) and not item.finished:
            item = self._queue.get_nowait()  # newer cumulative output supersedes this one
        if item is _FINISHED:
            self._done = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item


def _deliver(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    """On a reader's event loop: queue one step's outputs for their streams."""
    for stream, out in items:
        stream.put_nowait(out)


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one in-flight request (timing for the observers)."""

    stream: RequestStream
    arrival: float
    last_token_time: float | None = None
    num_tokens: list[int] = field(default_factory=list)  # per completion


class AsyncLLMEngine:
    """Serve one ``LLMEngine`` to many asyncio clients.

    Args:
        engine: an ``LLMEngine`` (or anything with its :class:`EngineCore` interface); from now on only the
            background thread may call it.
        max_waiting: most requests queued to run beyond the ``max_num_seqs`` that run at once; past it
            new ones are refused with :class:`EngineOverloadedError`; None = ``engine.config.max_waiting``.
            So ``max_waiting + max_num_seqs`` requests are admitted at once: those still being handed to
            the engine count as the engine's waiting ones do, the first ``max_num_seqs`` of them as
            running (the next step schedules them), not as queued.
        park_after_s: let the engine thread end after this many idle seconds and start a new one with the next
            command (None: never). Each thread that ran a CPU op keeps an OpenMP team; while an idle model's team
            lives, libgomp manages more threads than there are cores and cuts every team's spinning, which slowed
            a busy neighbour's decode by ~12% (``bench/results/model_pool.json``). A many-model server parks its
            engines; a one-model server keeps its thread.
    """

    def __init__(self, engine: EngineCore, max_waiting: int | None = None, park_after_s: float | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        # The engine's input processor: front ends take a copy (own tokenizer) and submit EngineRequests,
        # so the engine thread never tokenizes.
        self.input_processor = engine.input_processor
        self.max_waiting = max_waiting if max_waiting is not None else engine.config.max_waiting
        self.max_num_seqs = int(getattr(engine.config, "max_num_seqs", 1))
        self._model_info = engine.model_info()
        self._stats = engine.get_stats()
        self._commands: queue.Queue[EngineCommand] = queue.Queue()
        self._num_pending = 0  # submitted, not yet handed to the engine
        self._pending_lock = threading.Lock()
        self._requests: dict[str, _Tracked] = {}  # engine thread only
        self._observers: list[RequestObserver] = []
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._dead: str | None = None
        self._thread: threading.Thread | None = None
        self.park_after_s = park_after_s
        self._parked = False  # the loop ended while idle; the next command starts it again (see _send)
        self._park_lock = threading.Lock()
        self.num_parks = 0

    @classmethod
    def from_config(cls, config: EngineConfig, *, show_progress: bool = True, max_waiting: int | None = None,
                    park_after_s: float | None = None) -> AsyncLLMEngine:
        """Load the model on the engine's own thread and start the loop there; what ``lightinfer serve`` does.

        Why a CPU server should start this way: torch runs its CPU ops on an OpenMP thread team, one team
        per thread that ever ran a parallel op. Once two threads have teams (the main thread that loaded
        the model and an engine thread that steps it), libgomp manages more threads than there are cores
        and stops its workers from spinning between ops, so each of the thousands of ops of a decode step
        waits for a futex wake-up: on 2 idle cores (2026-12-01) one user's decode took 35 ms per token
        from a second thread against 12 ms from the loading one. Loading where the loop runs keeps one team.

        Args:
            config: a :class:`lightinfer.config.EngineConfig`.
            show_progress: print the loading phases (as :class:`LLMEngine` does).
            max_waiting, park_after_s: as in the constructor.
        Returns:
            a started engine (``start()`` is then a no-op; ``shutdown()`` stops it).
        Raises:
            whatever ``LLMEngine(config)`` raises (FileNotFoundError, ValueError, ...), re-raised here.
        """
        from lightinfer.engine.llm_engine import LLMEngine

        loaded: concurrent.futures.Future[LLMEngine] = concurrent.futures.Future()
        owner: queue.Queue[AsyncLLMEngine | None] = queue.Queue(maxsize=1)

        def boot() -> None:
            try:
                engine = LLMEngine(config, show_progress=show_progress)
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller, who raises it
                loaded.set_exception(exc)
                return
            loaded.set_result(engine)
            served = owner.get()
            if served is not None:
                served._run()

        thread = threading.Thread(target=boot, name="lightinfer-engine", daemon=True)
        thread.start()
        engine = loaded.result()
        try:
            served = cls(engine, max_waiting=max_waiting, park_after_s=park_after_s)
        except BaseException:
            owner.put(None)
            raise
        served._thread = thread
        owner.put(served)
        return served

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the background loop (idempotent; a parked loop starts with its next command)."""
        with self._park_lock:
            if self._parked or (self._thread is not None and self._thread.is_alive()):
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="lightinfer-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight end with :class:`EngineDeadError`."""
        self._stop.set()
        with self._park_lock:
            self._parked = False
            self._commands.put(Wake())
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    @property
    def is_running(self) -> bool:
        """True while the loop thread is alive and healthy (or parked: see ``park_after_s``)."""
        if self._dead is not None or self._stop.is_set():
            return False
        return self._parked or (self._thread is not None and self._thread.is_alive())

    def _send(self, cmd: EngineCommand) -> None:
        """Queue ``cmd`` for the engine thread, starting a new one when the last one parked."""
        with self._park_lock:
            self._commands.put(cmd)
            if not self._parked:
                return
            self._parked = False
            self._thread = threading.Thread(target=self._resume, name="lightinfer-engine", daemon=True)
            self._thread.start()

    def _resume(self) -> None:
        threads = getattr(getattr(self.engine, "model_runner", None), "cpu_threads", None)
        if threads is not None:  # torch's thread count is the thread's own setting: this thread's steps' count
            threads.for_steps()
        self._run()

    def add_observer(self, observer: RequestObserver) -> None:
        """Register a receiver of per-request timing (called on the engine thread; keep it cheap)."""
        self._observers.append(observer)

    # ---------------------------------------------------------------- client API (any thread / loop)
    def model_info(self) -> dict[str, Any]:
        """The engine's ``model_info()``, read once at start (it does not change), except a CPU engine's
        ``cpu_threads``, which is read now (the automatic thread count follows other processes' load)."""
        info = dict(self._model_info)
        threads = getattr(getattr(self.engine, "model_runner", None), "cpu_threads", None)
        if threads is not None:
            info["cpu_threads"] = threads.info()
        return info

    def get_stats(self) -> EngineStats:
        """The newest ``EngineStats`` snapshot (taken on the engine thread after each step/command)."""
        return self._stats

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not yet ended (any thread): those waiting to be handed to the engine and those
        it holds. Never too low: a request enters the engine thread's table before it leaves the pending count,
        so for a moment it may count twice."""
        with self._pending_lock:
            return self._num_pending + len(self._requests)

    def new_request_id(self, prefix: str = "req") -> str:
        """A process-unique request id."""
        return f"{prefix}-{next(self._ids)}-{time.monotonic_ns() % 10**9}"

    async def add_request(
        self, request_id: str, prompt: PromptType | EngineRequest, sampling_params: SamplingParams | None = None
    ) -> RequestStream:
        """Submit a request and wait until the engine accepted it.

        Args:
            request_id: a unique id (see :meth:`new_request_id`).
            prompt: an :class:`EngineRequest` made by a copy of :attr:`input_processor` (what the
                front ends send), or a plain prompt that the engine thread processes.
            sampling_params: for a plain prompt; an EngineRequest carries its own.

        Returns:
            the request's stream of cumulative outputs (the last one has ``finished=True``;
            an aborted request's stream just ends).
        Raises:
            EngineOverloadedError: ``max_waiting`` requests are already queued.
            EngineDeadError: the loop is not running.
            ValueError: the engine refused the prompt or parameters (nothing was queued).
        """
        if not self.is_running:
            raise EngineDeadError(self._dead or "the engine loop is not running")
        with self._pending_lock:
            s = self._stats
            in_flight = self._num_pending + s.num_waiting + s.num_running  # all but this one
            if in_flight >= self.max_waiting + self.max_num_seqs:
                for obs in self._observers:
                    obs.on_rejected()
                raise EngineOverloadedError(
                    f"server overloaded: {self.max_waiting} requests are already waiting; retry later"
                )
            self._num_pending += 1
        stream = RequestStream(request_id, asyncio.get_running_loop())
        accepted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._send(AddRequest(request_id, prompt, sampling_params, stream, accepted))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add: the engine drops it right away
            raise
        return stream

    async def generate(
        self, prompt: PromptType | EngineRequest, sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit and stream; leaving the loop early (break, cancel, disconnect) aborts the request.

        Raises: as :meth:`add_request`, and :class:`RequestFailedError` mid-stream.
        """
        request_id = request_id or self.new_request_id()
        stream = await self.add_request(request_id, prompt, sampling_params)
        finished = False
        try:
            async for out in stream:
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Thread-safe: abort a request at the engine's next turn (its blocks are freed then).

        Unknown or already finished ids are ignored; the request's stream ends.
        """
        self._send(AbortRequest(request_id))

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            idle = not self.engine.has_unfinished_requests()
            if not self._drain_commands(block=idle) and idle and self._park():
                return  # parked: the thread ends, with its OpenMP team; the next command starts another
            if self._stop.is_set() or not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # report to the affected requests; the loop lives on
                failures += 1
                logger.exception("engine step failed (%d in a row)", failures)
                self._fail_all(RequestFailedError(f"engine step failed: {type(exc).__name__}: {exc}"))
                if failures >= _MAX_CONSECUTIVE_STEP_FAILURES:
                    self._dead = f"engine failed {failures} steps in a row: {exc}"
                    break
                continue
            failures = 0
            self._stats = self.engine.get_stats()  # before dispatch: a finished client sees its blocks freed
            self._dispatch(outputs)
        reason = self._dead or "the engine was shut down"
        self._fail_all(EngineDeadError(reason))
        self._reject_queued(EngineDeadError(reason))

    def _park(self) -> bool:
        """End the loop, when nothing has been queued meanwhile (``park_after_s``); whether it did."""
        with self._park_lock:
            if not self._commands.empty() or self._stop.is_set():
                return False
            self._parked = True
            self.num_parks += 1
        return True

    def _drain_commands(self, block: bool) -> bool:
        """Run queued adds/aborts in order; when idle, sleep until a command arrives (:meth:`shutdown` sends one:
        no timeout, so an idle engine thread never wakes) or, with ``park_after_s``, that long. Whether a command
        ran."""
        try:
            cmd = self._commands.get(timeout=self.park_after_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        handed = 0
        while True:
            handed += isinstance(cmd, AddRequest)
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self._stats = self.engine.get_stats()
        # Only now, with the stats counting them as the engine's, do the handed requests stop counting as
        # pending: in between, admission control would see them nowhere and let too many in.
        with self._pending_lock:
            self._num_pending -= handed
        return True

    def _handle(self, cmd: EngineCommand) -> None:
        if isinstance(cmd, AddRequest):
            if not cmd.accepted.set_running_or_notify_cancel():  # the client gave up while queued
                return
            try:
                if cmd.request_id in self._requests:
                    raise ValueError(f"request id {cmd.request_id!r} is already in use")
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.sampling_params)
            except Exception as exc:  # noqa: BLE001 -- whatever add_request raises, only this request is refused
                cmd.accepted.set_exception(exc if isinstance(exc, ValueError) else ValueError(str(exc)))
                return
            params = cmd.prompt.sampling_params if isinstance(cmd.prompt, EngineRequest) else cmd.sampling_params
            n = getattr(params or SamplingParams(), "n", 1)  # PoolingParams (an embedding request): one output
            self._requests[cmd.request_id] = _Tracked(cmd.stream, time.monotonic(), num_tokens=[0] * n)
            cmd.accepted.set_result(None)
        elif isinstance(cmd, AbortRequest):
            tracked = self._requests.pop(cmd.request_id, None)
            try:
                self.engine.abort_request(cmd.request_id)
            except Exception:
                logger.exception("abort of %s failed", cmd.request_id)
            if tracked is not None:
                for obs in self._observers:
                    obs.on_finished("abort", time.monotonic() - tracked.arrival)
                tracked.stream.put(_FINISHED)
        # Wake: nothing to do; it only ended the idle wait in _drain_commands

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        # One hand-off per event loop and step, not one per request: each call_soon_threadsafe wakes the
        # loop (a write to its self-pipe), and every wake-up takes a core from the next step's threads.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            tracked = self._requests.get(out.request_id)
            if tracked is None:  # aborted meanwhile
                continue
            # an embedding request's output (EmbeddingRequestOutput) has no tokens
            counts = [len(c.token_ids) for c in out.outputs] if isinstance(out, RequestOutput) else []
            if sum(counts) > sum(tracked.num_tokens):
                for obs in self._observers:
                    if tracked.last_token_time is None:
                        obs.on_first_token(now - tracked.arrival)
                    else:
                        obs.on_inter_token(now - tracked.last_token_time)
                tracked.last_token_time = now
                tracked.num_tokens = counts
            if out.finished:
                del self._requests[out.request_id]
                reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "stop") \
                    if isinstance(out, RequestOutput) else "stop"
                for obs in self._observers:
                    obs.on_finished(reason, now - tracked.arrival)
            batches.setdefault(tracked.stream.loop, []).append((tracked.stream, out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: nobody is reading any more
                pass

    def _fail_all(self, exc: Exception) -> None:
        """End every in-flight request with ``exc`` and drop it from the engine."""
        for request_id, tracked in list(self._requests.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s after a failed step failed", request_id)
            tracked.stream.put(exc)
            for obs in self._observers:
                obs.on_finished("error", time.monotonic() - tracked.arrival)
        self._requests.clear()
        try:
            self._stats = self.engine.get_stats()
        except Exception:  # a broken engine keeps its last snapshot
            logger.exception("get_stats failed after a failed step")

    def _reject_queued(self, exc: Exception) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, AddRequest):
                with self._pending_lock:
                    self._num_pending -= 1
                if cmd.accepted.set_running_or_notify_cancel():
                    cmd.accepted.set_exception(exc)
