"""MTP speculative decoding benchmark (#17).

    python -m bench.mtp [--quick] [--out PATH]   ->  bench/results/mtp.json, bench/results/mtp.png

Trains the tiny target as a byte-level LM on the repository's markdown (scripts/train_tiny.py), then the MTP
blocks on the target's own greedy continuations, both cached under .cache/mtp/, and measures on held-out
prompts: accepted tokens per verify step, decode speed-up with MTP at 1 and 8 concurrent requests, short
output latency with MTP in prefill, and greedy equality with MTP off. Goals in `GOALS`. `--quick` runs the
same pipeline at tiny sizes (cache .cache/mtp-quick/, JSON under .run/bench-quick/): a smoke run whose
figures mean nothing. Scheme: docs/mtp.md; results: bench/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from libs.engine import EngineConfig, EngineCore, Request, SamplingParams
from libs.model import load_model
from libs.model.layers import apply_partial_rope, rope_cos_sin
from libs.model.paged import BatchMeta, KVPools
from scripts.train_tiny import CORPUS_COMMIT, has_commit, trained_target, windows

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUICK_RESULTS = ROOT / ".run" / "bench-quick"
CACHE = ROOT / ".cache" / "mtp"
K = 3
PROMPT, CONT = 16, 96  # training sequences: a prompt cut from the text + the target's greedy continuation
N_TRAIN, N_HELD = 3072, 16
TRAIN_STEPS, BATCH, LR = 900, 64, 6e-3  # one-cycle schedule (5 % warm-up, cosine down), Adam
CURVE_EVERY = 150  # steps between the learning curve's points (train / held-out top-1 per block)
CHAINED_K = 5  # speculative_tokens of the chained-reuse row (blocks 0, 1, 2, 2, 2)
GOALS = {"accepted_len": (">=", 2.5), "decode_speedup_1": (">=", 1.8), "greedy_identical": ("==", True)}
# the headline figures (top-level keys of mtp.json)
HEADLINE_KEYS = ("accepted_len", "decode_speedup_1", "decode_speedup_8", "step_cost_ratio_1",
                 "short_output_latency_ratio", "greedy_identical")
# --quick: these module sizes, the target's training steps, and the measurements' output tokens and repeats
QUICK = {"N_TRAIN": 64, "N_HELD": 4, "CONT": 32, "TRAIN_STEPS": 6, "BATCH": 16, "CURVE_EVERY": 3,
         "CACHE": ROOT / ".cache" / "mtp-quick"}
QUICK_TARGET_STEPS = 6
QUICK_DECODE = {"n_out": 16, "repeats": 1}
QUICK_SHORT = {"repeats": 2}


def prompts(text: torch.Tensor, seed: int, n: int, length: int = PROMPT) -> list[list[int]]:
    """n prompts of `length` bytes cut at random places of the text."""
    return windows(text, n, length, torch.Generator().manual_seed(seed)).tolist()


def make_core(model, cfg, k: int = 0, **opts) -> EngineCore:
    base = dict(page_size=16, num_full_pages=2048, num_swa_pages=512, max_num_batched_tokens=512,
                max_num_seqs=64, bucket_edges=(), speculative_tokens=k)
    base.update(opts)
    return EngineCore(EngineConfig(**base), model, cfg)


def data_core(model, cfg) -> EngineCore:
    """An engine that decodes the training prompts 512 at a time (greedy outputs do not depend on the batch)."""
    return make_core(model, cfg, max_num_seqs=512, max_num_batched_tokens=8192, num_full_pages=8192,
                     num_swa_pages=4096)


def generate(core: EngineCore, batch: list[list[int]], n: int) -> list[list[int]]:
    for i, p in enumerate(batch):
        core.add_request(Request(f"g{i}", p, SamplingParams(max_tokens=n, ignore_eos=True)))
    out: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
    return [out[f"g{i}"] for i in range(len(batch))]


# ---------------------------------------------------------------- training (dense, differentiable blocks)
def dense_block(model, j: int, emb: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """MTP block j over whole sequences ``[B, L, H]`` with dense causal window attention + sinks: the paged
    forward's math written with plain torch ops (the paged kernels and fused weights carry no gradients)."""
    cfg, layer = model.cfg, model.model.mtp.layers[j]
    b, n, _ = emb.shape
    att = layer.self_attn
    h = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(prev)], dim=-1))
    x = layer.input_layernorm(h)
    hq, hkv, d, dv = att.num_heads, att.num_kv_heads, att.qk_dim, att.v_dim
    cos, sin = rope_cos_sin(torch.arange(n), model.inv_freq_swa, x.dtype)
    qk = F.linear(x, torch.cat([att.q_proj.weight, att.k_proj.weight])).view(b * n, hq + hkv, d)
    qk = apply_partial_rope(qk, cos.repeat(b, 1), sin.repeat(b, 1)).view(b, n, hq + hkv, d)
    v = F.linear(x, att.v_proj.weight).view(b, n, hkv, dv) * att.v_scale
    out = window_attention(qk[:, :, :hq], qk[:, :, hq:], v, cfg.window_left, att.scale, att.attention_sink_bias)
    h = h + att.o_proj(out)
    mlp, y = layer.mlp, layer.pre_mlp_layernorm(h)
    h = h + mlp.down_proj(F.silu(F.linear(y, mlp.gate_proj.weight)) * F.linear(y, mlp.up_proj.weight))
    return layer.final_layernorm(h)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: int, scale: float,
                     sink: torch.Tensor | None) -> torch.Tensor:
    """Causal attention of every query over itself and the w keys before it (+ one sink logit per head):
    q ``[B, L, Hq, D]``, k ``[B, L, Hkv, D]``, v ``[B, L, Hkv, Dv]`` -> ``[B, L, Hq * Dv]``. Queries go in
    chunks of c = w + 1, each reading its own chunk and the one before (2c keys): ~3x cheaper than the L x L
    masked product (training step time), same values."""
    b, n, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    g, c = hq // hkv, w + 1
    nc = -(-n // c)

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, L, H, D] -> [B, H, nc, c, D], zero-padded at the end
        x = F.pad(x, (0, 0, 0, 0, 0, nc * c - n))
        return x.view(b, nc, c, x.shape[2], x.shape[3]).permute(0, 3, 1, 2, 4)

    def with_previous(x: torch.Tensor) -> torch.Tensor:  # [B, H, nc, c, D] -> [B, H, nc, 2c, D]
        return torch.cat([F.pad(x, (0, 0, 0, 0, 1, 0))[:, :, :-1], x], dim=3)

    qc = chunks(q).reshape(b, hkv, g, nc, c, d).transpose(2, 3).reshape(b, hkv, nc, g * c, d)
    kc, vc = with_previous(chunks(k)), with_previous(chunks(v))
    scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale  # [B, Hkv, nc, g * c, 2c]
    qi = torch.arange(c).repeat(g)[:, None] + c  # each query's index among its 2c keys
    ki = torch.arange(2 * c)[None, :]
    visible = ((ki <= qi) & (qi - ki <= w))[None].repeat(nc, 1, 1)
    visible[0, :, :c] = False  # the first chunk has no chunk before it
    scores = scores.masked_fill(~visible, float("-inf"))
    if sink is not None:
        s = sink.view(hkv, g, 1, 1).expand(hkv, g, c, 1).reshape(1, hkv, 1, g * c, 1)
        probs = torch.softmax(torch.cat([scores, s.expand(b, hkv, nc, g * c, 1)], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vc).view(b, hkv, nc, g, c, dv).permute(0, 2, 4, 1, 3, 5)
    return out.reshape(b, nc * c, hq * dv)[:, :n]


def chain_logits(model, seqs: torch.Tensor, hidden: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, labels) of every block over a batch: block j at positions 0..L-3-j, only where the label is a
    token of the model's continuation (a random prompt token is noise to learn)."""
    out, prev = [], hidden
    n = seqs.shape[1]
    for j in range(K):
        m = n - 2 - j
        h = dense_block(model, j, model.model.embed_tokens(seqs[:, 1 + j:1 + j + m]), prev[:, :m])
        first = max(0, PROMPT - 2 - j)
        out.append((model.lm_head(h[:, first:]), seqs[:, 2 + j + first:2 + j + m]))
        prev = h
    return out


def loss_fn(model, seqs: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every block against the target's greedy continuation, averaged over the blocks. Only
    the argmax matters to greedy drafting; distilling the target's whole next-token distribution (soft labels,
    the earlier recipe) spent the blocks' small capacity on the tail and reached a lower top-1 (docs/mtp.md)."""
    parts = [F.cross_entropy(lg.reshape(-1, lg.shape[-1]), lab.reshape(-1)) for lg, lab in chain_logits(model, seqs,
                                                                                                      hidden)]
    return torch.stack(parts).mean()


@torch.no_grad()
def target_hidden(model, cfg, seqs: list[list[int]], batch: int = 128) -> torch.Tensor:
    """The target's final-norm hidden states ``[N, L, H]`` of equal-length sequences, `batch` per forward."""
    n = len(seqs[0])
    pages = -(-n // 16)
    out = []
    for i in range(0, len(seqs), batch):
        part = seqs[i:i + batch]
        kv = KVPools.allocate(cfg, pages * len(part), pages * len(part), 16)
        tables = [list(range(r * pages, (r + 1) * pages)) for r in range(len(part))]
        _, h = model(torch.tensor(part).flatten(), BatchMeta.build([n] * len(part), [n] * len(part), tables), kv,
                     return_hidden=True)
        out.append(h.view(len(part), n, -1))
    return torch.cat(out)


def check_dense_matches_paged(model, cfg, seq: list[int], hidden: torch.Tensor) -> float:
    """Max |logits| difference of the dense training forward vs the engine's paged forward_mtp (block 0)."""
    n = len(seq)
    ids = torch.tensor(seq)
    with torch.no_grad():
        dense = model.lm_head(dense_block(model, 0, model.model.embed_tokens(ids[1:])[None], hidden[None, :n - 1]))[0]
    pages = -(-n // 16)
    paged, _ = model.forward_mtp(0, ids[1:], hidden[:n - 1], BatchMeta.build([n - 1], [n - 1], [list(range(pages))],
                                                                             all_logits=True),
                                 KVPools.allocate_mtp(cfg, pages, 16))
    return float((dense - paged).abs().max())


def train(model, cfg, seqs: torch.Tensor, hidden: torch.Tensor, held: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """Adam on the MTP blocks only (the main model frozen); returns the loss and the learning curve (top-1 per
    block on 64 training sequences and on the held-out ones, every CURVE_EVERY steps)."""
    params = [p for p in model.model.mtp.parameters()]
    frozen = [p for p in model.parameters() if all(p is not q for q in params)]
    for p in frozen:
        p.requires_grad_(False)
    opt = torch.optim.Adam(params, lr=LR)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, LR, total_steps=TRAIN_STEPS, pct_start=0.05)
    g = torch.Generator().manual_seed(0)
    losses, curve = [], []
    t0 = time.perf_counter()
    for step in range(TRAIN_STEPS + 1):
        if step % CURVE_EVERY == 0 or step == TRAIN_STEPS:
            curve.append({"step": step, "train_top1": block_accuracy(model, seqs[:64], hidden[:64]),
                          "held_top1": block_accuracy(model, *held)})
        if step == TRAIN_STEPS:
            break
        idx = torch.randint(0, seqs.shape[0], (BATCH,), generator=g)
        loss = loss_fn(model, seqs[idx], hidden[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    for p in frozen:
        p.requires_grad_(True)
    return {"steps": TRAIN_STEPS, "batch": BATCH, "lr": LR, "seconds": time.perf_counter() - t0,
            "first_loss": losses[0], "last_loss": statistics.mean(losses[-20:]), "curve": curve}


@torch.no_grad()
def block_accuracy(model, seqs: torch.Tensor, hidden: torch.Tensor) -> list[float]:
    return [float((lg.argmax(-1) == lab).float().mean()) for lg, lab in chain_logits(model, seqs, hidden)]


def trained_model(model, cfg, train_text: torch.Tensor, held_text: torch.Tensor) -> tuple[dict, list[list[int]]]:
    """Train (or load from .cache/mtp) the MTP blocks of the (trained) target; returns training facts and the
    held-out prompts."""
    train_prompts = prompts(train_text, 1, N_TRAIN)
    held = prompts(held_text, 2, N_HELD)
    key = hashlib.sha256(json.dumps([PROMPT, CONT, N_TRAIN, TRAIN_STEPS, BATCH, LR, K, "ce-onecycle",
                                     "text-prompts"]).encode()
                         + b"".join(p.detach().float().numpy().tobytes()[:4096] for p in
                                    (model.lm_head.weight, model.model.embed_tokens.weight))).hexdigest()[:16]
    path = CACHE / f"tiny-mtp-{key}.pt"
    info: dict = {"cache": str(path.relative_to(ROOT)), "train_sequences": N_TRAIN,
                  "tokens_per_sequence": PROMPT + CONT}
    t0 = time.perf_counter()
    core = data_core(model, cfg)
    seqs = [p + c for p, c in zip(train_prompts, generate(core, train_prompts, CONT), strict=True)]
    held_seqs = [p + c for p, c in zip(held, generate(core, held, CONT), strict=True)]
    hidden, held_hidden = target_hidden(model, cfg, seqs), target_hidden(model, cfg, held_seqs)
    info["data_seconds"] = time.perf_counter() - t0
    info["dense_vs_paged_max_abs"] = check_dense_matches_paged(model, cfg, seqs[0], hidden[0])
    held_t = (torch.tensor(held_seqs), held_hidden)
    info["held_block_accuracy_before"] = block_accuracy(model, *held_t)
    info["held_bigram_accuracy"] = bigram_accuracy(seqs, held_seqs)
    facts = path.with_suffix(".json")  # the training facts (learning curve) of the run that trained the cache
    if path.exists():
        model.model.mtp.load_state_dict(torch.load(path))
        info["training"] = {"loaded_from_cache": True, **(json.loads(facts.read_text()) if facts.exists() else {})}
    else:
        info["training"] = train(model, cfg, torch.tensor(seqs), hidden, held_t)
        CACHE.mkdir(parents=True, exist_ok=True)
        torch.save(model.model.mtp.state_dict(), path)
        facts.write_text(json.dumps(info["training"]))
    info["held_block_accuracy"] = block_accuracy(model, *held_t)
    info["held_copy_accuracy"] = copy_accuracy(held_seqs)
    info["held_samples"] = [{"prompt": _text(s[:PROMPT]), "greedy": _text(s[PROMPT:])} for s in held_seqs[:3]]
    return info, held


def _text(ids: list[int]) -> str:
    return bytes(t for t in ids if t < 256).decode("utf-8", "replace")


def copy_accuracy(held: list[list[int]], n: int = 3) -> float:
    """Top-1 of 'copy what followed the last earlier occurrence of the last n tokens' on the held-out
    continuations (prompt-lookup drafting): how repetitive the target's greedy text is."""
    right = total = 0
    for s in held:
        for i in range(PROMPT, len(s) - 1):
            key = tuple(s[i - n + 1:i + 1])
            guess = next((s[j + 1] for j in range(i - 1, n - 2, -1) if tuple(s[j - n + 1:j + 1]) == key), None)
            right += guess == s[i + 1]
            total += 1
    return right / total


def bigram_accuracy(train: list[list[int]], held: list[list[int]]) -> float:
    """Top-1 of a lookup table 'token -> its most frequent successor' (counted over the training
    continuations) on the held-out continuations: how far the last token alone predicts the next one."""
    table: dict[int, Counter] = {}
    for s in train:
        for a, b in zip(s[PROMPT:], s[PROMPT + 1:], strict=False):
            table.setdefault(a, Counter())[b] += 1
    pairs = [(a, b) for s in held for a, b in zip(s[PROMPT:], s[PROMPT + 1:], strict=False)]
    return sum(a in table and table[a].most_common(1)[0][0] == b for a, b in pairs) / len(pairs)


# ---------------------------------------------------------------- measurements
def timed_run(core: EngineCore, batch: list[list[int]], n: int, tag: str) -> tuple[float, dict[str, list[int]]]:
    for i, p in enumerate(batch):
        core.add_request(Request(f"{tag}{i}", p, SamplingParams(max_tokens=n, ignore_eos=True)))
    out: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    while core.has_work():
        for o in core.step():
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
    return time.perf_counter() - t0, out


def acceptance_per_block(hist: list[int]) -> list[float]:
    """P(draft j + 1 accepted | drafts 1..j accepted) from the histogram (hist[m]: verify steps accepting m)."""
    return [sum(hist[j + 1:]) / max(1, sum(hist[j:])) for j in range(len(hist) - 1)]


def decode_speedup(model, cfg, held: list[list[int]], concurrent: int, n_out: int = 128, repeats: int = 3,
                   k: int = K) -> dict:
    on, off = make_core(model, cfg, k), make_core(model, cfg)
    t_on, t_off, same = [], [], True
    for r in range(repeats):
        batch = [held[(r * concurrent + i) % len(held)] for i in range(concurrent)]
        s_off, o_off = timed_run(off, batch, n_out, f"r{r}_")
        s_on, o_on = timed_run(on, batch, n_out, f"r{r}_")
        t_off.append(s_off)
        t_on.append(s_on)
        same &= o_on == o_off
    tokens = concurrent * n_out
    spec = on.spec_stats()
    assert spec is not None
    # per-step cost (whole runs / their steps): what a step with drafting and verification costs vs a plain one
    ms_on, ms_off = 1e3 * sum(t_on) / on.num_steps, 1e3 * sum(t_off) / off.num_steps
    return {"tokens_per_s_on": tokens / min(t_on), "tokens_per_s_off": tokens / min(t_off),
            "speedup": min(t_off) / min(t_on), "accepted_len": spec.accepted_len,
            "accept_hist": list(spec.accept_hist), "acceptance_per_block": acceptance_per_block(list(spec.accept_hist)),
            "ms_per_step_on": ms_on, "ms_per_step_off": ms_off, "step_cost_ratio": ms_on / ms_off,
            "greedy_identical": same}


def short_output_latency(model, cfg, held: list[list[int]], n_out: int = 8, repeats: int = 7) -> dict:
    """Time to the 8th token of one 8-token request, MTP drafting already in the last prefill step vs not."""
    cores = {True: make_core(model, cfg, K), False: make_core(model, cfg, K, speculative_in_prefill=False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(repeats):
        for mode, core in cores.items():
            s, _ = timed_run(core, [held[r % len(held)]], n_out, f"s{r}_")
            times[mode].append(s)
    with_p, without = statistics.median(times[True]), statistics.median(times[False])
    return {"ms_with_mtp_in_prefill": 1e3 * with_p, "ms_without": 1e3 * without, "ratio": with_p / without}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c, d) = plt.subplots(1, 4, figsize=(20, 4))
    hist = results["decode"]["1"]["accept_hist"]
    a.bar([str(i + 1) for i in range(len(hist))], hist)
    a.set_xlabel("tokens emitted per verify step")
    a.set_ylabel("verify steps")
    a.set_title(f"acceptance (1 request): mean {results['accepted_len']:.2f}")
    conc = sorted(results["decode"], key=int)
    x = range(len(conc))
    b.bar([i - 0.2 for i in x], [results["decode"][c]["tokens_per_s_off"] for c in conc], 0.4, label="MTP off")
    b.bar([i + 0.2 for i in x], [results["decode"][c]["tokens_per_s_on"] for c in conc], 0.4, label=f"MTP k={K}")
    b.set_xticks(list(x), [f"{c} concurrent" for c in conc])
    b.set_ylabel("output tokens/s")
    b.set_title("decode throughput (tiny model, CPU, 1 thread)")
    b.legend()
    training = results["training"]["training"]
    if "curve" in training:  # (from the run that trained the cached blocks when loaded from the cache)
        steps = [p["step"] for p in training["curve"]]
        for j in range(K):
            c.plot(steps, [p["held_top1"][j] for p in training["curve"]], marker="o", label=f"block {j} held-out")
            c.plot(steps, [p["train_top1"][j] for p in training["curve"]], ls="--", color=f"C{j}",
                   label=f"block {j} train")
    c.axhline(results["training"]["held_bigram_accuracy"], color="grey", ls=":", label="last-token lookup table")
    c.axhline(results["training"]["held_copy_accuracy"], color="black", ls="-.",
              label="copy of the last 3-gram's successor")
    c.set_xlabel("training step")
    c.set_ylabel("top-1 vs the target's greedy token")
    c.set_title("MTP blocks' learning curve")
    c.legend(fontsize=7)
    target = results["target"]["training"]
    if "curve" in target:
        steps = [p["step"] for p in target["curve"]]
        d.plot(steps, [p["held"]["top1"] for p in target["curve"]], marker="o", label="held-out files")
        d.plot(steps, [p["train"]["top1"] for p in target["curve"]], ls="--", label="training files")
    d.set_xlabel("training step")
    d.set_ylabel("next-byte top-1")
    d.set_title("target: tiny model as a byte LM on the repo's docs")
    d.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: tiny training and measurement sizes")
    p.add_argument("--out", type=Path, default=None, help="the JSON (PNG beside it); default bench/results/mtp.json, "
                   "with --quick .run/bench-quick/mtp.json")
    a = p.parse_args(argv)
    out = a.out or (QUICK_RESULTS if a.quick else RESULTS) / "mtp.json"
    target_kw: dict = {}
    dec_kw: dict = {}
    short_kw: dict = {}
    if a.quick:
        globals().update(QUICK)
        target_kw = {"steps": QUICK_TARGET_STEPS,
                     "commit": CORPUS_COMMIT if has_commit(ROOT, CORPUS_COMMIT) else "HEAD"}
        dec_kw, short_kw = QUICK_DECODE, QUICK_SHORT
    torch.set_num_threads(1)
    torch.manual_seed(0)
    load_start = os.getloadavg()
    model, cfg = load_model(None)
    target, train_text, held_text = trained_target(model, cfg, ROOT, CACHE, **target_kw)
    info, held = trained_model(model, cfg, train_text, held_text)
    decode = {str(c): decode_speedup(model, cfg, held, c, **dec_kw) for c in (1, 8)}
    # k above the 3 MTP blocks: draft steps 3 and 4 reuse block 2, chained (it was trained for step 2 only)
    chained = decode_speedup(model, cfg, held, 1, k=CHAINED_K, **dec_kw)
    short = short_output_latency(model, cfg, held, **short_kw)
    results = {
        "accepted_len": decode["1"]["accepted_len"],
        "acceptance_per_block": decode["1"]["acceptance_per_block"],
        "step_cost_ratio_1": decode["1"]["step_cost_ratio"],
        "decode_speedup_1": decode["1"]["speedup"],
        "decode_speedup_8": decode["8"]["speedup"],
        "short_output_latency_ratio": short["ratio"],
        "greedy_identical": all(d["greedy_identical"] for d in (*decode.values(), chained)),
        "speculative_tokens": K,
        "quick": a.quick,
        "decode": decode,
        f"chained_k{CHAINED_K}_1": chained,
        "short_output": short,
        "target": target,
        "training": info,
        "goals": {k: f"{op} {v}" for k, (op, v) in GOALS.items()},
        "load_average": {"start": load_start, "end": os.getloadavg(), "cpus": os.cpu_count()},
    }
    results["goals_met"] = {k: _meets(results[k], op, v) for k, (op, v) in GOALS.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    print(json.dumps({k: results[k] for k in ("accepted_len", "acceptance_per_block", "step_cost_ratio_1",
                                              "decode_speedup_1", "decode_speedup_8",
                                              "short_output_latency_ratio", "greedy_identical", "goals_met",
                                              "load_average")},
                     indent=2))
    print(f"chained k={CHAINED_K}: accepted_len {chained['accepted_len']:.2f}, speedup {chained['speedup']:.2f}")
    print(f"wrote {out} and {out.with_suffix('.png').name}")


def _meets(value, op: str, goal) -> bool:
    if op == "==":
        return value == goal
    return value >= goal if op == ">=" else value <= goal and not math.isnan(value)


if __name__ == "__main__":
    main()
