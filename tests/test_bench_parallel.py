"""bench.parallel: its arithmetic and results writer (pure, instant), and one --quick run for real (tp = 2 + ep = 2
rank processes; some tens of seconds on a loaded 2-core box)."""

from __future__ import annotations

import json

from bench import parallel
from libs.engine.parallel.layout import ParallelLayout
from libs.model.config import ModelConfig


def test_needed_all_reduces_and_the_minimum() -> None:
    cfg = ModelConfig.tiny()  # 6 layers: 1 dense MLP, 5 MoE; hidden 64
    assert parallel.needed_all_reduces(cfg, ParallelLayout()) == 0
    assert parallel.needed_all_reduces(cfg, ParallelLayout(tp=2)) == 12  # attention + MLP / MoE, every layer
    assert parallel.needed_all_reduces(cfg, ParallelLayout(ep=2)) == 5  # the MoE layers only
    assert parallel.needed_all_reduces(cfg, ParallelLayout(tp=2, ep=2)) == 12
    # 2 ranks: the bound is one hidden vector (64 x 4 bytes) per all-reduce
    assert parallel.min_bytes_per_token_per_layer(cfg, ParallelLayout(tp=2), 4) == 12 * 256 / 6
    assert parallel.min_bytes_per_token_per_layer(cfg, ParallelLayout(ep=2), 4) == 5 * 256 / 6


def test_mimo_variant_splits_both_pools() -> None:
    cfg = parallel.mimo_kv_config()
    layout = ParallelLayout(tp=2)
    layout.validate(cfg)
    local = layout.local_config(cfg)
    assert (local.kv_heads_full, local.kv_heads_swa) == (1, 2)
    assert layout.kv_bytes_ratio(cfg, swa=False) == layout.kv_bytes_ratio(cfg, swa=True) == 0.5
    ratios = parallel.kv_ratios({"full": 100, "swa": 400}, [{"full": 50, "swa": 200}, {"full": 50, "swa": 210}])
    assert ratios == {"full": 0.5, "swa": 0.525, "max": 0.525}  # the largest rank counts


def _layout(tp: int, ep: int, ratio: float, same: bool = True) -> dict:
    comm = {"ratio": ratio, "control_bytes_per_step": 4000.0, "measured_bytes_per_token_per_layer": 515.0,
            "min_bytes_per_token_per_layer": 512.0}
    return {"tp": tp, "ep": ep, "greedy_identical": same, "max_logit_diff": 1e-6, "comm": comm,
            "kv_bytes_per_rank_ratio": {"full": 1.0, "swa": 0.5, "max": 1.0},
            "pool_bytes": [{"full": 1, "swa": 1}], "step_ms": {"decode": 1.0, "prefill": 2.0}}


def test_results_have_every_headline_key(tmp_path) -> None:
    ref = {"pool_bytes": [{"full": 2, "swa": 2}], "step_ms": {"decode": 1.0, "prefill": 2.0}}
    layouts = {"tp2": _layout(2, 1, 1.01), "ep2": _layout(1, 2, 1.3, same=False), "tp2_ep2": _layout(2, 2, 1.02)}
    variant = {"config": {}, "tp1": {"pool_bytes": []}, "tp2": {
        "greedy_identical": True, "max_logit_diff": 0.0, "pool_bytes": [],
        "kv_bytes_per_rank_ratio": {"full": 0.5, "swa": 0.5, "max": 0.5}}}
    gpu = {"tp1": None, "tp2": None, "reasons": {"tp1": "cpu", "tp2": "cpu"}}
    out = parallel.build_results(ref, layouts, variant, None, gpu, {"cpus": 2})
    path = tmp_path / "parallel.json"
    path.write_text(json.dumps(out))
    parallel.plot(out, tmp_path / "parallel.png")
    data = json.loads(path.read_text())
    assert set(parallel.HEADLINE_KEYS) <= set(data)
    assert data["greedy_identical"] is True and data["met"]["greedy_identical"] is True  # the tp2_ep2 layout's
    assert data["greedy_identical_by_layout"]["ep2"] is False
    assert data["comm_bytes_vs_min"] == 1.02 and data["met"]["comm_bytes_vs_min"] is True
    assert data["kv_bytes_per_rank_ratio"] == 0.5 and data["met"]["kv_bytes_per_rank_ratio"] is True
    assert data["kv_bytes_per_rank_ratio_tiny"]["full"] == 1.0  # the built-in tiny's, from the tp2 layout
    assert data["decode_tokens_per_s_gpu_tp1"] is None and data["null_reasons"]["decode_tokens_per_s_gpu_tp1"] == "cpu"
    assert (tmp_path / "parallel.png").stat().st_size > 0


def test_quick_run_measures_real_ranks(tmp_path) -> None:
    out = parallel.main(parallel.parse(["--quick", "--out", str(tmp_path / "parallel.json")]))
    assert out["greedy_identical"] is True and out["max_logit_diff"] < 1e-3
    check = out["io_counting_check"]  # wchar sees gloo's sends: a plain all-reduce is the bound plus headers
    assert 1.0 <= check["rank1_over_bound"] < 1.05
    comm = out["comm"]["tp2_ep2"]
    assert comm["all_reduces_per_step"] == comm["needed_all_reduces_per_step"] == 12
    assert 1.0 <= out["comm_bytes_vs_min"] < 1.1
    # rank 0 writes its gloo sends plus the pickled step messages: the two ways of counting agree
    assert abs(comm["control_bytes_per_step"] - comm["control_bytes_per_step_pickled"]) < 0.05 * comm[
        "control_bytes_per_step_pickled"]
    tiny = out["kv_bytes_per_rank_ratio_tiny"]
    assert (tiny["full"], tiny["swa"]) == (1.0, 0.5)  # one full-attention KV head: each tp rank keeps it
    assert (tmp_path / "parallel.png").exists()
