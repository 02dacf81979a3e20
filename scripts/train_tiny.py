"""The MTP bench's target: the tiny model trained briefly as a byte-level LM on the repository's own markdown.

A random tiny model's continuations are nearly unpredictable, so MTP blocks trained on it learn little
(docs/mtp.md). `trained_target` trains the main model's weights (not the MTP blocks, not the vision tower)
from the tiny random init on every ``*.md`` file at the pinned `CORPUS_COMMIT` (read with ``git show``, so
doc edits do not change the figures), holding out whole files (`HELD_FILES`) for the bench's prompts. The
dense training forward (`dense_forward`) is checked against the paged forward. The result is cached under
``.cache/mtp/``, keyed on the recipe, the corpus and the random init.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.moe import sigmoid_topk_route
from libs.model.layers import apply_partial_rope, rope_cos_sin
from libs.model.paged import BatchMeta, KVPools

CORPUS_COMMIT = "8f4c59d"  # the docs the target learns from (the base of the bench's branch)
HELD_FILES = ("docs/routing.md", "docs/faults.md")
SEQ, BATCH, STEPS, LR, WEIGHT_DECAY = 128, 16, 1200, 3e-3, 0.01
CURVE_EVERY = 200


# ---------------------------------------------------------------- text
def corpus(root: Path, commit: str = CORPUS_COMMIT) -> tuple[dict[str, bytes], str]:
    """{path: bytes} of every markdown file at `commit`, and a digest of them."""
    names = subprocess.run(["git", "-C", str(root), "ls-tree", "-r", "--name-only", commit],
                           check=True, capture_output=True, text=True).stdout.split()
    files = {n: subprocess.run(["git", "-C", str(root), "show", f"{commit}:{n}"], check=True,
                               capture_output=True).stdout for n in sorted(names) if n.endswith(".md")}
    digest = hashlib.sha256(b"".join(n.encode() + b"\0" + files[n] for n in files)).hexdigest()[:16]
    return files, digest


def split(files: dict[str, bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """(train bytes, held-out bytes) as int64 token ids, files joined by a blank line."""
    def join(parts: list[bytes]) -> torch.Tensor:
        return torch.tensor(list(b"\n\n".join(parts)), dtype=torch.int64)

    return (join([b for n, b in files.items() if n not in HELD_FILES]),
            join([b for n, b in files.items() if n in HELD_FILES]))


def windows(text: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """n random windows ``[n, length]`` of the text."""
    start = torch.randint(0, text.numel() - length, (n,), generator=gen)
    return text[start[:, None] + torch.arange(length)[None, :]]


# ---------------------------------------------------------------- dense (differentiable) forward of the target
def dense_attention(model, att, x: torch.Tensor) -> torch.Tensor:
    """One attention layer over whole sequences ``[B, L, H]``: full layers causal, SWA layers the window +
    sinks (bench.mtp.window_attention)."""
    from bench.mtp import window_attention  # noqa: PLC0415 (bench.mtp imports this module)

    b, n, _ = x.shape
    hq, hkv, d, dv = att.num_heads, att.num_kv_heads, att.qk_dim, att.v_dim
    inv_freq = model.inv_freq_swa if att.is_swa else model.inv_freq_full
    cos, sin = rope_cos_sin(torch.arange(n), inv_freq, x.dtype)
    qk = F.linear(x, torch.cat([att.q_proj.weight, att.k_proj.weight])).view(b * n, hq + hkv, d)
    qk = apply_partial_rope(qk, cos.repeat(b, 1), sin.repeat(b, 1)).view(b, n, hq + hkv, d)
    v = F.linear(x, att.v_proj.weight).view(b, n, hkv, dv) * att.v_scale
    q, k = qk[:, :, :hq], qk[:, :, hq:]
    if att.is_swa:
        out = window_attention(q, k, v, model.cfg.window_left, att.scale, att.attention_sink_bias)
    else:
        assert att.attention_sink_bias is None  # the tiny model's full layers have no sinks
        g = hq // hkv
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(g, 1),
                                             v.transpose(1, 2).repeat_interleave(g, 1), is_causal=True,
                                             scale=att.scale)
        out = out.transpose(1, 2).reshape(b, n, hq * dv)
    return att.o_proj(out)


def dense_moe(model, moe, x: torch.Tensor) -> torch.Tensor:
    """The MoE layer with every expert on every token, weighted by the (differentiable) routing weights."""
    c, shape = model.cfg, x.shape
    x = x.reshape(-1, shape[-1])
    w, ids = sigmoid_topk_route(F.linear(x.float(), moe.gate.weight.float()), moe.gate.e_score_correction_bias,
                                c.num_experts_per_tok, n_group=c.n_group, topk_group=c.topk_group,
                                renormalize=c.norm_topk_prob, scaling=c.routed_scaling_factor)
    dense_w = torch.zeros(x.shape[0], c.num_experts, dtype=x.dtype).scatter_add(1, ids, w.to(x.dtype))
    gate, up = torch.matmul(x, moe.experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, T, I]
    y = torch.matmul(F.silu(gate) * up, moe.experts.down_proj.transpose(1, 2))  # [E, T, H]
    return (y * dense_w.t().unsqueeze(-1)).sum(0).view(shape)


def dense_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """Final-norm hidden states ``[B, L, H]`` of token ids ``[B, L]`` (each row a sequence from position 0)."""
    h = model.model.embed_tokens(ids)
    for layer in model.model.layers:
        h = h + dense_attention(model, layer.self_attn, layer.input_layernorm(h))
        y = layer.post_attention_layernorm(h)
        if hasattr(layer.mlp, "experts"):
            h = h + dense_moe(model, layer.mlp, y)
        else:
            mlp = layer.mlp
            h = h + mlp.down_proj(F.silu(F.linear(y, mlp.gate_proj.weight)) * F.linear(y, mlp.up_proj.weight))
    return model.model.norm(h)


def check_dense_matches_paged(model, cfg, seq: torch.Tensor) -> float:
    """Max |logits| difference of `dense_forward` vs the engine's paged forward over one sequence."""
    n = seq.numel()
    pages = -(-n // 16)
    with torch.no_grad():
        dense = model.lm_head(dense_forward(model, seq[None]))[0]
    paged = model(seq, BatchMeta.build([n], [n], [list(range(pages))], all_logits=True),
                  KVPools.allocate(cfg, pages, pages, 16))
    return float((dense - paged).abs().max())


# ---------------------------------------------------------------- training
def trainable(model) -> list[torch.nn.Parameter]:
    """The main model's weights (not the MTP blocks, not the vision tower)."""
    skip = {id(p) for p in model.model.mtp.parameters()}
    if getattr(model, "visual", None) is not None:
        skip |= {id(p) for p in model.visual.parameters()}
    return [p for name, p in model.named_parameters() if id(p) not in skip and not name.startswith("visual")]


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model.lm_head(dense_forward(model, batch[:, :-1]))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, batch: torch.Tensor) -> dict:
    """Next-byte loss (nats) and top-1 on a fixed batch."""
    logits = model.lm_head(dense_forward(model, batch[:, :-1]))
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    return {"loss": float(loss), "top1": float((logits.argmax(-1) == batch[:, 1:]).float().mean())}


def train_target(model, train_text: torch.Tensor, held_text: torch.Tensor, steps: int = STEPS) -> dict:
    params = trainable(model)
    others = [p for p in model.parameters() if all(p is not q for q in params)]
    for p in others:
        p.requires_grad_(False)
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, LR, total_steps=steps, pct_start=0.05)
    g = torch.Generator().manual_seed(0)
    eval_train = windows(train_text, 32, SEQ + 1, torch.Generator().manual_seed(10))
    eval_held = windows(held_text, 32, SEQ + 1, torch.Generator().manual_seed(11))
    curve = []
    t0 = time.perf_counter()
    for step in range(steps + 1):
        if step % CURVE_EVERY == 0 or step == steps:
            curve.append({"step": step, "train": evaluate(model, eval_train), "held": evaluate(model, eval_held),
                          "seconds": time.perf_counter() - t0})
        if step == steps:
            break
        loss = lm_loss(model, windows(train_text, BATCH, SEQ + 1, g))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
    for p in others:
        p.requires_grad_(True)
    return {"steps": steps, "batch": BATCH, "seq": SEQ, "lr": LR, "seconds": time.perf_counter() - t0,
            "curve": curve}


def has_commit(root: Path, commit: str) -> bool:
    """Whether the checkout's history holds `commit` (a shallow clone may not)."""
    return subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{commit}^{{commit}}"],
                          capture_output=True).returncode == 0


def trained_target(model, cfg, root: Path, cache: Path, steps: int = STEPS,
                   commit: str = CORPUS_COMMIT) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Train (or load from the cache) the target; returns its facts and the (train, held-out) text. `steps` and
    `commit` (the corpus) other than the defaults: a --quick run's."""
    files, digest = corpus(root, commit)
    train_text, held_text = split(files)
    init = hashlib.sha256(b"".join(p.detach().float().numpy().tobytes()[:4096] for p in trainable(model)))
    key = hashlib.sha256(json.dumps([commit, HELD_FILES, digest, SEQ, BATCH, steps, LR, WEIGHT_DECAY,
                                     "adamw-onecycle-clip1", init.hexdigest()]).encode()).hexdigest()[:16]
    path = cache / f"tiny-target-{key}.pt"
    info: dict = {"corpus_commit": commit, "corpus_files": len(files), "train_bytes": train_text.numel(),
                  "held_files": list(HELD_FILES), "held_bytes": held_text.numel(), "cache": str(path.relative_to(root))}
    info["dense_vs_paged_max_abs_before"] = check_dense_matches_paged(model, cfg, held_text[:200])
    facts = path.with_suffix(".json")  # the training facts (learning curve) of the run that trained the cache
    if path.exists():
        model.load_state_dict(torch.load(path), strict=False)
        info["training"] = {"loaded_from_cache": True, **(json.loads(facts.read_text()) if facts.exists() else {})}
    else:
        info["training"] = train_target(model, train_text, held_text, steps)
        cache.mkdir(parents=True, exist_ok=True)
        names = {id(p) for p in trainable(model)}
        torch.save({n: p.detach().clone() for n, p in model.named_parameters() if id(p) in names}, path)
        facts.write_text(json.dumps(info["training"]))
    info["dense_vs_paged_max_abs"] = check_dense_matches_paged(model, cfg, held_text[:200])
    info["held"] = evaluate(model, windows(held_text, 32, SEQ + 1, torch.Generator().manual_seed(11)))
    info["held"]["bits_per_byte"] = info["held"]["loss"] / math.log(2)
    return info, train_text, held_text


# ---------------------------------------------------------------- the built-in model of `make run`
DEFAULT_DIR = Path(__file__).resolve().parent.parent / "models" / "windserve-tiny"


def unigram_bits_per_byte(train_text: torch.Tensor, held_text: torch.Tensor) -> float:
    """Cross-entropy of the held-out bytes under the training text's byte frequencies (add-one smoothed): the
    baseline a language model has to beat."""
    counts = torch.bincount(train_text, minlength=256).double() + 1.0
    logp = (counts / counts.sum()).log2()
    return float(-logp[held_text].mean())


def write_default(root: Path, out: Path = DEFAULT_DIR, steps: int = STEPS) -> dict:
    """Train (or load from `.cache/mtp/`, the MTP bench's cache of the same recipe) the tiny model on the
    repository's docs and write its trained parameters to `out/weights.safetensors`, its facts to
    `out/training.json`. Deterministic: fixed seeds, one recipe, the corpus of a pinned commit."""
    from safetensors.torch import save_file

    from libs.model import load_model

    torch.manual_seed(0)
    model, cfg = load_model(None)
    info, train_text, held_text = trained_target(model, cfg, root, root / ".cache" / "mtp", steps=steps)
    names = {id(p) for p in trainable(model)}
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters() if id(p) in names},
              out / "weights.safetensors")
    facts = {"corpus_commit": info["corpus_commit"], "train_bytes": info["train_bytes"],
             "held_files": info["held_files"], "held_bytes": info["held_bytes"], "steps": steps,
             "parameters_trained": sum(p.numel() for p in trainable(model)),
             "held_bits_per_byte": round(info["held"]["bits_per_byte"], 4),
             "held_top1": round(info["held"]["top1"], 4),
             "unigram_bits_per_byte": round(unigram_bits_per_byte(train_text, held_text), 4)}
    (out / "training.json").write_text(json.dumps(facts, indent=1) + "\n")
    return facts


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m scripts.train_tiny", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help="where the weights and facts go")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    print(json.dumps(write_default(Path(__file__).resolve().parent.parent, args.out, args.steps), indent=1))


if __name__ == "__main__":
    main()
