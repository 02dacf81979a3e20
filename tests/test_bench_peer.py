"""bench.peer's pure parts: the two config dialects, the results builder (worst workload per key, goals) and the
parsing of the clients' result files. No vLLM, no server (milliseconds)."""

from __future__ import annotations

import json

import pytest

from bench import peer

pytestmark = pytest.mark.unit

SPECIALS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}


def test_config_states_every_fact_in_both_dialects_with_equal_values() -> None:
    cfg = peer.dual_dialect_config(peer.RECIPE, 6000, SPECIALS)
    for name, (hf, hub) in peer.dialect_pairs(cfg).items():
        assert hf == hub, name
    assert cfg["hybrid_layer_pattern"] == [0, 1, 1, 1, 1, 0, 1, 1]  # MiMo-V2-Flash's: full at 0 and 5
    assert cfg["sliding_window"] == 129 and cfg["sliding_window_size"] == 128  # same window, the two conventions
    assert cfg["head_dim"] == cfg["v_head_dim"] == 64  # vLLM's CPU attention needs equal dims
    assert int(cfg["head_dim"] * cfg["partial_rotary_factor"]) % 2 == 0
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["num_hidden_layers"]) == (16, 2, 8)
    assert cfg["eos_token_id"] == 2 and cfg["vocab_size"] == 6000


def test_windserve_reads_the_config_as_transformers_does() -> None:
    from libs.model.config import ModelConfig

    cfg = peer.dual_dialect_config(peer.RECIPE, 6000, SPECIALS)
    hub_only = {k: v for k, v in cfg.items() if k not in ("layer_types", "mlp_layer_types", "rope_parameters",
                                                           "sliding_window", "rms_norm_eps")}
    hf_only = {k: v for k, v in cfg.items() if k not in ("hybrid_layer_pattern", "moe_layer_freq",
                                                          "sliding_window_size", "swa_num_key_value_heads",
                                                          "rope_theta", "swa_rope_theta", "partial_rotary_factor",
                                                          "layernorm_epsilon")}
    both, hub, hf = (ModelConfig.from_hf_dict(d) for d in (cfg, hub_only, hf_only))
    assert both == hub == hf
    assert both.sliding_window == 129 and both.kv_heads_swa == 2 and both.rotary_dim == 32


def test_recipe_key_changes_with_the_recipe_and_the_corpus() -> None:
    k = peer.recipe_key(peer.RECIPE, "abc", "5.0")
    assert k == peer.recipe_key(dict(peer.RECIPE), "abc", "5.0")
    assert k != peer.recipe_key({**peer.RECIPE, "seed": 1}, "abc", "5.0")
    assert k != peer.recipe_key(peer.RECIPE, "abd", "5.0") != peer.recipe_key(peer.RECIPE, "abc", "5.1")


def test_tokenizer_training_is_deterministic_with_chatml_specials() -> None:
    texts = ["the window slides over the keys; " * 20, "prefix caching hits in 256-token units. " * 20]
    a, b = peer.train_tokenizer(texts, 300), peer.train_tokenizer(texts, 300)
    assert a.to_str() == b.to_str()
    assert [a.token_to_id(t) for t in peer.SPECIALS] == [0, 1, 2]
    ids = a.encode("<|im_start|>user\nthe window<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2 and a.decode(ids, skip_special_tokens=True) == "user\nthe window"


def _side(tput: float, tpot: float, ttft: float, itl: float, n: int = 8, failed: int = 0) -> dict:
    return {"completed": n, "failed": failed, "output_throughput": tput, "mean_tpot_ms": tpot, "p90_ttft_ms": ttft,
            "p90_itl_ms": itl}


def test_results_pick_the_worst_workload_per_key_and_mark_goals(tmp_path) -> None:
    table = {
        "a": peer.compare_workload("a", _side(60, 9, 40, 9), _side(100, 10, 100, 10), 8),  # 0.6, 0.9, 0.4
        "b": peer.compare_workload("b", _side(150, 5, 50, 5), _side(100, 10, 100, 10), 8),  # 1.5, 0.5, 0.5
        "d": peer.compare_workload("d", _side(130, 8, 70, 30), _side(100, 10, 100, 10), 8),  # 1.3, 0.8, 0.7, 3.0
        "e": peer.compare_workload("e", {"error": "aiperf exited 1"}, _side(100, 10, 100, 10), 8),
    }
    out = peer.build_results(table, {"equal": True}, {"quick": True})
    assert out["throughput_vs_vllm"] == pytest.approx(0.6) and out["worst_workload"]["throughput_vs_vllm"] == "a"
    assert out["tpot_vs_vllm"] == pytest.approx(0.9) and out["worst_workload"]["tpot_vs_vllm"] == "a"
    assert out["ttft_p90_vs_vllm"] == pytest.approx(0.7) and out["worst_workload"]["ttft_p90_vs_vllm"] == "d"
    assert out["itl_p90_vs_vllm"] == pytest.approx(3.0)  # the trace workload's, not the worst
    assert out["met"] == {"throughput_vs_vllm": False, "tpot_vs_vllm": True, "ttft_p90_vs_vllm": True}
    assert out["greedy_equal_vllm_short"] is True
    assert table["e"]["throughput_ratio"] is None and "aiperf exited 1" in table["e"]["reason"]
    peer.write_results(out, tmp_path / "peer.json", tmp_path / "peer.png")
    data = json.loads((tmp_path / "peer.json").read_text())
    assert set(peer.HEADLINE_KEYS) <= set(data) and (tmp_path / "peer.png").stat().st_size > 0


def test_a_side_that_lost_requests_gives_no_ratio() -> None:
    row = peer.compare_workload("b", _side(150, 5, 50, 5, n=7, failed=1), _side(100, 10, 100, 10), 8)
    assert row["throughput_ratio"] is None and "7 of 8" in row["reason"]


def test_skipped_run_has_every_headline_key_null_with_a_reason() -> None:
    out = peer.build_results({}, {"equal": None, "reason": "x"}, {}, skipped="the peer is not installed: no pip")
    assert all(out[k] is None for k in peer.HEADLINE_KEYS)
    assert set(out["null_reasons"]) == set(peer.HEADLINE_KEYS) and out["skipped"].startswith("the peer")
    assert out["met"] == dict.fromkeys(peer.GOALS)


def test_parse_vllm_bench_serve_result() -> None:
    saved = {"date": "20261207-090000", "backend": "openai", "model_id": "mimo-peer", "num_prompts": 8,
             "duration": 12.5, "completed": 8, "failed": 0, "total_input_tokens": 2048, "total_output_tokens": 512,
             "request_throughput": 0.64, "output_throughput": 40.96, "total_token_throughput": 204.8,
             "mean_ttft_ms": 80.0, "median_ttft_ms": 75.0, "std_ttft_ms": 5.0, "p50_ttft_ms": 75.0,
             "p90_ttft_ms": 95.5, "p99_ttft_ms": 99.0, "mean_tpot_ms": 18.7, "p90_tpot_ms": 19.1,
             "mean_itl_ms": 18.6, "p90_itl_ms": 20.2, "p99_itl_ms": 31.0, "errors": ["", ""]}
    got = peer.parse_vllm_result(saved)
    assert got["completed"] == 8 and got["failed"] == 0 and got["output_throughput"] == 40.96
    assert (got["mean_tpot_ms"], got["p90_ttft_ms"], got["p90_itl_ms"]) == (18.7, 95.5, 20.2)
    assert peer.parse_vllm_result({"completed": 0})["output_throughput"] is None


def test_parse_aiperf_result() -> None:
    saved = {"records": {"request_count": {"unit": "requests", "avg": 32.0},
                         "output_token_throughput": {"unit": "tokens/sec", "avg": 55.0},
                         "time_to_first_token": {"unit": "ms", "avg": 120.0, "p90": 200.0},
                         "inter_token_latency": {"unit": "ms", "avg": 15.0, "p90": 18.0, "p99": 40.0}},
             "error_summary": []}
    got = peer.parse_aiperf_result(saved)
    assert got["completed"] == 32 and got["failed"] == 0 and got["output_throughput"] == 55.0
    assert (got["mean_tpot_ms"], got["p90_ttft_ms"], got["p90_itl_ms"]) == (15.0, 200.0, 18.0)


def test_scaled_trace_keeps_timestamps_and_blocks_within_the_context(tmp_path) -> None:
    src = tmp_path / "t.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in (
        {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1]},
        {"timestamp": 3000, "input_length": 200000, "output_length": 3, "hash_ids": [0, 2]},
        {"timestamp": 6000, "input_length": 10, "output_length": 10, "hash_ids": [3]})) + "\n")
    out = peer.scaled_trace(src, tmp_path / "o.jsonl", 2, 16, 8, 8192)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["timestamp"] for r in rows] == [0, 3000]
    assert rows[0]["input_length"] == 6758 // 16 and rows[0]["output_length"] == 500 // 8
    assert rows[1]["input_length"] + rows[1]["output_length"] < 8192 and rows[1]["hash_ids"] == [0, 2]


def test_greedy_comparison_uses_token_ids_where_both_have_them() -> None:
    a = [{"text": "x", "token_ids": [1, 2]}, {"text": "y", "token_ids": None}]
    assert peer.compare_greedy(a, [{"text": "z", "token_ids": [1, 2]}, {"text": "y"}])["equal"] is True
    assert peer.compare_greedy(a, [{"text": "x", "token_ids": [1, 3]}, {"text": "y"}])["equal_prompts"] == 1
    assert peer.compare_greedy(None, a)["equal"] is None
    assert all(len(p) + peer.SHORT_MAX_TOKENS <= 128 for p in peer.short_prompts(6000, 8))
