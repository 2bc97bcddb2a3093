"""Ratios of lightinfer's entries against the peers measured in the same run, and the markdown tables.

Ratios are lightinfer / peer. For times and memory (TTFT, TPOT, peak RSS, start-up) below 1.0 is
better for lightinfer; for output tokens/s above 1.0 is. "best peer" divides by the best peer
figure of each column, which is what the targets of issue 21 are stated against.
"""

from __future__ import annotations

from typing import Any

MIB = 1024 * 1024


def _metric(load: str, name: str) -> Any:
    return lambda s: (s.get("loads", {}).get(load) or {}).get(name)


def ratio_columns(loads: list[str]) -> list[tuple[str, Any, bool]]:
    """The compared figures: TPOT, TTFT (means, ms) and output tok/s per load, then peak RSS and start-up.

    Each is (key in a ratio row, how to read it from a server entry, True when higher is better).
    """
    cols: list[tuple[str, Any, bool]] = []
    for load in loads:
        cols += [(f"{load}u_tpot", _metric(load, "mean_tpot_ms"), False),
                 (f"{load}u_ttft", _metric(load, "mean_ttft_ms"), False),
                 (f"{load}u_tok_s", _metric(load, "output_tok_s"), True)]
    cols += [("peak_rss", lambda s: s.get("peak_rss_bytes"), False),
             ("startup", lambda s: s.get("startup_s"), False)]
    return cols


def _div(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratios(servers: list[dict[str, Any]], loads: list[str]) -> list[dict[str, Any]]:
    """One row per (lightinfer entry, peer), plus one per entry against the best peer of each column."""
    peers = [s for s in servers if s["peer"] and "error" not in s]
    rows = []
    cols = ratio_columns(loads)
    for ours in (s for s in servers if not s["peer"] and "error" not in s):
        for peer in peers:
            rows.append({"server": ours["label"], "against": peer["label"],
                         **{key: _div(get(ours), get(peer)) for key, get, _ in cols}})
        if len(peers) > 1:
            best: dict[str, Any] = {"server": ours["label"], "against": "best peer"}
            for key, get, higher in cols:
                values = [v for v in (get(p) for p in peers) if v]
                best[key] = _div(get(ours), (max if higher else min)(values)) if values else None
            rows.append(best)
    return rows


def _f(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _triple(load: dict[str, Any], metric: str) -> str:
    return " / ".join(_f(load.get(f"{stat}_{metric}_ms")) for stat in ("mean", "median", "p99"))


def markdown(result: dict[str, Any]) -> str:
    """The tables of one run: conditions, servers, one table per load, ratios."""
    meta, settings, servers = result["meta"], result["settings"], result["servers"]
    loads = [str(load["concurrency"]) for load in settings["loads"]]
    busy = [s["label"] for s in servers if not s.get("machine_idle", True)]
    lines = [
        "# CPU serving: lightinfer against llama.cpp and vLLM's CPU build",
        "",
        (f"Taken {meta['date']} on {meta['cpu']}, {meta['cores']} usable cores, {meta['memory_gib']} GiB RAM "
         f"(lightinfer {meta['lightinfer_commit']})."),
        (f"Client: `vllm bench serve` against each server's `/v1/completions`: random prompts of "
         f"{settings['input_len']} tokens (seed {settings['seed']}), {settings['output_len']} output tokens, "
         "`--ignore-eos`; ") + ", ".join(f"{load['num_prompts']} requests at {load['concurrency']} user(s)"
                                        for load in settings["loads"]) + ". One run; only ratios carry over.",
        "",
    ]
    if meta.get("note"):
        lines += [meta["note"], ""]
    if meta.get("isa"):
        lines += [f"Instruction sets: {meta['isa']}.", ""]
    lines += [f"- {s['label']}: {s['note']}" for s in servers if s.get("note")]
    if any(s.get("note") for s in servers):
        lines.append("")
    if busy:
        lines += [(f"**The machine was not idle** while measuring {', '.join(busy)} (other processes used CPU; "
                   "see `idle_checks` in the JSON): these figures are noise, rerun on an idle machine."), ""]
    lines += ["| server | weights | peak RSS MiB (PSS) | start-up s | idle server, % of a core | machine idle |",
              "|---|---|---|---|---|---|"]
    for s in servers:
        if "error" in s:
            lines.append(f"| {s['label']} | {s['weights']} | failed: {s['error'].splitlines()[0]} | | | |")
            continue
        idle = s.get("idle_cpu_cores")
        lines.append(f"| {s['label']} | {s['weights']} | {_f(s['peak_rss_bytes'] / MIB, 0)} "
                     f"({_f(s['peak_pss_bytes'] / MIB, 0)}) | {_f(s['startup_s'])} | "
                     f"{_f(None if idle is None else 100 * idle)} | {'yes' if s.get('machine_idle') else 'NO'} |")
    for load in settings["loads"]:
        key = str(load["concurrency"])
        lines += ["", f"## {key} user(s), {load['num_prompts']} requests", "",
                  ("| server | TTFT ms mean / median / p99 | TPOT ms mean / median / p99 | output tok/s | failed "
                   "| cores: server / others |"),
                  "|---|---|---|---|---|---|"]
        for s in servers:
            got = s.get("loads", {}).get(key)
            if got:
                lines.append(f"| {s['label']} | {_triple(got, 'ttft')} | {_triple(got, 'tpot')} | "
                             f"{_f(got['output_tok_s'])} | {got['failed']} | {_f(got.get('server_cores'), 2)} / "
                             f"{_f(got.get('others_cores'), 2)} |")
    if any((s.get("loads", {}).get(k) or {}).get("failed") for s in servers for k in loads):
        lines += ["", ("failed: requests that got no full answer (their tokens are not in tok/s); the client's "
                       "log in `.peers/logs/` has the errors. llama-server's are connection resets: it closes a "
                       "keep-alive connection idle for 5 s (cpp-httplib's default) and the client's pool reuses it "
                       "(\"Cannot write to closing transport\"), seen when the server is slowed by other load.")]
    rows = result["ratios"]
    if rows:
        cols = [key for key, _, _ in ratio_columns(loads)]
        names = {f"{k}u_tpot": f"{k}u TPOT" for k in loads} | {f"{k}u_ttft": f"{k}u TTFT" for k in loads} | {
            f"{k}u_tok_s": f"{k}u tok/s" for k in loads} | {"peak_rss": "peak RSS", "startup": "start-up"}
        lines += ["", "## Ratios, lightinfer / peer (same run)", "",
                  ("Times (TTFT, TPOT: means), peak RSS and start-up: below 1.0 is better for lightinfer; "
                   "output tok/s: above 1.0 is better."), "",
                  "| server | against | " + " | ".join(names[c] for c in cols) + " |",
                  "|---|---|" + "---|" * len(cols)]
        for row in rows:
            lines.append(f"| {row['server']} | {row['against']} | "
                         + " | ".join(_f(row[c], 2) for c in cols) + " |")
    return "\n".join(lines) + "\n"
