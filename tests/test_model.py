"""MiMo-V2 model vs the transformers reference implementation, through the paged KV path; loader errors;
FP8 / fused-qkv / sharded checkpoints; tokenizer; CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.peer import randomize_weights
from kernels.fp8 import dequant_fp8_block, quant_fp8_block
from libs.model import BatchMeta, CheckpointError, KVPools, ModelConfig, load_model, load_tokenizer
from libs.model.compiled import CompiledStep
from libs.model.generate import greedy_generate

transformers = pytest.importorskip("transformers")

WINDOW = 9  # HF meaning: keys in (q-9, q]
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
               "sliding_attention"]
VOCAB = 300


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    cfg = MiMoV2FlashConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, v_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, sliding_window=WINDOW, layer_types=LAYER_TYPES,
        max_position_embeddings=512, attention_value_scale=0.707,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
        },
    )
    torch.manual_seed(0)
    model = MiMoV2FlashForCausalLM(cfg)
    randomize_weights(model, seed=1)  # (HF's std-0.02 init makes logits nearly flat)
    path = tmp_path_factory.mktemp("hf_tiny")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    from transformers import MiMoV2FlashForCausalLM

    return MiMoV2FlashForCausalLM.from_pretrained(hf_dir).eval()


@pytest.fixture(scope="module", params=["eager", "compiled"])
def ours(hf_dir, request):
    """Our model over the same checkpoint, eager and on the compiled step (libs/model/compiled.py: a pure decode
    forward is one compiled graph, other forwards compile each layer's dense segments)."""
    model, cfg = load_model(str(hf_dir), progress=False)
    if request.param == "compiled":
        model.set_compiled(CompiledStep(max_tokens=512))
    return model, cfg


def _hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids[None]).logits[0].float()


@pytest.mark.integration
def test_config_parsed_from_transformers_save(ours):
    _, cfg = ours
    assert cfg.layer_is_swa == (False, True, True, False, True, True)
    assert (cfg.kv_heads_full, cfg.kv_heads_swa) == (1, 2)  # transformers doubles KV heads on SWA layers
    assert (cfg.qk_head_dim, cfg.v_head_dim, cfg.rotary_dim, cfg.sliding_window) == (32, 16, 16, WINDOW)
    assert cfg.layer_is_moe == (False,) + (True,) * 5 and cfg.n_group == 2


@pytest.mark.integration
def test_one_pass_matches_transformers(hf_model, ours):
    model, cfg = ours
    torch.manual_seed(2)
    n = 5 * WINDOW + 3
    ids = torch.randint(0, VOCAB, (n,))
    kv = KVPools.allocate(cfg, 40, 40, page_size=4)
    full_pages = torch.randperm(40)[:12].tolist()
    swa_pages = torch.randperm(40)[:12].tolist()
    meta = BatchMeta.build([n], [n], [full_pages], [swa_pages], all_logits=True)
    got = model(ids, meta, kv)
    ref = _hf_logits(hf_model, ids)
    assert ref.std() > 0.5  # the comparison is not between near-constant logits
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def _drop_out_of_window(table_row: torch.Tensor, pool_k: torch.Tensor, first_new_pos: int, page: int) -> None:
    """Unmap SWA pages no new token can see and poison their contents (they must never be read)."""
    first_visible = max(0, first_new_pos - (WINDOW - 1))
    for j in range(first_visible // page):
        if table_row[j] >= 0:
            pool_k[:, table_row[j]] = float("nan")
            table_row[j] = -1


@pytest.mark.integration
def test_chunked_prefill_and_decode_batch_matches_transformers(hf_model, ours):
    """Two sequences advance together: odd-sized prefill chunks, then token-by-token decode, mixed in one
    batch; shuffled non-contiguous pages; SWA pages that left the window are unmapped (-1) and poisoned."""
    model, cfg = ours
    page = 4
    torch.manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (n,)) for n in (41, 30)]
    refs = [_hf_logits(hf_model, s) for s in seqs]
    schedules = [[7, 5] + [1] * 29, [3, 11, 9] + [1] * 7]
    n_pages = 12
    kv = KVPools.allocate(cfg, 2 * n_pages, 2 * n_pages + 1, page)
    full_tab = torch.randperm(2 * n_pages).view(2, n_pages)
    swa_tab = torch.randperm(2 * n_pages + 1)[: 2 * n_pages].view(2, n_pages)
    done = [0, 0]
    for step in range(max(len(s) for s in schedules)):
        active = [b for b in range(2) if step < len(schedules[b])]
        q_lens = [schedules[b][step] for b in active]
        kv_lens = [done[b] + q for b, q in zip(active, q_lens, strict=True)]
        for b in active:
            _drop_out_of_window(swa_tab[b], kv.swa_k, done[b], page)
        meta = BatchMeta(q_lens, kv_lens, full_tab[active].clone(), swa_tab[active].clone(),
                         logits_indices=torch.arange(sum(q_lens)))
        ids = torch.cat([seqs[b][done[b]:kv_lens[i]] for i, b in enumerate(active)])
        got = model(ids, meta, kv)
        row = 0
        for i, b in enumerate(active):
            torch.testing.assert_close(got[row:row + q_lens[i]], refs[b][done[b]:kv_lens[i]], atol=2e-4, rtol=1e-4)
            row += q_lens[i]
            done[b] = kv_lens[i]
    assert done == [41, 30]
    assert bool((swa_tab == -1).any())  # the out-of-window path was really exercised


@pytest.mark.integration
def test_token_by_token_decode_matches_transformers(hf_model, ours):
    model, cfg = ours
    torch.manual_seed(4)
    ids = torch.randint(0, VOCAB, (3 * WINDOW,))
    ref = _hf_logits(hf_model, ids)
    kv = KVPools.allocate(cfg, 8, 8, page_size=16)
    for t in range(ids.numel()):
        meta = BatchMeta.build([1], [t + 1], [[5, 2]], [[7, 0]])
        torch.testing.assert_close(model(ids[t:t + 1], meta, kv)[0], ref[t], atol=2e-4, rtol=1e-4)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    edit(tensors, dst)
    return dst


def _save_sharded(tensors: dict[str, torch.Tensor], dst: Path) -> None:
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, dst / fname)
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.integration
def test_missing_tensor_is_named(hf_dir, tmp_path):
    victim = "model.layers.2.mlp.experts.3.up_proj.weight"

    def edit(t, dst):
        del t[victim]
        save_file(t, dst / "model.safetensors")

    d = _rewrite(hf_dir, tmp_path / "ckpt", edit)
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
        load_model(str(d), progress=False)


@pytest.mark.integration
def test_mismatched_tensor_is_named(hf_dir, tmp_path):
    def edit(t, dst):
        t["model.layers.4.self_attn.v_proj.weight"] = torch.zeros(8, 64)
        save_file(t, dst / "model.safetensors")

    d = _rewrite(hf_dir, tmp_path / "ckpt", edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.4\.self_attn\.v_proj\.weight.*\(8, 64\)"):
        load_model(str(d), progress=False)


@pytest.mark.integration
def test_unexpected_tensor_is_named(hf_dir, tmp_path):
    def edit(t, dst):
        t["model.layers.1.self_attn.bogus.weight"] = torch.zeros(2)
        save_file(t, dst / "model.safetensors")

    d = _rewrite(hf_dir, tmp_path / "ckpt", edit)
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.1\.self_attn\.bogus\.weight"):
        load_model(str(d), progress=False)


def _fuse_qkv(t: dict[str, torch.Tensor], layer: int, kv_heads: int, heads=4, qk=32, v=16) -> torch.Tensor:
    """Build the V2.5 layout [Q_c | K_c | V_c] per KV head from separate projections."""
    pre = f"model.layers.{layer}.self_attn."
    q = t.pop(pre + "q_proj.weight").view(kv_heads, heads // kv_heads * qk, -1)
    k = t.pop(pre + "k_proj.weight").view(kv_heads, qk, -1)
    vv = t.pop(pre + "v_proj.weight").view(kv_heads, v, -1)
    return torch.cat([q, k, vv], dim=1).reshape(-1, q.shape[-1])


@pytest.mark.integration
def test_fused_qkv_sharded_checkpoint_matches_transformers(hf_dir, hf_model, tmp_path):
    def edit(t, dst):
        for layer, kind in enumerate(LAYER_TYPES):
            kvh = 2 if kind == "sliding_attention" else 1
            t[f"model.layers.{layer}.self_attn.qkv_proj.weight"] = _fuse_qkv(t, layer, kvh)
        _save_sharded(t, dst)

    d = _rewrite(hf_dir, tmp_path / "fused", edit)
    model, cfg = load_model(str(d), progress=False)
    ids = torch.randint(0, VOCAB, (2 * WINDOW,), generator=torch.Generator().manual_seed(5))
    kv = KVPools.allocate(cfg, 8, 8, page_size=8)
    got = model(ids, BatchMeta.build([ids.numel()], [ids.numel()], [[3, 1, 6]], all_logits=True), kv)
    torch.testing.assert_close(got, _hf_logits(hf_model, ids), atol=2e-4, rtol=1e-4)


@pytest.mark.integration
def test_fp8_checkpoint_dequantized_at_load(hf_dir, hf_model, tmp_path):
    quantized = ["model.layers.1.self_attn.q_proj.weight", "model.layers.3.mlp.experts.5.down_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight"]
    stored = {}

    def edit(t, dst):
        for name in quantized:
            q, s = quant_fp8_block(t[name])
            t[name], t[name + "_scale_inv"] = q, s
            stored[name] = dequant_fp8_block(q, s)
        save_file(t, dst / "model.safetensors")

    d = _rewrite(hf_dir, tmp_path / "fp8", edit)
    model, cfg = load_model(str(d), progress=False)
    sd = model.state_dict()
    torch.testing.assert_close(sd["model.layers.1.self_attn.q_proj.weight"], stored[quantized[0]], atol=0, rtol=0)
    torch.testing.assert_close(sd["model.layers.3.mlp.experts.down_proj"][5], stored[quantized[1]], atol=0, rtol=0)
    ids = torch.randint(0, VOCAB, (WINDOW,), generator=torch.Generator().manual_seed(6))
    kv = KVPools.allocate(cfg, 4, 4, page_size=4)
    got = model(ids, BatchMeta.build([ids.numel()], [ids.numel()], [[0, 1, 2]], all_logits=True), kv)
    ref = _hf_logits(hf_model, ids)
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()  # FP8 rounding only


@pytest.mark.integration
def test_fp8_without_scales_is_named(hf_dir, tmp_path):
    def edit(t, dst):
        name = "model.layers.0.self_attn.o_proj.weight"
        t[name] = quant_fp8_block(t[name])[0]
        save_file(t, dst / "model.safetensors")

    d = _rewrite(hf_dir, tmp_path / "fp8bad", edit)
    with pytest.raises(CheckpointError, match=r"o_proj\.weight_scale_inv are missing"):
        load_model(str(d), progress=False)


@pytest.mark.unit
def test_mimo_v2_original_fields_parse():
    d = {"model_type": "mimo_v2", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 1, "swa_num_key_value_heads": 4, "head_dim": 32,
         "v_head_dim": 16, "swa_head_dim": 32, "swa_v_head_dim": 16, "hybrid_layer_pattern": [0, 1, 1, 0],
         "moe_layer_freq": [0, 1, 1, 1], "sliding_window_size": 128, "rope_theta": 1e7, "swa_rope_theta": 1e4,
         "partial_rotary_factor": 0.334, "add_swa_attention_sink_bias": True, "layernorm_epsilon": 1e-6,
         "n_routed_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 128, "moe_intermediate_size": 32}
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.layer_is_swa == (False, True, True, False)
    assert (cfg.kv_heads_full, cfg.kv_heads_swa, cfg.sliding_window) == (1, 4, 129)
    assert (cfg.rope_theta_full, cfg.rope_theta_swa, cfg.rms_norm_eps) == (1e7, 1e4, 1e-6)
    assert cfg.rotary_dim == 10
    with pytest.raises(ValueError, match="unsupported model_type"):
        ModelConfig.from_hf_dict({**d, "model_type": "llama"})


@pytest.mark.integration
def test_mtp_paged_decode_matches_one_pass():
    """MTP block through paged KV: token-by-token equals one pass (its attention is SWA, window 16)."""
    model, cfg = load_model(None)
    torch.manual_seed(7)
    n = 40
    ids = torch.randint(0, cfg.vocab_size, (n + 1,))
    kv = KVPools.allocate(cfg, 4, 4, page_size=16)
    _, hidden = model(ids[:n], BatchMeta.build([n], [n], [[0, 1, 2]]), kv, return_hidden=True)
    mtp_kv = KVPools.allocate_mtp(cfg, 4, page_size=16)
    one_pass, _ = model.forward_mtp(0, ids[1:], hidden, BatchMeta.build([n], [n], [[0, 1, 2]], all_logits=True),
                                    mtp_kv)
    mtp_kv2 = KVPools.allocate_mtp(cfg, 4, page_size=16)
    for t in range(n):
        step, _ = model.forward_mtp(0, ids[t + 1:t + 2], hidden[t:t + 1], BatchMeta.build([1], [t + 1], [[3, 0, 1]]),
                                    mtp_kv2)
        torch.testing.assert_close(step[0], one_pass[t], atol=1e-4, rtol=1e-4)


@pytest.mark.integration
def test_tiny_model_deterministic_and_varied():
    m1, _ = load_model(None)
    m2, _ = load_model(None)
    for (n1, p1), (_, p2) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert torch.equal(p1, p2), n1
    ids, logps = greedy_generate(m1, [257, 72, 105], 12)
    assert len(set(ids)) > 3 and all(lp <= 0 for lp in logps)


@pytest.mark.integration
def test_cli_prints_greedy_ids_and_logprobs():
    prompt = [257, 10, 72, 105]
    out = subprocess.run([sys.executable, "-m", "libs.model", "--prompt-ids", ",".join(map(str, prompt)),
                          "--max-new-tokens", "5"], capture_output=True, text=True, timeout=120, check=True)
    res = json.loads(out.stdout)
    # independent check: recompute greedily by re-running the whole prefix each step (no KV reuse)
    model, cfg = load_model(None)
    seq = list(prompt)
    for tok, lp in zip(res["token_ids"], res["logprobs"], strict=True):
        kv = KVPools.allocate(cfg, 1, 1, page_size=16)
        logits = model(torch.tensor(seq), BatchMeta.build([len(seq)], [len(seq)], [[0]]), kv)[0]
        logprobs = torch.log_softmax(logits, -1)
        assert tok == int(logprobs.argmax())
        assert lp == pytest.approx(float(logprobs[tok]), abs=1e-4)
        seq.append(tok)
    assert len(res["token_ids"]) == 5


@pytest.mark.unit
def test_byte_tokenizer_roundtrip_and_chatml():
    tok = load_tokenizer(None)
    text = "héllo <|im_start|>user\nwörld<|im_end|>"
    ids = tok.encode(text)
    assert tok.special_tokens["<|im_start|>"] in ids and max(ids) < 512
    assert tok.decode(ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.special_tokens["<|im_end|>"] in tok.eos_token_ids


@pytest.mark.unit
def test_tokenizer_json_and_template_from_model_dir(tmp_path):
    from tests.fixtures.tokenizers import write_byte_level_tokenizer

    write_byte_level_tokenizer(tmp_path)
    tpl = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
           "{% if add_generation_prompt %}[assistant]{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": tpl}))
    tok = load_tokenizer(str(tmp_path))
    text = "<|im_start|>hello brown fox<|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text)
    assert tok.eos_token_ids[0] == tok.special_tokens["<|im_end|>"]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[user]x[assistant]"


@pytest.mark.parametrize("span_windows", [None, 1])
def test_swa_window_rebuild_from_cached_full_kv(ours, span_windows):
    """Recomputing only the last (SWA layers + 1) windows before E, with the full-attention K/V of [0, E) read from
    the cache and never rewritten, and SWA keys limited to the span, gives the logits of a full pass; one
    window is not enough. Pages the rebuild must not touch hold NaN (SWA below the span is unmapped)."""
    model, cfg = ours
    page, n, e = 4, 200, 140
    span = (len(cfg.swa_layers) + 1) * cfg.sliding_window if span_windows is None else span_windows * cfg.sliding_window
    r = e - span
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(7))
    pages = -(-n // page)
    table = torch.arange(pages).unsqueeze(0)
    ref_kv = KVPools.allocate(cfg, pages, pages, page)
    ref = model(ids, BatchMeta([n], [n], table, table.clone()), ref_kv)[-1]
    kv = KVPools.allocate(cfg, pages, pages, page)
    for t in (kv.full_k, kv.full_v, kv.swa_k, kv.swa_v):
        t.fill_(float("nan"))
    kv.full_k[:, :e // page] = ref_kv.full_k[:, :e // page]
    kv.full_v[:, :e // page] = ref_kv.full_v[:, :e // page]
    cached_k = kv.full_k[:, :e // page].clone()
    swa_table = table.clone()
    swa_table[0, :r // page] = -1
    meta = BatchMeta([n - r], [n], table, swa_table, full_write_from=[e], swa_kv_start=[r])
    out = model(ids[r:], meta, kv)[-1]
    assert torch.equal(kv.full_k[:, :e // page], cached_k)  # the cached full K/V was not rewritten
    assert torch.isfinite(out).all()
    if span_windows is None:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    else:
        assert (out - ref).abs().max() > 1e-3  # far outside the tolerance the full span meets


@pytest.mark.unit
def test_moe_gates_stay_float32_in_a_bf16_model():
    from libs.model.layers import MoEGate

    model, _ = load_model(None, dtype=torch.bfloat16)
    gates = [m for m in model.modules() if isinstance(m, MoEGate)]
    assert gates, "the tiny model has MoE layers"
    assert all(g.weight.dtype is torch.float32 and g.e_score_correction_bias.dtype is torch.float32 for g in gates)
    assert any(p.dtype is torch.bfloat16 for p in model.parameters())
