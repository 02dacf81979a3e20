"""Kernels: paged attention vs dense masked attention with sinks, KV scatter/gather, grouped MoE vs a naive
loop, FP8 block dequantization and the fused-qkv layout on tensors with known answers."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from kernels import (
    dequant_fp8_block,
    fused,
    gather_kv,
    grouped_moe,
    kv_slot_mapping,
    paged_attention,
    plan_paged_attention,
    scatter_kv,
    sigmoid_topk_route,
)
from kernels.attention import paged_attention_ref
from kernels.fp8 import FP8_DTYPE, quant_fp8_block
from kernels.moe import dense_moe, grouped_mm_moe, segmented_moe
from libs.model.weights import dequant_fused_qkv_fp8, split_fused_qkv

HQ, HKV, DQK, DV, PAGE = 4, 2, 12, 8, 4


def dense_reference(q, k, v, window, sinks, scale):
    """Textbook attention for ONE sequence, head by head: q [L, Hq, D] with the L queries being the last L
    positions of k/v [N, Hkv, D]. HF window meaning: key j visible from i iff i - window < j <= i."""
    L, n = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    out = torch.zeros(L, q.shape[1], v.shape[-1], dtype=torch.float64)
    for h in range(q.shape[1]):
        for r in range(L):
            i = n - L + r
            logits = []
            for j in range(n):
                visible = j <= i and (window is None or j > i - window)
                logits.append(float(q[r, h].double() @ k[j, h // g].double()) * scale if visible else -math.inf)
            if sinks is not None:
                logits.append(float(sinks[h]))
            p = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)[:n]
            out[r, h] = p @ v[:, h // g].double()
    return out


def _pools(num_pages):
    k_pool = torch.full((num_pages, PAGE, HKV, DQK), float("nan"))
    v_pool = torch.full((num_pages, PAGE, HKV, DV), float("nan"))
    return k_pool, v_pool


def _run_chunked(seq_lens, chunks, window, use_sinks, drop_out_of_window):
    """Feed each sequence's K/V in chunks (the batch advances all sequences together each step), attend the
    chunk's queries through the paged path and compare with the dense reference rows."""
    torch.manual_seed(0)
    scale = DQK ** -0.5
    sinks = torch.randn(HQ) if use_sinks else None
    data = [(torch.randn(n, HQ, DQK), torch.randn(n, HKV, DQK), torch.randn(n, HKV, DV)) for n in seq_lens]
    max_pages = max(-(-n // PAGE) for n in seq_lens)
    num_pages = len(seq_lens) * max_pages + 3
    perm = torch.randperm(num_pages)  # non-contiguous, shuffled physical pages
    table = torch.stack([perm[b * max_pages:(b + 1) * max_pages] for b in range(len(seq_lens))])
    k_pool, v_pool = _pools(num_pages)
    done = [0] * len(seq_lens)
    window_left = -1 if window is None else window - 1
    step = 0
    while done != list(seq_lens):
        step_chunk = chunks[step] if step < len(chunks) else 1  # then decode one token per step
        step += 1
        q_lens = [min(step_chunk, n - d) for n, d in zip(seq_lens, done, strict=True)]
        active = [b for b, ql in enumerate(q_lens) if ql > 0]
        ql = [q_lens[b] for b in active]
        kl = [done[b] + q_lens[b] for b in active]
        tab = table[active].clone()
        slots = kv_slot_mapping(tab, ql, kl, PAGE)
        scatter_kv(k_pool, v_pool, slots,
                   torch.cat([data[b][1][done[b]:kl[i]] for i, b in enumerate(active)]),
                   torch.cat([data[b][2][done[b]:kl[i]] for i, b in enumerate(active)]))
        if drop_out_of_window and window is not None:
            for i, b in enumerate(active):
                first_needed = max(0, done[b] - window_left)
                dead = first_needed // PAGE
                k_pool[tab[i, :dead]] = float("nan")  # poison: must never be read
                tab[i, :dead] = -1
        q = torch.cat([data[b][0][done[b]:kl[i]] for i, b in enumerate(active)])
        plan = plan_paged_attention(tab, ql, kl, PAGE, window_left)
        out = paged_attention(q, k_pool, v_pool, plan, scale, sinks)
        row = 0
        for i, b in enumerate(active):
            qd, kd, vd = data[b]
            ref = dense_reference(qd[:kl[i]][-ql[i]:], kd[:kl[i]], vd[:kl[i]], window, sinks, scale)
            torch.testing.assert_close(out[row:row + ql[i]].double(), ref, atol=1e-5, rtol=1e-5)
            row += ql[i]
            done[b] = kl[i]


@pytest.mark.unit
@pytest.mark.parametrize("window,sinks", [(None, False), (5, True), (7, False), (6, True)])
def test_paged_prefill_odd_chunks_then_decode(window, sinks):
    # chunk sizes 7, 5, 3 then single-token decode steps: boundaries never align with pages of 4
    _run_chunked([21, 13, 6], [7, 5, 3], window, sinks, drop_out_of_window=False)


@pytest.mark.unit
@pytest.mark.parametrize("window", [5, 8])
def test_swa_pages_out_of_window_may_be_unmapped(window):
    _run_chunked([26, 17], [9, 4], window, True, drop_out_of_window=True)


@pytest.mark.unit
def test_one_pass_prefill_equals_dense():
    _run_chunked([19, 9], [19], 6, True, drop_out_of_window=False)


@pytest.mark.unit
@pytest.mark.parametrize("tile,waste", [(3, 1.0), (4, 1.25), (5, 2.0)])
@pytest.mark.parametrize("window", [None, 5])
def test_prefill_query_tiles_equal_dense(monkeypatch, tile, waste, window):
    """Prefill chunks cut into query tiles (each reading only its visible keys), grouped at any padding bound,
    with out-of-window pages unmapped: still the dense reference."""
    import kernels.attn_plan as attn_plan

    monkeypatch.setattr(attn_plan, "PREFILL_TILE", tile)
    monkeypatch.setattr(attn_plan, "PREFILL_PAD_WASTE", waste)
    _run_chunked([26, 17, 9], [11, 7], window, True, drop_out_of_window=window is not None)


@pytest.mark.unit
def test_unmapped_page_inside_window_is_an_error():
    table = torch.tensor([[0, -1, 2]])
    with pytest.raises(ValueError, match="logical page 1 is unmapped"):
        plan_paged_attention(table, [1], [10], PAGE, window_left=8)


@pytest.mark.unit
def test_scatter_then_gather_roundtrip():
    torch.manual_seed(1)
    k_pool, v_pool = torch.zeros(6, PAGE, HKV, DQK), torch.zeros(6, PAGE, HKV, DV)
    table = torch.tensor([[5, 2, -1], [0, 3, 4]])
    slots = kv_slot_mapping(table, [3, 9], [7, 9], PAGE)
    k, v = torch.randn(12, HKV, DQK), torch.randn(12, HKV, DV)
    scatter_kv(k_pool, v_pool, slots, k, v)
    # position 4 of sequence 0 -> page 2 slot 0; position 8 of sequence 1 -> page 4 slot 0
    torch.testing.assert_close(k_pool[2, 0], k[0])
    torch.testing.assert_close(v_pool[4, 0], v[11])
    k2, v2 = gather_kv(k_pool, v_pool, slots)
    torch.testing.assert_close(k2, k)
    torch.testing.assert_close(v2, v)


def _naive_moe(x, weights, ids, gate_up, down):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(g) * u))
    return out


@pytest.mark.unit
@pytest.mark.parametrize("moe", [grouped_moe, dense_moe, segmented_moe])
def test_moe_paths_match_naive_loop(moe):
    torch.manual_seed(2)
    t, h, i, e, k = 23, 16, 8, 6, 2
    x = torch.randn(t, h, dtype=torch.float64)
    gate_up, down = torch.randn(e, 2 * i, h, dtype=torch.float64), torch.randn(e, h, i, dtype=torch.float64)
    w, ids = sigmoid_topk_route(torch.randn(t, e), torch.randn(e) * 0.1, k)
    torch.testing.assert_close(moe(x, w.double(), ids, gate_up, down), _naive_moe(x, w, ids, gate_up, down))


@pytest.mark.unit
@pytest.mark.parametrize("t", [1, 3, 40])
def test_grouped_mm_moe_matches_naive_loop(t):
    """float32 (grouped_mm has no float64 CPU kernel); experts left without tokens are skipped."""
    torch.manual_seed(3)
    h, i, e, k = 32, 16, 8, 2
    x = torch.randn(t, h)
    gate_up, down = torch.randn(e, 2 * i, h) / 4, torch.randn(e, h, i) / 4
    w, ids = sigmoid_topk_route(torch.randn(t, e), None, k)
    torch.testing.assert_close(grouped_mm_moe(x, w, ids, gate_up, down), _naive_moe(x, w, ids, gate_up, down),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_router_bias_selects_but_does_not_weight():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    bias = torch.tensor([5.0, 0.0, 0.0, 5.0])  # pushes experts 0 and 3 into the top-2
    w, ids = sigmoid_topk_route(logits, bias, 2)
    assert sorted(ids[0].tolist()) == [0, 3]
    s = torch.sigmoid(logits[0])
    expect = {0: s[0] / (s[0] + s[3]), 3: s[3] / (s[0] + s[3])}
    for j in range(2):
        assert w[0, j].item() == pytest.approx(expect[int(ids[0, j])].item(), rel=1e-6)


@pytest.mark.unit
def test_router_group_limit():
    # 2 groups of 2; group 1 has the best pair sum, so even the single best expert of group 0 is excluded
    logits = torch.tensor([[3.0, -5.0, 1.0, 1.0]])
    _, ids = sigmoid_topk_route(logits, None, 1, n_group=2, topk_group=1)
    assert int(ids[0, 0]) in (2, 3)


@pytest.mark.unit
def test_fp8_block_dequant_known_answer():
    # 3x5 weight, 2x2 blocks -> scale grid 2x3; every fp8 value is exactly representable
    w = torch.tensor([[1.0, 2.0, 0.5, -1.0, 4.0],
                      [0.25, -2.0, 1.5, 3.0, -0.5],
                      [8.0, 1.0, -4.0, 0.75, 2.0]]).to(FP8_DTYPE)
    s = torch.tensor([[2.0, 0.5, 10.0], [-1.0, 4.0, 0.125]])
    expect = torch.tensor([[2.0, 4.0, 0.25, -0.5, 40.0],
                           [0.5, -4.0, 0.75, 1.5, -5.0],
                           [-8.0, -1.0, -16.0, 3.0, 0.25]])
    torch.testing.assert_close(dequant_fp8_block(w, s, block=(2, 2)), expect)


@pytest.mark.unit
def test_fp8_block_scale_shape_mismatch_is_explicit():
    with pytest.raises(ValueError, match=r"expected \(2, 1\)"):
        dequant_fp8_block(torch.zeros(130, 100).to(FP8_DTYPE), torch.ones(1, 1))


@pytest.mark.unit
def test_fp8_quant_dequant_roundtrip_128_blocks():
    torch.manual_seed(3)
    w = torch.randn(300, 200)
    q, s = quant_fp8_block(w)
    assert q.dtype == FP8_DTYPE and tuple(s.shape) == (3, 2)
    back = dequant_fp8_block(q, s)
    assert (back - w).abs().max() <= 0.07 * w.abs().max()


def _labelled_fused(num_heads, num_kv, dqk, dv, groups):
    """Fused weight whose every row says what it is: 1000*kind + 100*head + dim (kind 1=q, 2=k, 3=v)."""
    qh_per_group, kvh_per_group = num_heads // groups, num_kv // groups
    rows = []
    for c in range(groups):
        for h in range(c * qh_per_group, (c + 1) * qh_per_group):
            rows += [1000 + 100 * h + d for d in range(dqk)]
        for h in range(c * kvh_per_group, (c + 1) * kvh_per_group):
            rows += [2000 + 100 * h + d for d in range(dqk)]
        for h in range(c * kvh_per_group, (c + 1) * kvh_per_group):
            rows += [3000 + 100 * h + d for d in range(dv)]
    return torch.tensor(rows, dtype=torch.float32)[:, None].repeat(1, 3)


@pytest.mark.unit
@pytest.mark.parametrize("groups", [2, 4])
def test_fused_qkv_layout_known_answer(groups):
    num_heads, num_kv, dqk, dv = 8, 4, 3, 2
    q, k, v = split_fused_qkv(_labelled_fused(num_heads, num_kv, dqk, dv, groups), num_heads, num_kv, dqk, dv,
                              groups)
    assert q[:, 0].tolist() == [1000 + 100 * h + d for h in range(num_heads) for d in range(dqk)]
    assert k[:, 0].tolist() == [2000 + 100 * h + d for h in range(num_kv) for d in range(dqk)]
    assert v[:, 0].tolist() == [3000 + 100 * h + d for h in range(num_kv) for d in range(dv)]


@pytest.mark.unit
@pytest.mark.parametrize("padded", [True, False])
def test_fused_qkv_fp8_both_scale_layouts(padded):
    """Per-group padded block scales (each group quantized alone) and globally packed scales both dequantize."""
    torch.manual_seed(4)
    num_heads, num_kv, dqk, dv, groups, block = 4, 2, 3, 4, 2, (4, 4)  # 13 rows/group
    fused = torch.randn((num_heads * dqk + num_kv * (dqk + dv)), 6)
    rows_per_group = fused.shape[0] // groups
    if padded:
        parts = [quant_fp8_block(fused[c * rows_per_group:(c + 1) * rows_per_group], block) for c in range(groups)]
        w8, s = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    else:
        w8, s = quant_fp8_block(fused, block)
    assert s.shape[0] == (8 if padded else 7)
    deq = dequant_fused_qkv_fp8(w8, s, num_kv_groups=groups, block=block)
    assert (deq - fused).abs().max() < 0.1 * fused.abs().max()


@pytest.mark.gpu
def test_flashinfer_matches_reference():
    from kernels.flashinfer_attn import paged_attention_flashinfer

    torch.manual_seed(5)
    dev = torch.device("cuda")
    page, hq, hkv, dqk, dv = 16, 8, 2, 192, 128
    q_lens, kv_lens = [37, 1, 5], [37, 300, 141]
    num_pages = 64
    k_pool = torch.randn(num_pages, page, hkv, dqk, device=dev, dtype=torch.bfloat16)
    v_pool = torch.randn(num_pages, page, hkv, dv, device=dev, dtype=torch.bfloat16)
    table = torch.randperm(num_pages, device=dev)[:3 * 20].view(3, 20)
    q = torch.randn(sum(q_lens), hq, dqk, device=dev, dtype=torch.bfloat16)
    sinks = torch.randn(hq, device=dev)
    for window_left in (-1, 128):
        plan = plan_paged_attention(table, q_lens, kv_lens, page, window_left)
        ref = paged_attention_ref(q, k_pool, v_pool, plan, dqk ** -0.5, sinks if window_left >= 0 else None)
        got = paged_attention_flashinfer(q, k_pool, v_pool, plan, dqk ** -0.5,
                                         sinks if window_left >= 0 else None)
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.unit
@pytest.mark.parametrize("with_sinks", [True, False])
def test_decode_attention_matches_the_reference(with_sinks):
    """The compiled decode step's attention (kernels/fused.py, here run eager) writes the new K/V where the plan
    says and equals the reference over a plan of one decode token per sequence (window and sinks included)."""
    torch.manual_seed(4)
    page, hq, hkv, d = 4, 4, 2, 8
    k_buf, v_buf = torch.randn(2, 16, page, hkv, d), torch.randn(2, 16, page, hkv, d)  # [layers, pages, ...]
    table = torch.tensor([[3, 7, -1, -1], [0, 1, 2, -1], [4, 5, 6, 8]])
    plan = plan_paged_attention(table, [1, 1, 1], [5, 9, 13], page, window_left=6)
    q, k, v = torch.randn(3, hq, d), torch.randn(3, hkv, d), torch.randn(3, hkv, d)
    sinks = torch.randn(hq) if with_sinks else None
    k_ref, v_ref = k_buf[1].clone(), v_buf[1].clone()
    scatter_kv(k_ref, v_ref, plan.write_slots, k, v)
    ref = paged_attention(q, k_ref, v_ref, plan, 0.3, sinks)
    blk = plan.blocks[0]
    got = fused.decode_attention(q, k, v, k_buf, v_buf, 1, plan.write_slots, blk.slots, blk.hidden, 0.3, sinks)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_buf[1], k_ref) and torch.equal(v_buf[1], v_ref)


@pytest.mark.unit
@pytest.mark.parametrize("window,sinks", [(None, True), (6, True), (9, False)])
def test_long_prefill_chunks_through_the_fused_kernel_equal_dense(window, sinks, monkeypatch):
    """Chunks of >= FUSED_MIN_QUERIES queries with Dv == D go through torch's fused CPU attention
    (kernels.attention.attend_fused, the sink applied after it from the log-sum-exp)."""
    from kernels.attention import FUSED_MIN_QUERIES

    monkeypatch.setattr(sys.modules[__name__], "DV", DQK)
    _run_chunked([45, 30], [FUSED_MIN_QUERIES + 4, FUSED_MIN_QUERIES], window, sinks, drop_out_of_window=False)
