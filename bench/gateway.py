"""Structured-output benchmark (#15): every figure is measured side by side in this process, on the engine.

    python -m bench.gateway [--quick] [--out PATH]   ->  bench/results/gateway.json, bench/results/gateway.png

- constrained_mix_throughput_ratio: decode tokens/s of a batch where half the requests follow a JSON schema
  over the same batch all free, both decoding exactly `max_tokens` tokens, steps interleaved on two engines;
  the median of ROUNDS rounds (goal >= 0.9);
- compile_ms_first / compile_ms_cached per schema: a fresh GrammarCache compiling it / answering it again;
- mask_us_per_row: the constrained rows' share of a step, per row.

`--quick` is a smoke run of the same code (JSON under .run/bench-quick/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from libs.engine import EngineConfig, EngineCore, Request, SamplingParams
from libs.engine.grammar import GrammarCache
from libs.engine.request import GrammarSpec
from libs.model import load_model, load_tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
QUICK_RESULTS = RESULTS.parent.parent / ".run" / "bench-quick"
GOALS = {"constrained_mix_throughput_ratio": (">=", 0.9)}
HEADLINE_KEYS = ("constrained_mix_throughput_ratio", "mask_us_per_row")  # top-level keys of gateway.json
BATCH = 32
MAX_TOKENS = 64
ROUNDS = 5
COMPILES = 5  # fresh compiles per schema (median)
QUICK = {"BATCH": 8, "MAX_TOKENS": 16, "ROUNDS": 1, "COMPILES": 1}  # --quick: these module sizes instead
LONG_TEXT = {"type": "object", "properties": {"text": {"type": "string", "minLength": 200, "maxLength": 400}},
             "required": ["text"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age"], "additionalProperties": False}
WIDE = {"type": "object", "properties": {f"field_{i}": {"anyOf": [{"type": "integer"}, {"type": "string"},
                                                                  {"enum": ["a", "b", "c"]}]} for i in range(24)},
        "required": [f"field_{i}" for i in range(0, 24, 2)], "additionalProperties": False}
TOOL_CALL = {"anyOf": [{"type": "object", "properties": {"name": {"const": f"tool_{i}"}, "arguments": PERSON},
                        "required": ["name", "arguments"], "additionalProperties": False} for i in range(4)]}
SCHEMAS = {"long_text": LONG_TEXT, "person": PERSON, "wide_24_fields": WIDE, "tool_call_4_tools": TOOL_CALL}


def make_core(model, cfg, tok) -> EngineCore:
    config = EngineConfig(page_size=16, num_full_pages=2048, num_swa_pages=1024, max_num_batched_tokens=1024,
                          max_num_seqs=64, bucket_edges=())
    return EngineCore(config, model, cfg, tok)


def prompt(tok, i: int) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": f"request {i}: describe it as JSON"}]))


def add_batch(core: EngineCore, tok, constrained_share: float, round_: int) -> None:
    spec = GrammarSpec("json_schema", json.dumps(LONG_TEXT))
    n_constrained = int(BATCH * constrained_share)
    for i in range(BATCH):
        seed = round_ * 1000 + i
        params = (SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, grammar=spec) if i < n_constrained
                  else SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, ignore_eos=True))
        core.add_request(Request(f"r{round_}-{constrained_share}-{i}", prompt(tok, i), params))


def prefill(core: EngineCore) -> int:
    """Step until every request of the batch is decoding (prefill is not what is measured); tokens produced."""
    produced = 0
    while len(core.scheduler.running) < BATCH or any(s.num_computed < s.num_prompt for s in core.scheduler.running):
        produced += sum(len(o.new_token_ids) for o in core.step())
    return produced


def interleaved_rates(free: EngineCore, mixed: EngineCore, tok, round_: int) -> tuple[float, float]:
    """Decode tokens/s of an all-free and a 50/50 batch, their steps interleaved one for one, so that whatever
    else loads the machine slows both alike."""
    add_batch(free, tok, 0.0, round_)
    add_batch(mixed, tok, 0.5, round_)
    produced = {id(free): prefill(free), id(mixed): prefill(mixed)}
    seconds = {id(free): 0.0, id(mixed): 0.0}
    timed = {id(free): 0, id(mixed): 0}
    while free.has_work() or mixed.has_work():
        for core in (free, mixed) if round_ % 2 == 0 else (mixed, free):
            if core.has_work():
                t0 = time.perf_counter()
                timed[id(core)] += sum(len(o.new_token_ids) for o in core.step())
                seconds[id(core)] += time.perf_counter() - t0
    for core in (free, mixed):
        total = produced[id(core)] + timed[id(core)]
        assert total == BATCH * MAX_TOKENS, f"{total} tokens, expected {BATCH * MAX_TOKENS}"
    return timed[id(free)] / seconds[id(free)], timed[id(mixed)] / seconds[id(mixed)]


def throughput(model, cfg, tok) -> dict:
    free_core, mixed_core = make_core(model, cfg, tok), make_core(model, cfg, tok)
    interleaved_rates(free_core, mixed_core, tok, -1)  # warm-up: grammar compiled, xgrammar loaded, torch warm
    free, mixed = [], []
    for r in range(ROUNDS):
        f, m = interleaved_rates(free_core, mixed_core, tok, r)
        free.append(f)
        mixed.append(m)
    ratios = [m / f for m, f in zip(mixed, free, strict=True)]
    for core in (free_core, mixed_core):
        assert core.usage().full.in_use == 0 and len(core.grammars) == 0, "pages or matchers left behind"
    return {"constrained_mix_throughput_ratio": statistics.median(ratios),
            "throughput_free_tok_s": statistics.median(free), "throughput_mixed_tok_s": statistics.median(mixed),
            "throughput_ratios": ratios, "batch": BATCH, "max_tokens": MAX_TOKENS}


def mask_cost(model, cfg, tok) -> dict:
    """Time the engine spends on grammar work per constrained row and step (fill + apply + accept)."""
    core = make_core(model, cfg, tok)
    book = core.grammars
    spent = [0.0, 0]
    orig_bitmask, orig_accept = book.bitmask, book.accept

    def bitmask(rows, n, device):
        t0 = time.perf_counter()
        out = orig_bitmask(rows, n, device)
        spent[0] += time.perf_counter() - t0
        spent[1] += len(rows)
        return out

    def accept(req_id, token):
        t0 = time.perf_counter()
        orig_accept(req_id, token)
        spent[0] += time.perf_counter() - t0

    book.bitmask, book.accept = bitmask, accept  # type: ignore[method-assign]
    add_batch(core, tok, 0.5, 99)
    while core.has_work():
        core.step()
    return {"mask_us_per_row": 1e6 * spent[0] / max(spent[1], 1)}


def compile_times(tok, vocab_size: int) -> dict:
    out = {}
    for name, schema in SCHEMAS.items():
        spec = GrammarSpec("json_schema", json.dumps(schema))
        firsts, cached = [], []
        for _ in range(COMPILES):
            cache = GrammarCache(tok, vocab_size, tok.eos_token_ids)
            t0 = time.perf_counter()
            cache.compile(spec)
            firsts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            cache.compile(GrammarSpec("json_schema", json.dumps(schema, indent=1)))  # same schema, other text
            cached.append(time.perf_counter() - t0)
            assert cache.hits == 1
        out[name] = {"compile_ms_first": 1e3 * statistics.median(firsts),
                     "compile_ms_cached": 1e3 * statistics.median(cached)}
    return {"compile": out, "compile_vocab_size": vocab_size}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(["all free", "50/50 json_schema"], [results["throughput_free_tok_s"], results["throughput_mixed_tok_s"]],
          color=["tab:gray", "tab:blue"])
    a.set_ylabel("decode tokens/s")
    a.set_title(f"ratio {results['constrained_mix_throughput_ratio']:.3f} (goal >= 0.9)")
    names = list(results["compile"])
    x = range(len(names))
    b.bar([i - 0.2 for i in x], [results["compile"][n]["compile_ms_first"] for n in names], 0.4, label="first")
    b.bar([i + 0.2 for i in x], [results["compile"][n]["compile_ms_cached"] for n in names], 0.4, label="cached")
    b.set_xticks(list(x), names, rotation=15)
    b.set_yscale("log")
    b.set_ylabel("ms")
    b.set_title(f"grammar compile per schema (vocab {results['compile_vocab_size']})")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    p.add_argument("--out", type=Path, default=None, help="the JSON (PNG beside it); default "
                   "bench/results/gateway.json, with --quick .run/bench-quick/gateway.json")
    a = p.parse_args(argv)
    out = a.out or (QUICK_RESULTS if a.quick else RESULTS) / "gateway.json"
    if a.quick:
        globals().update(QUICK)
    torch.manual_seed(0)
    model, cfg = load_model(None)
    tok = load_tokenizer(None)
    results: dict = {"device": "cpu", "torch_threads": torch.get_num_threads(), "quick": a.quick}
    for name, fn in (("compile", lambda: compile_times(tok, cfg.vocab_size)),
                     ("throughput", lambda: throughput(model, cfg, tok)), ("mask", lambda: mask_cost(model, cfg, tok))):
        t0 = time.perf_counter()
        results.update(fn())
        print(f"[gateway bench] {name} done in {time.perf_counter() - t0:.1f}s", flush=True)
    results["goals"] = {k: f"{op} {v}" for k, (op, v) in GOALS.items()}
    results["goals_met"] = {k: results[k] >= v for k, (_, v) in GOALS.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"constrained_mix_throughput_ratio {results['constrained_mix_throughput_ratio']:.3f} "
          f"(free {results['throughput_free_tok_s']:.0f} tok/s, mixed {results['throughput_mixed_tok_s']:.0f} tok/s)")
    print(f"mask_us_per_row {results['mask_us_per_row']:.1f}")
    for n, v in results["compile"].items():
        print(f"compile {n:20s} first {v['compile_ms_first']:8.2f} ms  cached {v['compile_ms_cached']:8.4f} ms")
    print(f"wrote {out} and {out.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
