"""Model benchmark: forward tokens/s of windserve vs the transformers implementation on the same tiny config
and weights (prefill one pass, then batched decode), measured side by side in one run; plus KV bytes per token
of the Flash / V2.5 / Pro configs computed from config alone and checked against REFERENCE.md.

    python -m bench.model [--quick] [--out PATH]   ->  bench/results/model.json, bench/results/model.png

--quick: batch 2, prompt 64, 8 decode steps, one repeat (a smoke run of the same code, seconds); --out: where the
JSON goes (the PNG beside it; with --quick the default is .run/bench-quick/model.json, never bench/results/).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from libs.model import BatchMeta, KVPools, ModelConfig, load_model

RESULTS = Path(__file__).resolve().parent / "results"
QUICK_RESULTS = RESULTS.parent.parent / ".run" / "bench-quick"
BATCH, PROMPT, DECODE_STEPS, REPEATS = 4, 256, 32, 5
QUICK = {"BATCH": 2, "PROMPT": 64, "DECODE_STEPS": 8, "REPEATS": 1}  # --quick: these module sizes instead
# the headline figures, top-level keys of the JSON: windserve over transformers tokens/s per phase, and whether
# the KV bytes computed from config match REFERENCE.md's table
HEADLINE_KEYS = ("prefill_ratio_vs_transformers", "decode_ratio_vs_transformers", "kv_table_matches_reference")
N_TOKENS = {"4K": 4096, "32K": 32768, "128K": 131072, "1M": 1 << 20}
MIB, GIB = 1 << 20, 1 << 30

FLASH_FULL = [0, 5, 11, 17, 23, 29, 35, 41, 47]
PRO_FULL = [0, 7, 15, 23, 31, 39, 47, 55, 62, 69]
PRESETS = {  # HF config.json fields of the public checkpoints (shapes only; see REFERENCE.md)
    "V2-Flash": {"model_type": "mimo_v2_flash", "vocab_size": 152576, "hidden_size": 4096, "num_hidden_layers": 48,
                 "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 192, "v_head_dim": 128,
                 "sliding_window": 129, "n_routed_experts": 256, "num_experts_per_tok": 8},
    "V2.5": {"model_type": "mimo_v2", "vocab_size": 152576, "hidden_size": 4096, "num_hidden_layers": 48,
             "num_attention_heads": 64, "num_key_value_heads": 4, "swa_num_key_value_heads": 8, "head_dim": 192,
             "v_head_dim": 128, "hybrid_layer_pattern": [0 if i in FLASH_FULL else 1 for i in range(48)],
             "sliding_window_size": 128, "rope_theta": 1e7, "swa_rope_theta": 1e4, "n_routed_experts": 256,
             "num_experts_per_tok": 8},
    "V2.5-Pro": {"model_type": "mimo_v2", "vocab_size": 152576, "hidden_size": 6144, "num_hidden_layers": 70,
                 "num_attention_heads": 128, "num_key_value_heads": 8, "swa_num_key_value_heads": 8,
                 "head_dim": 192, "v_head_dim": 128, "hybrid_layer_pattern": [0 if i in PRO_FULL else 1
                                                                              for i in range(70)],
                 "sliding_window_size": 128, "n_routed_experts": 384, "num_experts_per_tok": 8},
}
# REFERENCE.md "KV bytes (bf16)": per-token bytes and the (hybrid size, ratio vs all-full) table
REF_PER_TOKEN = {"V2-Flash": (2560, 5120), "V2.5": (2560, 5120), "V2.5-Pro": (5120, 5120)}
REF_TABLE = {
    "V2.5": {"4K": (114 * MIB, 7.6), "32K": (744 * MIB, 9.4), "128K": (2.84 * GIB, 9.6), "1M": (22.5 * GIB, 9.7)},
    "V2.5-Pro": {"4K": (238 * MIB, 5.9), "32K": (1.60 * GIB, 6.8), "128K": (6.29 * GIB, 7.0),
                 "1M": (50.0 * GIB, 7.0)},
}


def hf_tiny_dir(tmp: Path) -> Path:
    """The windserve tiny config expressed as a transformers config, random weights, saved as safetensors
    (no EOS, so `generate` runs to the requested length)."""
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    t = ModelConfig.tiny()
    hf_cfg = MiMoV2FlashConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        moe_intermediate_size=t.moe_intermediate_size, num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads, num_key_value_heads=t.kv_heads_full, head_dim=t.qk_head_dim,
        v_head_dim=t.v_head_dim, n_routed_experts=t.num_experts, num_experts_per_tok=t.num_experts_per_tok,
        sliding_window=t.sliding_window, max_position_embeddings=4096, eos_token_id=None,
        layer_types=["sliding_attention" if s else "full_attention" for s in t.layer_is_swa],
        rope_parameters={k: {"rope_type": "default", "rope_theta": th, "partial_rotary_factor": 0.5}
                         for k, th in (("full_attention", t.rope_theta_full), ("sliding_attention",
                                                                               t.rope_theta_swa))},
    )
    torch.manual_seed(0)
    MiMoV2FlashForCausalLM(hf_cfg).save_pretrained(tmp)
    return tmp


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _best_interleaved(fns: list) -> list[float]:
    """Best-of-REPEATS for each function, alternating them so background load hits all alike."""
    best = [math.inf] * len(fns)
    for _ in range(REPEATS):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], _timed(fn))
    return best


def _ours(model, cfg, ids: torch.Tensor):
    b, n = ids.shape
    pages_per_seq = -(-(n + DECODE_STEPS) // 16)
    tables = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(b)]

    def prefill():
        kv = KVPools.allocate(cfg, b * pages_per_seq, b * pages_per_seq, 16)
        model(ids.reshape(-1), BatchMeta.build([n] * b, [n] * b, tables), kv)
        return kv

    def decode():
        kv = prefill_kv
        nxt = ids[:, -1]
        for s in range(DECODE_STEPS):
            logits = model(nxt, BatchMeta.build([1] * b, [n + s + 1] * b, tables), kv)
            nxt = logits.argmax(-1)

    prefill_kv = prefill()
    kv_snapshot = [t.clone() for t in (prefill_kv.full_k, prefill_kv.full_v, prefill_kv.swa_k, prefill_kv.swa_v)]

    def decode_fresh():
        for dst, src in zip((prefill_kv.full_k, prefill_kv.full_v, prefill_kv.swa_k, prefill_kv.swa_v), kv_snapshot,
                            strict=True):
            dst.copy_(src)
        decode()

    return prefill, decode_fresh


def _theirs(hf, ids: torch.Tensor):
    from transformers import DynamicCache

    def prefill():
        cache = DynamicCache(config=hf.config)
        with torch.no_grad():
            hf(ids, cache=cache, use_cache=True, logits_to_keep=1)
        return cache

    def prefill_and_decode():
        cache = prefill()  # the prefill time is subtracted afterwards; HF has no cheap cache reset
        nxt = ids[:, -1:]
        with torch.no_grad():
            for _ in range(DECODE_STEPS):
                out = hf(nxt, cache=cache, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)

    return prefill, prefill_and_decode


def throughput() -> dict:
    from transformers import MiMoV2FlashForCausalLM

    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        path = hf_tiny_dir(Path(tmp))
        model, cfg = load_model(str(path), progress=False)
        hf = MiMoV2FlashForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, cfg.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
    (o_pre, o_dec), (t_pre, t_predec) = _ours(model, cfg, ids), _theirs(hf, ids)
    o_pre_s, o_dec_s, t_pre_s, t_predec_s = _best_interleaved([o_pre, o_dec, t_pre, t_predec])
    ours, theirs = (o_pre_s, o_dec_s), (t_pre_s, max(t_predec_s - t_pre_s, 1e-9))
    res = {}
    for i, phase in enumerate(("prefill", "decode")):
        toks = BATCH * (PROMPT if phase == "prefill" else DECODE_STEPS)
        res[phase] = {"tokens": toks, "windserve_tok_s": toks / ours[i], "transformers_tok_s": toks / theirs[i],
                      "ratio_windserve_over_transformers": theirs[i] / ours[i]}
    return res


def kv_bytes() -> dict:
    out = {}
    for name, d in PRESETS.items():
        cfg = ModelConfig.from_hf_dict(d)
        per_full, per_swa = cfg.kv_bytes_per_token()
        entry = {"full_layers": len(cfg.full_layers), "swa_layers": len(cfg.swa_layers),
                 "bytes_per_token_full_layer": per_full, "bytes_per_token_swa_layer": per_swa,
                 "matches_reference_per_token": (per_full, per_swa) == REF_PER_TOKEN[name], "by_length": {}}
        for label, n in N_TOKENS.items():
            hybrid = cfg.kv_bytes_total(n)
            all_full = (len(cfg.full_layers) * per_full + len(cfg.swa_layers) * per_swa) * n
            row = {"tokens": n, "hybrid_bytes": hybrid, "all_full_bytes": all_full, "ratio": all_full / hybrid}
            if name in REF_TABLE:
                ref_bytes, ref_ratio = REF_TABLE[name][label]
                # the table rounds to 3 significant digits (MiB/GiB) and ratios to 1 decimal
                row["matches_reference"] = (abs(hybrid - ref_bytes) / ref_bytes < 0.006
                                            and abs(round(all_full / hybrid, 1) - ref_ratio) < 1e-9)
            entry["by_length"][label] = row
        out[name] = entry
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    phases = list(res["throughput"])
    x = range(len(phases))
    a.bar([i - 0.2 for i in x], [res["throughput"][p]["windserve_tok_s"] for p in phases], 0.4, label="windserve")
    a.bar([i + 0.2 for i in x], [res["throughput"][p]["transformers_tok_s"] for p in phases], 0.4,
          label="transformers")
    a.set_xticks(list(x), phases)
    a.set_ylabel("tokens/s (CPU, tiny config)")
    a.set_title(f"forward throughput, batch {BATCH}, prompt {PROMPT}")
    a.legend()
    for name in REF_TABLE:
        rows = res["kv_bytes"][name]["by_length"]
        ns = [r["tokens"] for r in rows.values()]
        b.plot(ns, [r["hybrid_bytes"] / GIB for r in rows.values()], "o-", label=f"{name} hybrid")
        b.plot(ns, [r["all_full_bytes"] / GIB for r in rows.values()], "x--", label=f"{name} all full")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("tokens per sequence")
    b.set_ylabel("KV GiB (bf16)")
    b.set_title("KV bytes from config")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    p.add_argument("--out", type=Path, default=None, help="the JSON (PNG beside it); default bench/results/model.json, "
                   "with --quick .run/bench-quick/model.json")
    a = p.parse_args(argv)
    a.out = a.out or (QUICK_RESULTS if a.quick else RESULTS) / "model.json"
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.quick:
        globals().update(QUICK)
    res = {"config": {"batch": BATCH, "prompt": PROMPT, "decode_steps": DECODE_STEPS, "repeats_best_of": REPEATS,
                      "threads": torch.get_num_threads(), "dtype": "float32", "device": "cpu", "quick": a.quick},
           "throughput": throughput(), "kv_bytes": kv_bytes()}
    ok = all(e["matches_reference_per_token"] and all(r.get("matches_reference", True)
                                                      for r in e["by_length"].values())
             for e in res["kv_bytes"].values())
    res = {"prefill_ratio_vs_transformers": res["throughput"]["prefill"]["ratio_windserve_over_transformers"],
           "decode_ratio_vs_transformers": res["throughput"]["decode"]["ratio_windserve_over_transformers"],
           "kv_table_matches_reference": ok, **res}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2))
    plot(res, a.out.with_suffix(".png"))
    for phase, r in res["throughput"].items():
        print(f"{phase:8s} windserve {r['windserve_tok_s']:9.1f} tok/s  transformers {r['transformers_tok_s']:9.1f} "
              f"tok/s  ratio {r['ratio_windserve_over_transformers']:.2f}x")
    for name, e in res["kv_bytes"].items():
        sizes = ", ".join(f"{k} {r['hybrid_bytes'] / GIB:.3g} GiB ({r['ratio']:.1f}x)"
                          for k, r in e["by_length"].items())
        print(f"{name:9s} KV/token full {e['bytes_per_token_full_layer']} B swa {e['bytes_per_token_swa_layer']} B; "
              f"{sizes}")
    print("KV table vs REFERENCE.md:", "match" if ok else "MISMATCH")
    print(f"wrote {a.out} and {a.out.with_suffix('.png').name}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
