"""Checkpoint loading: HF ``config.json`` + safetensors shards (with or without an index).

Handles FP8 e4m3 block-quantized weights (``weight_scale_inv``, dequantized at load), the V2.5/Pro fused
``qkv_proj`` layout, per-expert tensors mapped onto stacked expert weights, and transformers' ``sinks`` name
for the sink logits. Any missing, unexpected or mis-shaped tensor raises :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from kernels.fp8 import FP8_DTYPE, dequant_fp8_block
from libs.model.config import ModelConfig
from libs.model.layers import MoEGate, rope_inv_freq
from libs.model.model import MiMoV2Model, init_random_
from libs.model.weights import dequant_fused_qkv_fp8, split_fused_qkv

log = logging.getLogger(__name__)

TINY_SEED = 0
_EXPERT = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")
_MTP_LAYER = re.compile(r"^model\.mtp\.layers\.(\d+)\.")
_OWNED = re.compile(r"^(model\.(layers|mtp|embed_tokens|norm)\b|lm_head\.)")


class CheckpointError(ValueError):
    """A checkpoint does not match the config: names the tensor."""


class _Shards:
    """Lazy tensor access over all safetensors files of a model directory."""

    def __init__(self, path: Path) -> None:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            self.where = {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files (and no index) in {path}")
            self.where = {}
            for f in files:
                with safe_open(str(f), "pt") as h:
                    self.where.update({k: f for k in h.keys()})
        self._open: dict[Path, object] = {}

    def names(self) -> list[str]:
        return sorted(self.where)

    def get(self, name: str) -> torch.Tensor:
        f = self.where.get(name)
        if f is None:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint")
        if not f.is_file():
            raise CheckpointError(f"tensor {name}: shard file {f.name} listed in the index does not exist")
        if f not in self._open:
            self._open[f] = safe_open(str(f), "pt")
        return self._open[f].get_tensor(name)  # type: ignore[attr-defined]


def _read(shards: _Shards, name: str, fused_groups: int | None) -> torch.Tensor:
    t = shards.get(name)
    if t.dtype != FP8_DTYPE:
        return t
    scale_name = name + "_scale_inv"
    if scale_name not in shards.where:
        raise CheckpointError(f"tensor {name} is FP8 but its block scales {scale_name} are missing")
    scale = shards.get(scale_name)
    try:
        if fused_groups is not None:
            return dequant_fused_qkv_fp8(t, scale, fused_groups)
        return dequant_fp8_block(t, scale)
    except ValueError as e:
        raise CheckpointError(f"tensor {name}: {e}") from e


class _Loader:
    def __init__(self, model: MiMoV2Model, shards: _Shards) -> None:
        self.model, self.cfg, self.shards = model, model.cfg, shards
        self.targets = dict(model.named_parameters()) | dict(model.named_buffers())
        self.loaded: set[str] = set()

    def expected(self) -> set[str]:
        names = set()
        for n in self.model.state_dict():
            if n.endswith("experts.gate_up_proj"):
                pre = n[: -len(".gate_up_proj")]
                names |= {f"{pre}.{e}.{p}.weight" for e in range(self.cfg.num_experts)
                          for p in ("gate_proj", "up_proj")}
            elif n.endswith("experts.down_proj"):
                pre = n[: -len(".down_proj")]
                names |= {f"{pre}.{e}.down_proj.weight" for e in range(self.cfg.num_experts)}
            else:
                names.add(n)
        if self.cfg.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names

    def _copy(self, target: str, src: torch.Tensor, ckpt_name: str, index=None) -> None:
        dst = self.targets[target] if index is None else self.targets[target][index]
        if tuple(dst.shape) != tuple(src.shape):
            raise CheckpointError(f"tensor {ckpt_name}: checkpoint shape {tuple(src.shape)} != expected "
                                  f"{tuple(dst.shape)} for this config")
        with torch.no_grad():
            dst.copy_(src)
        self.loaded.add(ckpt_name)

    def _layer_attn(self, name: str):
        prefix = name.rsplit(".self_attn.", 1)[0]
        return self.model.get_submodule(prefix).self_attn

    def load_one(self, name: str) -> None:
        if name.endswith("_scale_inv") or "rotary_emb" in name:
            return
        if name.endswith("self_attn.qkv_proj.weight"):
            return self._load_fused_qkv(name)
        t = _read(self.shards, name, None)
        m = _EXPERT.match(name)
        if m and f"{m['pre']}.gate_up_proj" in self.targets:
            e, inter = int(m["e"]), self.cfg.moe_intermediate_size
            if e >= self.cfg.num_experts:
                raise CheckpointError(f"tensor {name}: expert {e} but config has {self.cfg.num_experts}")
            if m["part"] == "down_proj":
                return self._copy(f"{m['pre']}.down_proj", t, name, e)
            rows = slice(0, inter) if m["part"] == "gate_proj" else slice(inter, 2 * inter)
            return self._copy(f"{m['pre']}.gate_up_proj", t, name, (e, rows))
        target = name[: -len(".sinks")] + ".attention_sink_bias" if name.endswith(".self_attn.sinks") else name
        if target in self.targets:
            self._copy(target, t, name)
            self.loaded.add(target)
        elif _OWNED.match(name) and not self._beyond_config(name):
            raise CheckpointError(f"unexpected tensor {name} (shape {tuple(t.shape)}) for this config")
        else:
            log.info("ignoring tensor %s", name)

    def _beyond_config(self, name: str) -> bool:
        m = _MTP_LAYER.match(name)
        return m is not None and int(m.group(1)) >= self.cfg.num_mtp_layers

    def _load_fused_qkv(self, name: str) -> None:
        attn = self._layer_attn(name)
        groups = self.cfg.fused_qkv_groups or attn.num_kv_heads
        w = _read(self.shards, name, groups)
        try:
            q, k, v = split_fused_qkv(w, attn.num_heads, attn.num_kv_heads, attn.qk_dim, attn.v_dim, groups)
        except ValueError as e:
            raise CheckpointError(f"tensor {name}: {e}") from e
        base = name[: -len("qkv_proj.weight")]
        for part, tensor in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            self._copy(f"{base}{part}.weight", tensor, f"{base}{part}.weight")

    def finish(self) -> None:
        if self.cfg.tie_word_embeddings:
            with torch.no_grad():
                self.model.lm_head.weight.copy_(self.model.model.embed_tokens.weight)
        missing = sorted(self.expected() - self.loaded)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(f"tensor {missing[0]} is missing from the checkpoint; missing: "
                                  f"{', '.join(missing[:5])}{more}")


def _mtp_layers_in(names: list[str]) -> int:
    found = [int(m.group(1)) for n in names if (m := _MTP_LAYER.match(n))]
    return max(found) + 1 if found else 0


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> MiMoV2Model:
    with torch.device("meta"):
        model = MiMoV2Model(cfg)
    model.to_empty(device=device)
    # to_empty leaves the non-persistent rope tables uninitialised: recompute them

    model.inv_freq_full = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta_full).to(device)
    model.inv_freq_swa = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta_swa).to(device)
    return set_dtype(model, dtype)


def set_dtype(model: MiMoV2Model, dtype: torch.dtype) -> MiMoV2Model:
    model.to(dtype)
    model.inv_freq_full = model.inv_freq_full.float()
    model.inv_freq_swa = model.inv_freq_swa.float()
    for mod in model.modules():  # MoE gates stay float32 (see layers.MoEGate)
        if isinstance(mod, MoEGate):
            mod.weight.data = mod.weight.data.float()
            mod.e_score_correction_bias = mod.e_score_correction_bias.float()
    return model


def iter_names_with_progress(names: list[str], progress: bool) -> Iterator[str]:
    yield from tqdm(names, desc="loading weights", unit="tensor", disable=not progress)


def load_model(path: str | None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               progress: bool = True) -> tuple[MiMoV2Model, ModelConfig]:
    """Load a MiMo-V2 checkpoint directory, or the built-in tiny model (fixed seed) when ``path`` is None."""
    if path is None:
        cfg = ModelConfig.tiny()
        model = set_dtype(init_random_(MiMoV2Model(cfg), TINY_SEED), dtype).to(device)
        return model.eval(), cfg
    root = Path(path)
    cfg = ModelConfig.from_pretrained(root)
    shards = _Shards(root)
    names = shards.names()
    if cfg.num_mtp_layers == 0 and _mtp_layers_in(names):
        cfg = cfg.with_(num_mtp_layers=_mtp_layers_in(names))
    model = _empty_model(cfg, dtype, device)
    loader = _Loader(model, shards)
    for name in iter_names_with_progress(names, progress):
        loader.load_one(name)
    loader.finish()
    return model.eval(), cfg
