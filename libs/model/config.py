"""MiMo-V2 model configuration, parsed from an HF ``config.json``.

Two field dialects are accepted:

* ``mimo_v2_flash`` as written by ``transformers`` (``layer_types``, ``mlp_layer_types``, ``rope_parameters``
  per layer type, ``sliding_window`` in HF meaning, SWA layers with ``2 * num_key_value_heads`` KV heads and
  always with sinks);
* the original Xiaomi / ``mimo_v2`` (V2.5, Pro) fields: ``hybrid_layer_pattern`` (1 = SWA), ``moe_layer_freq``,
  ``swa_num_key_value_heads`` / ``swa_head_dim`` / ``swa_v_head_dim`` / ``swa_rope_theta``,
  ``partial_rotary_factor``, ``sliding_window_size`` (keys *before* the query, so HF ``sliding_window`` is
  that + 1), ``add_swa_attention_sink_bias`` / ``add_full_attention_sink_bias``, ``layernorm_epsilon``.

Explicit fields win over the transformers defaults. ``sliding_window`` here always has the HF meaning: a query
at position q sees keys k with ``q - sliding_window < k <= q``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from libs.model.vision_config import VisionConfig

SUPPORTED_MODEL_TYPES = ("mimo_v2_flash", "mimo_v2")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    qk_head_dim: int
    v_head_dim: int
    layer_is_swa: tuple[bool, ...]
    kv_heads_full: int
    kv_heads_swa: int
    sliding_window: int
    intermediate_size: int
    """Dense MLP width (layer 0 and the MTP blocks)."""
    layer_is_moe: tuple[bool, ...]
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rope_theta_full: float = 5_000_000.0
    rope_theta_swa: float = 10_000.0
    partial_rotary_factor: float = 0.334
    attention_value_scale: float = 1.0
    swa_sinks: bool = True
    full_sinks: bool = False
    rms_norm_eps: float = 1e-5
    num_mtp_layers: int = 0
    tie_word_embeddings: bool = False
    fused_qkv_groups: int | None = None
    """Groups of a fused ``qkv_proj`` in the checkpoint (default: the layer's KV head count)."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 131072
    model_type: str = "mimo_v2_flash"
    vision: VisionConfig | None = None
    """The vision tower (multimodal checkpoints, and the tiny model); None = text only."""
    image_token_id: int | None = None
    """``<|image_pad|>``: one per merged image token; the LM's embedding step puts the tower's output there."""
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ValueError("invalid MiMo-V2 config: " + "; ".join(problems))

    def _problems(self):
        if len(self.layer_is_swa) != self.num_layers:
            yield f"layer types list has {len(self.layer_is_swa)} entries for {self.num_layers} layers"
        if len(self.layer_is_moe) != self.num_layers:
            yield f"mlp types list has {len(self.layer_is_moe)} entries for {self.num_layers} layers"
        for name in ("kv_heads_full", "kv_heads_swa"):
            heads = getattr(self, name)
            if heads <= 0 or self.num_heads % heads:
                yield f"{name}={heads} must divide num_heads={self.num_heads}"
        if self.sliding_window < 1:
            yield f"sliding_window={self.sliding_window} must be >= 1"
        if any(self.layer_is_moe) and not 0 < self.num_experts_per_tok <= self.num_experts:
            yield f"num_experts_per_tok={self.num_experts_per_tok} not in 1..{self.num_experts}"
        if self.num_experts and self.num_experts % self.n_group:
            yield f"n_group={self.n_group} must divide num_experts={self.num_experts}"
        if self.rotary_dim % 2 or self.rotary_dim > self.qk_head_dim:
            yield f"rotary dim {self.rotary_dim} must be even and <= qk_head_dim {self.qk_head_dim}"

    # ---- derived -------------------------------------------------------------------------------------------
    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, swa in enumerate(self.layer_is_swa) if not swa)

    @property
    def swa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, swa in enumerate(self.layer_is_swa) if swa)

    @property
    def rotary_dim(self) -> int:
        return int(self.qk_head_dim * self.partial_rotary_factor)

    @property
    def window_left(self) -> int:
        """Keys to the left of the query an SWA layer sees (flashinfer's ``window_left``)."""
        return self.sliding_window - 1

    @property
    def swa_tokens_needed(self) -> int:
        """Cached SWA positions the next decode step reads: the window minus the new token itself."""
        return self.sliding_window - 1

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> tuple[int, int]:
        """(bytes per token of one full layer, of one SWA layer): K and V of every KV head."""
        per_head = (self.qk_head_dim + self.v_head_dim) * dtype_bytes
        return self.kv_heads_full * per_head, self.kv_heads_swa * per_head

    def kv_bytes_total(self, n_tokens: int, dtype_bytes: int = 2) -> int:
        """KV bytes one sequence of ``n_tokens`` holds: full layers O(N), SWA layers O(window)."""
        full, swa = self.kv_bytes_per_token(dtype_bytes)
        return (len(self.full_layers) * full * n_tokens
                + len(self.swa_layers) * swa * min(n_tokens, self.swa_tokens_needed))

    # ---- constructors --------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        return cls.from_hf_dict(json.loads(p.read_text()))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        vision = d.get("vision_config") if isinstance(d.get("vision_config"), dict) else None
        if isinstance(d.get("text_config"), dict):  # multimodal wrapper (V2.5): the LM lives in text_config
            d = {**d, **d["text_config"]}
        model_type = d.get("model_type", "mimo_v2_flash")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; expected one of {SUPPORTED_MODEL_TYPES}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} (only silu)")
        if d.get("attention_bias"):
            raise ValueError("attention_bias=true is not supported")
        n = d["num_hidden_layers"]
        kv = d.get("num_key_value_heads", d["num_attention_heads"])
        return cls(**_parse_shapes(d, n, kv), **_parse_rope(d), **_parse_moe(d, n), **_parse_misc(d, model_type),
                   **_parse_vision(vision, d["hidden_size"], d))

    @classmethod
    def tiny(cls) -> ModelConfig:
        """Built-in tiny model: byte-level vocab + ChatML specials, full/SWA mix, MoE, MTP."""
        return cls(
            vocab_size=512, hidden_size=64, num_layers=6, num_heads=4, qk_head_dim=32, v_head_dim=16,
            layer_is_swa=(False, True, True, False, True, True), kv_heads_full=1, kv_heads_swa=2,
            sliding_window=16, intermediate_size=128, layer_is_moe=(False,) + (True,) * 5,
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, rope_theta_full=1_000_000.0,
            rope_theta_swa=10_000.0, partial_rotary_factor=0.5, attention_value_scale=0.707, swa_sinks=True,
            num_mtp_layers=3, bos_token_id=None, eos_token_ids=(258, 256), max_position_embeddings=4096,
            model_type="mimo_v2_flash", vision=VisionConfig.tiny(out_hidden_size=64),
            vision_start_token_id=260, vision_end_token_id=261, image_token_id=262, video_token_id=263,
        )

    def with_(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)


def _parse_shapes(d: dict[str, Any], n: int, kv: int) -> dict[str, Any]:
    if "hybrid_layer_pattern" in d:
        swa = tuple(bool(x) for x in d["hybrid_layer_pattern"])
    else:
        types = d.get("layer_types") or [
            "full_attention" if (i == 0 or (i + 1) % 6 == 0) else "sliding_attention" for i in range(n)
        ]
        swa = tuple(t == "sliding_attention" for t in types)
    qk = d.get("head_dim", 192)
    v = d.get("v_head_dim", qk)
    for key, want in (("swa_head_dim", qk), ("swa_v_head_dim", v), ("swa_num_attention_heads",
                                                                     d["num_attention_heads"])):
        if d.get(key) is not None and d[key] != want:
            raise ValueError(f"{key}={d[key]} differs from the full-attention value {want}; not supported")
    if d.get("sliding_window_size") is not None:
        window = int(d["sliding_window_size"]) + 1
    else:
        window = int(d.get("sliding_window") or 129)
    return dict(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], num_layers=n,
        num_heads=d["num_attention_heads"], qk_head_dim=qk, v_head_dim=v, layer_is_swa=swa,
        kv_heads_full=kv, kv_heads_swa=d.get("swa_num_key_value_heads") or 2 * kv, sliding_window=window,
    )


def _parse_rope(d: dict[str, Any]) -> dict[str, Any]:
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and "full_attention" in rp:
        full: dict[str, Any] = rp["full_attention"]
        swa: dict[str, Any] = rp.get("sliding_attention") or full
        for part in (full, swa):
            if part.get("rope_type", "default") != "default":
                raise ValueError(f"unsupported rope_type {part['rope_type']!r}")
        if full.get("partial_rotary_factor", 0.334) != swa.get("partial_rotary_factor", 0.334):
            raise ValueError("different partial_rotary_factor per layer type is not supported")
        return dict(rope_theta_full=float(full["rope_theta"]), rope_theta_swa=float(swa["rope_theta"]),
                    partial_rotary_factor=float(full.get("partial_rotary_factor", 0.334)))
    scaling = d.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"unsupported rope_scaling {scaling}")
    theta = float(d.get("rope_theta", 5_000_000.0))
    return dict(rope_theta_full=theta, rope_theta_swa=float(d.get("swa_rope_theta", theta)),
                partial_rotary_factor=float(d.get("partial_rotary_factor", 0.334)))


def _parse_moe(d: dict[str, Any], n: int) -> dict[str, Any]:
    if isinstance(d.get("moe_layer_freq"), list):
        moe = tuple(bool(x) for x in d["moe_layer_freq"])
    else:
        types = d.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
        moe = tuple(t == "sparse" for t in types)
    if d.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"unsupported scoring_func {d['scoring_func']!r} (only sigmoid)")
    if d.get("n_shared_experts"):
        raise ValueError("shared experts are not part of MiMo-V2 and are not supported")
    return dict(
        intermediate_size=d.get("intermediate_size", 16384), layer_is_moe=moe,
        moe_intermediate_size=d.get("moe_intermediate_size", 2048),
        num_experts=d.get("n_routed_experts", d.get("num_local_experts", 0)) or 0,
        num_experts_per_tok=d.get("num_experts_per_tok", 8), n_group=d.get("n_group") or 1,
        topk_group=d.get("topk_group") or 1, norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
    )


def _parse_misc(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return dict(
        attention_value_scale=float(d.get("attention_value_scale") or 1.0),
        swa_sinks=bool(d.get("add_swa_attention_sink_bias", True)),
        full_sinks=bool(d.get("add_full_attention_sink_bias", False)),
        rms_norm_eps=float(d.get("rms_norm_eps", d.get("layernorm_epsilon", 1e-5))),
        num_mtp_layers=int(d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 0)) or 0),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        fused_qkv_groups=d.get("fused_qkv_groups"), bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids,
        max_position_embeddings=d.get("max_position_embeddings", 131072), model_type=model_type,
        extra={k: v for k, v in d.items() if k in ("torch_dtype", "dtype", "quantization_config")},
    )


def _parse_vision(vision: dict[str, Any] | None, hidden: int, d: dict[str, Any]) -> dict[str, Any]:
    if vision is None:
        return {}
    return dict(vision=VisionConfig.from_hf_dict(vision, hidden),
                **{k: d[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                     "vision_end_token_id") if isinstance(d.get(k), int)})
