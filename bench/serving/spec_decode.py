"""Speculative decoding on the CPU: tokens/s with speculation off, with prompt-lookup drafts and with suffix
drafts, one run.

SmolLM2 from its GGUF (or ``--model``), greedy, through the public API (``LLM.generate`` on chat prompts, the
engine's ``get_stats().spec_decode`` for the acceptance). Two kinds of prompts:

  * copy-heavy: repeat a 40-line code file with one name changed, quote a given text back, repeat a JSON document
    with one field changed (the output copies long runs of the prompt);
  * open chat: questions whose answers copy nothing.

Each kind at 1 user (the prompts one after another) and at 16 users (16 requests at once, the batcher's
continuous batching), the engines (speculation off, ``ngram``, ``suffix``; the same weights, one process)
interleaved over ``--rounds`` rounds. The figure per setting is output tokens / wall seconds, the median of the
rounds; greedy outputs are compared token for token with speculation off. The suffix engine keeps finished
outputs: from the second round on it has seen the same requests' answers, as an agent's repeated calls let it
(its first round, ``rounds_tok_s[...][0]``, is the figure without that). Writes
``bench/results/spec_decode.json``.

    .venv/bin/python -m bench.serving.spec_decode [--rounds 3] [--max-tokens 160] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common.machine import cpu_name, machine_load
from bench.common.results import RESULTS, write_result
from lightinfer import LLM, SamplingParams

CODE = """\
import json
from pathlib import Path


def load_config(path):
    with open(path) as f:
        data = json.load(f)
    if 'name' not in data:
        raise ValueError('config needs a name')
    return data


def save_config(path, data):
    text = json.dumps(data, indent=2)
    Path(path).write_text(text)


def merge(base, extra):
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def main():
    base = load_config('base.json')
    extra = load_config('extra.json')
    merged = merge(base, extra)
    save_config('merged.json', merged)
    print('merged', len(merged), 'keys')


if __name__ == '__main__':
    main()
"""
TEXT = ("The harbour town woke early. Fishing boats left before dawn, and by seven the market stalls were full of "
        "crates of sardines, mackerel and crabs. Tourists arrived later, after the ferry from the mainland, and "
        "walked along the sea wall to the old lighthouse, which had not been lit since 1962. In the afternoon the "
        "wind turned, the boats came back, and the cafes on the square filled with people waiting for the evening "
        "concert in the church.")
JSON_DOC = ('{"id": 4182, "name": "Ada Smith", "email": "ada.smith@example.com", "active": true, "roles": ["admin", '
            '"editor"], "address": {"street": "12 Harbour Road", "city": "Portsmouth", "zip": "PO1 2AB"}, '
            '"last_login": "2026-11-30T08:15:00Z", "plan": "team", "seats": 12}')
COPY_HEAVY = [
    f"Rename the function `merge` to `deep_merge` everywhere in this file and print the whole file:\n\n{CODE}",
    f"Repeat the following text word for word, then say nothing else:\n\n{TEXT}",
    f"Print this JSON document again with \"seats\" set to 20 and nothing else changed:\n\n{JSON_DOC}",
]
OPEN_CHAT = ["What should I see in Lisbon in two days?", "Explain how a bicycle gear works.",
             "Write a short poem about autumn rain.", "Give me three ideas for a birthday party."]


def _messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def _run(llm: LLM, prompts: list[str], users: int, max_tokens: int) -> tuple[float, int, list[list[int]]]:
    """Tokens/s for ``prompts`` at ``users`` concurrent requests (one batch of that many, repeated to cover
    ``prompts``); returns (tok/s, tokens, outputs' ids)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    batch = (prompts * (users // len(prompts) + 1))[:users] if users > 1 else prompts
    start = time.perf_counter()
    tokens, ids = 0, []
    if users == 1:
        for p in batch:
            out = llm.chat(_messages(p), params, use_tqdm=False)[0].outputs[0]
            tokens += len(out.token_ids)
            ids.append(out.token_ids)
    else:
        for out in llm.chat([_messages(p) for p in batch], params, use_tqdm=False):
            tokens += len(out.outputs[0].token_ids)
            ids.append(out.outputs[0].token_ids)
    return tokens / (time.perf_counter() - start), tokens, ids


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--users", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--methods", nargs="+", default=["ngram", "suffix"], choices=["ngram", "suffix"])
    ap.add_argument("--kinds", nargs="+", default=["copy-heavy", "open chat"], choices=["copy-heavy", "open chat"])
    ap.add_argument("--name", default="spec_decode")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 2},
             "suffix": {"method": "suffix", "num_speculative_tokens": args.k}}
    engines = {"off": LLM(args.model, show_progress=False, max_num_seqs=32)}
    for name in args.methods:
        engines[name] = LLM(args.model, show_progress=False, max_num_seqs=32, speculative_config=specs[name])
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_name(),
                              "machine": machine_load(), "model": args.model,
                              "speculative_config": {m: specs[m] for m in args.methods},
                              "rounds": args.rounds, "max_tokens": args.max_tokens, "greedy": True, "runs": {}}
    for kind, prompts in (("copy-heavy", COPY_HEAVY), ("open chat", OPEN_CHAT)):
        if kind not in args.kinds:
            continue
        for users in args.users:
            for name, llm in engines.items():  # warm: records the CPU steps of these shapes
                _run(llm, prompts[:1], 1, 16)
            rates: dict[str, list[float]] = {name: [] for name in engines}
            same = {name: True for name in args.methods}
            before = {m: engines[m].llm_engine.get_stats().spec_decode for m in args.methods}
            for r in range(args.rounds):
                order = list(engines) if r % 2 == 0 else list(reversed(engines))
                outs = {}
                for name in order:
                    rate, tokens, outs[name] = _run(engines[name], prompts, users, args.max_tokens)
                    rates[name].append(rate)
                    print(f"{kind:10s} {users:2d} user(s) round {r} {name:6s}: {rate:7.1f} tok/s ({tokens} tokens)",
                          flush=True)
                for m in args.methods:
                    same[m] = same[m] and outs["off"] == outs[m]
            key = f"{kind}/{users}"
            run: dict[str, Any] = {"tok_s": {n: round(statistics.median(v), 1) for n, v in rates.items()},
                                   "rounds_tok_s": rates}
            for m in args.methods:
                after = engines[m].llm_engine.get_stats().spec_decode
                drafted = after["num_draft_tokens"] - before[m]["num_draft_tokens"]
                accepted = after["num_accepted_tokens"] - before[m]["num_accepted_tokens"]
                run[m] = {"speedup": round(run["tok_s"][m] / run["tok_s"]["off"], 3), "draft_tokens": drafted,
                          "accepted_tokens": accepted, "acceptance": round(accepted / drafted, 3) if drafted else None,
                          "verify_runs": after["num_drafts"] - before[m]["num_drafts"], "greedy_identical": same[m]}
            result["runs"][key] = run
            print(key, json.dumps(run), flush=True)
    result["step_costs_ms"] = {m: {rows: round(1e3 * c, 2) for rows, c in
                                   sorted(engines[m].llm_engine.speculator.policy.costs.items())}
                               for m in args.methods}
    path = write_result(args.name, result, out_dir=args.out_dir)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
