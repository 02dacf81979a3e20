"""`python -m bench.profile`: fit the mock engine's step-cost profile (libs/engine/mock.py) from the real engine
on whatever device runs it.

It builds the real engine (the built-in tiny model, or `--model PATH`; compiled as the services run it unless
`--no-compile`), runs a grid of steps through it (prefill chunks of several lengths, one request at a time, and
decode steps at several batch sizes and contexts), records each step's (new tokens, attention pairs, prefill
chunks, seconds) as the scheduler's own cost model sees them, and fits

    seconds = fixed + per_token x tokens + per_pair x pairs + per_prefill_seq x prefill chunks

by least squares with non-negative terms. Writes `bench/results/profile.json` (+ PNG: predicted vs measured) and,
with `--name NAME`, the profile itself to libs/engine/profiles/NAME.json (what `WINDSERVE_MOCK_PROFILE=NAME`
selects). Headline keys: `median_rel_error` (of the fit over the steps measured), `steps`, the four terms.
`--quick`: the eager engine, a few steps (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from libs.engine import EngineConfig, Request, SamplingParams
from libs.engine.core import load_core
from libs.engine.mock_profile import PROFILES, MockProfile

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUICK_RESULTS = ROOT / ".run" / "bench-quick"
HEADLINE_KEYS = ("median_rel_error", "steps", "fixed_s", "per_token_s", "per_pair_s", "per_prefill_seq_s")
FEATURES = ("fixed_s", "per_token_s", "per_pair_s", "per_prefill_seq_s")


def measure(core, prefills: list[int], batches: list[int], contexts: list[int], repeats: int) -> list[tuple]:
    """(tokens, pairs, prefill chunks, seconds) of every step the grid ran."""
    samples: list[tuple] = []
    observe = core.scheduler.observe_step

    def record(plan, seconds):
        samples.append((plan.num_tokens, plan.attn_pairs, plan.num_prefill_seqs, seconds))
        observe(plan, seconds)

    core.scheduler.observe_step = record
    g = torch.Generator().manual_seed(0)
    vocab = core.model_config.vocab_size
    k = 0

    def run(prompts: list[list[int]], max_tokens: int) -> None:
        nonlocal k
        for p in prompts:
            core.add_request(Request(f"p{k}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
            k += 1
        while core.has_work():
            core.step()

    for _ in range(repeats):
        for n in prefills:  # one prompt at a time: prefill steps of n tokens (chunked by the step budget)
            run([torch.randint(3, vocab, (n,), generator=g).tolist()], 1)
        for ctx in contexts:
            for b in batches:  # b sequences decoding together at about `ctx` tokens of context
                run([torch.randint(3, vocab, (ctx,), generator=g).tolist() for _ in range(b)], 16)
    return samples


def fit(samples: list[tuple]) -> dict[str, float]:
    """Least squares over [1, tokens, pairs, prefill chunks], dropping a term that comes out negative."""
    x = torch.tensor([[1.0, t, p, s] for t, p, s, _ in samples], dtype=torch.float64)
    y = torch.tensor([sec for *_, sec in samples], dtype=torch.float64)
    keep = list(range(4))
    while True:
        scale = x[:, keep].abs().amax(dim=0).clamp(min=1e-12)
        coef = torch.linalg.lstsq(x[:, keep] / scale, y.unsqueeze(1)).solution.squeeze(1) / scale
        if (coef >= 0).all() or len(keep) == 1:
            out = dict.fromkeys(FEATURES, 0.0)
            for i, c in zip(keep, coef.tolist(), strict=True):
                out[FEATURES[i]] = max(c, 0.0)
            return out
        keep.pop(int(torch.argmin(coef)))


def plot(samples: list[tuple], profile: MockProfile, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    pred = [profile.predict(*s[:3]) * 1e3 for s in samples]
    meas = [s[3] * 1e3 for s in samples]
    ax.scatter(meas, pred, s=8, c=["tab:red" if s[2] else "tab:blue" for s in samples])
    top = max(meas + pred)
    ax.plot([0, top], [0, top], color="gray", linestyle="--")
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("profile's prediction (ms)")
    ax.set_title("bench.profile: red = steps with prefill chunks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the built-in tiny model)")
    ap.add_argument("--no-compile", action="store_true", help="profile the eager engine")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--name", default="", help="also write the profile to libs/engine/profiles/NAME.json")
    ap.add_argument("--quick", action="store_true", help="smoke run: eager, a few steps")
    ap.add_argument("--out", type=Path, default=None, help="the JSON (PNG beside it); default "
                                                           "bench/results/profile.json")
    args = ap.parse_args(argv)
    compile_ = not (args.no_compile or args.quick)
    config = EngineConfig(page_size=16, num_full_pages=2048, num_swa_pages=512, max_num_batched_tokens=512,
                          max_num_seqs=32, compile=compile_, device=args.device, bucket_edges=())
    core = load_core(args.model, config)
    if args.quick:
        grid = dict(prefills=[16, 128], batches=[1, 4], contexts=[64], repeats=1)
    else:
        grid = dict(prefills=[16, 64, 256, 512, 1024], batches=[1, 2, 4, 8, 16, 32], contexts=[64, 512, 2048],
                    repeats=2)
    measure(core, **{**grid, "repeats": 1})  # warm-up (first-touch allocations, caches): not fitted
    t0 = time.monotonic()
    samples = measure(core, **grid)
    terms = fit(samples)
    model = args.model or "windserve-tiny (built-in)"
    profile = MockProfile(**terms, source=f"bench.profile: {model} on {args.device}, "
                                          f"{'compiled' if compile_ else 'eager'}, {len(samples)} steps, "
                                          f"{time.strftime('%Y-%m-%d')}")
    errors = [abs(profile.predict(*s[:3]) - s[3]) / s[3] for s in samples]
    out = args.out or (QUICK_RESULTS if args.quick else RESULTS) / "profile.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"median_rel_error": round(statistics.median(errors), 4), "steps": len(samples),
              **{k: terms[k] for k in FEATURES}, "source": profile.source, "grid": grid,
              "measure_s": round(time.monotonic() - t0, 1), "p90_rel_error": round(sorted(errors)[
                  int(0.9 * (len(errors) - 1))], 4)}
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(samples, profile, out.with_suffix(".png"))
    if args.name:
        profile.save(PROFILES / f"{args.name}.json")
        print(f"wrote {PROFILES / f'{args.name}.json'}")
    for k in HEADLINE_KEYS:
        print(f"{k:20s} {result[k]}")
    print(f"wrote {out} and {out.with_suffix('.png').name}")
    core.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
