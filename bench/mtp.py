"""MTP speculative decoding benchmark (#17).

    python -m bench.mtp   ->  bench/results/mtp.json, bench/results/mtp.png

A random tiny model's MTP blocks accept nothing, so the bench first trains them (the main model frozen) to
predict the main model's own greedy continuations: block j at position i reads token i+1+j and block j-1's
hidden state and predicts token i+2+j (teacher forcing, the scheme the engine drafts with, docs/mtp.md). The
trained blocks are cached under .cache/mtp/ (ignored by git). Measured on held-out prompts:

- accepted_len: mean tokens emitted per verify step with 3 MTP blocks (goal >= 2.5);
- decode_speedup_1 / decode_speedup_8: output tokens/s MTP on / off at 1 and 8 concurrent requests, runs
  interleaved in this process (goal >= 1.8 at 1);
- short_output_latency_ratio: time to the 8th token of an 8-token output with MTP in prefill / without (the
  first decode step then verifies drafts at once; report);
- greedy_identical: greedy outputs with MTP equal MTP off for every held-out prompt.

The machine's cores are shared, so torch runs one thread (the tiny model's matmuls do not gain from more).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from libs.engine import EngineConfig, EngineCore, Request, SamplingParams
from libs.model import load_model
from libs.model.layers import apply_partial_rope, rope_cos_sin
from libs.model.paged import BatchMeta, KVPools

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CACHE = ROOT / ".cache" / "mtp"
K = 3
PROMPT, CONT = 16, 96  # training sequences: random prompt + the model's greedy continuation
N_TRAIN, N_HELD = 320, 16
TRAIN_STEPS, BATCH, LR = 200, 16, 3e-3
GOALS = {"accepted_len": (">=", 2.5), "decode_speedup_1": (">=", 1.8), "greedy_identical": ("==", True)}


def prompts(seed: int, n: int, length: int = PROMPT) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n, length), generator=g).tolist()


def make_core(model, cfg, k: int = 0, **opts) -> EngineCore:
    base = dict(page_size=16, num_full_pages=2048, num_swa_pages=512, max_num_batched_tokens=512,
                max_num_seqs=64, bucket_edges=(), speculative_tokens=k)
    base.update(opts)
    return EngineCore(EngineConfig(**base), model, cfg)


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
    pos = torch.arange(n)
    cos, sin = rope_cos_sin(pos, model.inv_freq_swa, x.dtype)
    q = apply_partial_rope(F.linear(x, att.q_proj.weight).view(b * n, hq, d), cos.repeat(b, 1), sin.repeat(b, 1))
    k = apply_partial_rope(F.linear(x, att.k_proj.weight).view(b * n, hkv, d), cos.repeat(b, 1), sin.repeat(b, 1))
    v = F.linear(x, att.v_proj.weight).view(b, n, hkv, dv) * att.v_scale
    g = hq // hkv
    q = q.view(b, n, hq, d).transpose(1, 2)  # [B, Hq, L, D]
    k = k.view(b, n, hkv, d).transpose(1, 2).repeat_interleave(g, dim=1)
    v = v.transpose(1, 2).repeat_interleave(g, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * att.scale
    qi, ki = pos[:, None], pos[None, :]
    visible = (ki <= qi) & (qi - ki <= cfg.window_left)
    scores = scores.masked_fill(~visible, float("-inf"))
    if att.attention_sink_bias is not None:
        sink = att.attention_sink_bias.view(1, hq, 1, 1).expand(b, hq, n, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(b, n, hq * dv)
    h = h + att.o_proj(out)
    mlp, y = layer.mlp, layer.pre_mlp_layernorm(h)
    h = h + mlp.down_proj(F.silu(F.linear(y, mlp.gate_proj.weight)) * F.linear(y, mlp.up_proj.weight))
    return layer.final_layernorm(h)


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


def soft_loss(model, seqs: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Distillation: each block's logits against the target's own next-token distribution at the position of
    its label (soft labels carry more than the argmax), plus the hard label."""
    target = F.softmax(model.lm_head(hidden).detach(), dim=-1)  # [B, L, V]: position p predicts token p + 1
    total = torch.zeros(())
    for j, (lg, lab) in enumerate(chain_logits(model, seqs, hidden)):
        first = max(0, PROMPT - 2 - j)
        m = lg.shape[1]
        soft = target[:, 1 + j + first:1 + j + first + m]
        logp = F.log_softmax(lg, dim=-1)
        total = total - (soft * logp).sum(-1).mean() + F.cross_entropy(lg.reshape(-1, lg.shape[-1]), lab.reshape(-1))
    return total


@torch.no_grad()
def target_hidden(model, cfg, seqs: list[list[int]]) -> torch.Tensor:
    rows = []
    for s in seqs:
        n = len(s)
        pages = -(-n // 16)
        kv = KVPools.allocate(cfg, pages, pages, 16)
        table = [list(range(pages))]
        _, h = model(torch.tensor(s), BatchMeta.build([n], [n], table), kv, return_hidden=True)
        rows.append(h)
    return torch.stack(rows)


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


def train(model, cfg, seqs: torch.Tensor, hidden: torch.Tensor) -> dict:
    params = [p for p in model.model.mtp.parameters()]
    frozen = [p for p in model.parameters() if all(p is not q for q in params)]
    for p in frozen:
        p.requires_grad_(False)
    opt = torch.optim.Adam(params, lr=LR)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, TRAIN_STEPS)
    g = torch.Generator().manual_seed(0)
    losses = []
    t0 = time.perf_counter()
    for _ in range(TRAIN_STEPS):
        idx = torch.randint(0, seqs.shape[0], (BATCH,), generator=g)
        loss = soft_loss(model, seqs[idx], hidden[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()) / K)
    for p in frozen:
        p.requires_grad_(True)
    return {"steps": TRAIN_STEPS, "seconds": time.perf_counter() - t0, "first_loss": losses[0],
            "last_loss": statistics.mean(losses[-20:])}


@torch.no_grad()
def block_accuracy(model, seqs: torch.Tensor, hidden: torch.Tensor) -> list[float]:
    return [float((lg.argmax(-1) == lab).float().mean()) for lg, lab in chain_logits(model, seqs, hidden)]


def trained_model(model, cfg) -> tuple[dict, list[list[int]]]:
    """Train (or load from .cache/mtp) the MTP blocks; returns training facts and the held-out prompts."""
    base = make_core(model, cfg)
    train_prompts = prompts(1, N_TRAIN)
    held = prompts(2, N_HELD)
    key = hashlib.sha256(json.dumps([PROMPT, CONT, N_TRAIN, TRAIN_STEPS, BATCH, LR, K]).encode()
                         + b"".join(p.detach().float().numpy().tobytes()[:4096] for p in
                                    (model.lm_head.weight, model.model.embed_tokens.weight))).hexdigest()[:16]
    path = CACHE / f"tiny-mtp-{key}.pt"
    info: dict = {"cache": str(path.relative_to(ROOT))}
    t0 = time.perf_counter()
    seqs = [p + c for p, c in zip(train_prompts, generate(base, train_prompts, CONT), strict=True)]
    hidden = target_hidden(model, cfg, seqs)
    info["data_seconds"] = time.perf_counter() - t0
    info["dense_vs_paged_max_abs"] = check_dense_matches_paged(model, cfg, seqs[0], hidden[0])
    held_seqs = [p + c for p, c in zip(held, generate(base, held, CONT), strict=True)]
    held_hidden = target_hidden(model, cfg, held_seqs)
    info["held_block_accuracy_before"] = block_accuracy(model, torch.tensor(held_seqs), held_hidden)
    if path.exists():
        model.model.mtp.load_state_dict(torch.load(path))
        info["training"] = "loaded from cache"
    else:
        info["training"] = train(model, cfg, torch.tensor(seqs), hidden)
        CACHE.mkdir(parents=True, exist_ok=True)
        torch.save(model.model.mtp.state_dict(), path)
    info["held_block_accuracy"] = block_accuracy(model, torch.tensor(held_seqs), held_hidden)
    return info, held


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


def decode_speedup(model, cfg, held: list[list[int]], concurrent: int, n_out: int = 128, repeats: int = 3) -> dict:
    on, off = make_core(model, cfg, K), make_core(model, cfg)
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
    return {"tokens_per_s_on": tokens / min(t_on), "tokens_per_s_off": tokens / min(t_off),
            "speedup": min(t_off) / min(t_on), "accepted_len": spec.accepted_len,
            "accept_hist": list(spec.accept_hist), "greedy_identical": same}


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

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, cfg = load_model(None)
    info, held = trained_model(model, cfg)
    decode = {str(c): decode_speedup(model, cfg, held, c) for c in (1, 8)}
    short = short_output_latency(model, cfg, held)
    results = {
        "accepted_len": decode["1"]["accepted_len"],
        "decode_speedup_1": decode["1"]["speedup"],
        "decode_speedup_8": decode["8"]["speedup"],
        "short_output_latency_ratio": short["ratio"],
        "greedy_identical": all(d["greedy_identical"] for d in decode.values()),
        "speculative_tokens": K,
        "decode": decode,
        "short_output": short,
        "training": info,
        "goals": {k: f"{op} {v}" for k, (op, v) in GOALS.items()},
    }
    results["goals_met"] = {k: _meets(results[k], op, v) for k, (op, v) in GOALS.items()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "mtp.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / "mtp.png")
    print(json.dumps({k: results[k] for k in ("accepted_len", "decode_speedup_1", "decode_speedup_8",
                                              "short_output_latency_ratio", "greedy_identical", "goals_met")},
                     indent=2))


def _meets(value, op: str, goal) -> bool:
    if op == "==":
        return value == goal
    return value >= goal if op == ">=" else value <= goal and not math.isnan(value)


if __name__ == "__main__":
    main()
