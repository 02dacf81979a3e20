"""Checkpoint loading: HF ``config.json`` + safetensors shards (with or without an index).

Handles FP8 e4m3 block-quantized weights (``weight_scale_inv``, dequantized at load), the V2.5/Pro fused
``qkv_proj`` layout, per-expert tensors mapped onto stacked expert weights, and transformers' ``sinks`` name
for the sink logits. Any missing, unexpected or mis-shaped tensor raises :class:`CheckpointError` naming it.

One code path loads a whole model and one parallel rank's shard (libs/engine/parallel/load.py): a :class:`Selection`
says which checkpoint tensors the load needs and which rows / columns of each (:class:`Cut`); the full load
(this module's :class:`Selection`) keeps everything whole.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from kernels.fp8 import dequant_fp8_block
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

    def _handle(self, name: str):
        f = self.where.get(name)
        if f is None:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint")
        if not f.is_file():
            raise CheckpointError(f"tensor {name}: shard file {f.name} listed in the index does not exist")
        if f not in self._open:
            self._open[f] = safe_open(str(f), "pt")
        return self._open[f]

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        """Shape and safetensors dtype (e.g. ``F8_E4M3``) of a tensor, from the file header (no data read)."""
        sl = self._handle(name).get_slice(name)  # type: ignore[attr-defined]
        return tuple(sl.get_shape()), sl.get_dtype()

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """A tensor, or only the part `index` selects (the other bytes of the file are never read)."""
        h = self._handle(name)
        if index is None:
            return h.get_tensor(name)  # type: ignore[attr-defined]
        return h.get_slice(name)[index]  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Cut:
    """Keep only `keep` of dimension `dim` (whose full size in the checkpoint is `full`)."""

    dim: int
    keep: range
    full: int


class Selection:
    """What a load keeps of the checkpoint. This base class: everything, whole (the full model). A parallel rank's
    selection (libs/engine/parallel/load.py) keeps its experts only, drops what its shard lacks and cuts tensors."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.experts = range(cfg.num_experts)  # the experts this load holds (stacked in this order)

    def keeps(self, name: str) -> bool:
        """False: the tensor is not part of what is loaded (skipped, never read nor checked)."""
        return True

    def cuts(self, name: str) -> tuple[Cut, ...]:
        """The parts of tensor `name` (a target parameter name, or a per-expert checkpoint name) to keep."""
        return ()


_FP8 = "F8_E4M3"
_BLOCK = (128, 128)


def _index(cuts: tuple[Cut, ...], ndim: int, block: tuple[int, ...] = ()) -> tuple[slice, ...]:
    """The slice of each dimension (in units of `block` entries when given: a block-scale grid)."""
    idx = [slice(None)] * ndim
    for c in cuts:
        b = block[c.dim] if block else 1
        idx[c.dim] = slice(c.keep.start // b, -(-c.keep.stop // b))
    return tuple(idx)


def cut(t: torch.Tensor, cuts: tuple[Cut, ...]) -> torch.Tensor:
    """The kept part of an in-memory tensor."""
    return t[_index(cuts, t.dim())] if cuts else t


def _block_aligned(cuts: tuple[Cut, ...], ndim: int) -> bool:
    return ndim == 2 and all(c.keep.start % _BLOCK[c.dim] == 0 and (c.keep.stop % _BLOCK[c.dim] == 0
                                                                     or c.keep.stop == c.full) for c in cuts)


def _read(shards: _Shards, name: str, fused_groups: int | None = None, cuts: tuple[Cut, ...] = ()) -> torch.Tensor:
    """Tensor `name` (only its `cuts`), FP8 block-quantized weights dequantized."""
    shape, dtype = shards.info(name)
    if dtype != _FP8:
        return shards.read(name, _index(cuts, len(shape)) if cuts else None)
    scale_name = name + "_scale_inv"
    if scale_name not in shards.where:
        raise CheckpointError(f"tensor {name} is FP8 but its block scales {scale_name} are missing")
    try:
        if fused_groups is not None:
            return dequant_fused_qkv_fp8(shards.read(name), shards.read(scale_name), fused_groups)
        if cuts and _block_aligned(cuts, len(shape)):  # the cut's quant blocks and their scales only
            grid = tuple(-(-n // b) for n, b in zip(shape, _BLOCK, strict=True))
            if shards.info(scale_name)[0] != grid:  # (the whole grid's shape: a slice of a wrong one may fit)
                raise ValueError(f"block scales have shape {shards.info(scale_name)[0]}; expected {grid}")
            return dequant_fp8_block(shards.read(name, _index(cuts, 2)),
                                     shards.read(scale_name, _index(cuts, 2, _BLOCK)))
        # not cut, or cut through 128-row / column quant blocks that straddle ranks: read whole, then cut
        return cut(dequant_fp8_block(shards.read(name), shards.read(scale_name)), cuts)
    except ValueError as e:
        raise CheckpointError(f"tensor {name}: {e}") from e


class _Loader:
    def __init__(self, model: MiMoV2Model, shards: _Shards, selection: Selection) -> None:
        self.model, self.cfg, self.shards, self.sel = model, model.cfg, shards, selection
        self.targets = dict(model.named_parameters()) | dict(model.named_buffers())
        self.loaded: set[str] = set()

    def expected(self) -> set[str]:
        names = set()
        for n in self.model.state_dict():
            if n.endswith("experts.gate_up_proj"):
                pre = n[: -len(".gate_up_proj")]
                names |= {f"{pre}.{e}.{p}.weight" for e in self.sel.experts for p in ("gate_proj", "up_proj")}
            elif n.endswith("experts.down_proj"):
                pre = n[: -len(".down_proj")]
                names |= {f"{pre}.{e}.down_proj.weight" for e in self.sel.experts}
            else:
                names.add(n)
        if self.cfg.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names

    def _dst(self, target: str, index) -> torch.Tensor:
        return self.targets[target] if index is None else self.targets[target][index]

    @staticmethod
    def _check(ckpt_name: str, shape: tuple[int, ...], dst: torch.Tensor, cuts: tuple[Cut, ...]) -> None:
        """The checkpoint tensor has the full shape `dst` (a cut of it) comes from."""
        want = list(dst.shape)
        for c in cuts:
            want[c.dim] = c.full
        if tuple(shape) != tuple(want):
            raise CheckpointError(f"tensor {ckpt_name}: checkpoint shape {tuple(shape)} != expected "
                                  f"{tuple(want)} for this config")

    def _put(self, dst: torch.Tensor, src: torch.Tensor, ckpt_name: str) -> None:
        with torch.no_grad():
            dst.copy_(src)
        self.loaded.add(ckpt_name)

    def _copy(self, target: str, ckpt_name: str, cuts: tuple[Cut, ...], index=None) -> None:
        """Checkpoint tensor `ckpt_name` (its `cuts`) into `target` (its `index`): shape checked before reading."""
        dst = self._dst(target, index)
        self._check(ckpt_name, self.shards.info(ckpt_name)[0], dst, cuts)
        self._put(dst, _read(self.shards, ckpt_name, None, cuts), ckpt_name)

    def _layer_attn(self, name: str):
        prefix = name.rsplit(".self_attn.", 1)[0]
        return self.model.get_submodule(prefix).self_attn

    def load_one(self, name: str) -> None:
        if name.endswith("_scale_inv") or "rotary_emb" in name or not self.sel.keeps(name):
            return
        if name.endswith("self_attn.qkv_proj.weight"):
            return self._load_fused_qkv(name)
        m = _EXPERT.match(name)
        if m and f"{m['pre']}.gate_up_proj" in self.targets:
            return self._load_expert(name, m)
        target = name[: -len(".sinks")] + ".attention_sink_bias" if name.endswith(".self_attn.sinks") else name
        if target in self.targets:
            self._copy(target, name, self.sel.cuts(target))
            self.loaded.add(target)
        elif _OWNED.match(name) and not self._beyond_config(name):
            raise CheckpointError(f"unexpected tensor {name} (shape {self.shards.info(name)[0]}) for this config")
        else:
            log.info("ignoring tensor %s", name)

    def _load_expert(self, name: str, m: re.Match) -> None:
        """One expert's projection into its slot of the stacked [E, ...] weights; other ranks' experts are
        skipped unread."""
        e = int(m["e"])
        if e >= self.cfg.num_experts:
            raise CheckpointError(f"tensor {name}: expert {e} but config has {self.cfg.num_experts}")
        if e not in self.sel.experts:
            return
        local, cuts = e - self.sel.experts.start, self.sel.cuts(name)
        if m["part"] == "down_proj":
            return self._copy(f"{m['pre']}.down_proj", name, cuts, local)
        inter = self.targets[f"{m['pre']}.gate_up_proj"].shape[1] // 2  # (this load's share of the dim)
        rows = slice(0, inter) if m["part"] == "gate_proj" else slice(inter, 2 * inter)
        return self._copy(f"{m['pre']}.gate_up_proj", name, cuts, (local, rows))

    def _beyond_config(self, name: str) -> bool:
        m = _MTP_LAYER.match(name)
        return m is not None and int(m.group(1)) >= self.cfg.num_mtp_layers

    def _load_fused_qkv(self, name: str) -> None:
        cfg = self.cfg  # the checkpoint's (whole-model) head counts: a rank's attention holds only its share
        kv_heads = cfg.kv_heads_swa if self._layer_attn(name).is_swa else cfg.kv_heads_full
        groups = cfg.fused_qkv_groups or kv_heads
        w = _read(self.shards, name, groups)
        try:
            q, k, v = split_fused_qkv(w, cfg.num_heads, kv_heads, cfg.qk_head_dim, cfg.v_head_dim, groups)
        except ValueError as e:
            raise CheckpointError(f"tensor {name}: {e}") from e
        base = name[: -len("qkv_proj.weight")]
        for part, tensor in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            target = f"{base}{part}.weight"
            cuts = self.sel.cuts(target)
            dst = self._dst(target, None)
            self._check(target, tuple(tensor.shape), dst, cuts)
            self._put(dst, cut(tensor, cuts), target)

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


def _load_tiny_weights(model: MiMoV2Model, path: str) -> None:
    from safetensors.torch import load_file

    try:
        state = load_file(path)
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(f"tiny model weights {path}: {exc}") from exc
    own = dict(model.named_parameters())
    wrong = sorted(n for n, t in state.items() if n not in own or own[n].shape != t.shape)
    if wrong:
        raise CheckpointError(f"tiny model weights {path}: not the built-in tiny model's parameters: {wrong[:5]}")
    model.load_state_dict(state, strict=False)


def _open(path: str | Path) -> tuple[ModelConfig, _Shards]:
    root = Path(path)
    cfg = ModelConfig.from_pretrained(root)
    shards = _Shards(root)
    names = shards.names()
    if cfg.num_mtp_layers == 0 and _mtp_layers_in(names):
        cfg = cfg.with_(num_mtp_layers=_mtp_layers_in(names))
    return cfg, shards


def checkpoint_config(path: str | Path) -> ModelConfig:
    """The ModelConfig load_model(path) builds (``config.json``, MTP layers counted from the tensor names when
    it does not say), from the files' headers only."""
    return _open(path)[0]


def _fill(model: MiMoV2Model, shards: _Shards, selection: Selection, progress: bool) -> None:
    loader = _Loader(model, shards, selection)
    for name in iter_names_with_progress(shards.names(), progress):
        loader.load_one(name)
    loader.finish()


def load_weights(model: MiMoV2Model, path: str | Path, selection: Selection, progress: bool = True) -> None:
    """Fill `model` (built for `selection`: a full model, or one rank's shard) from checkpoint directory `path`,
    reading only what `selection` keeps."""
    _fill(model, _Shards(Path(path)), selection, progress)


def load_model(path: str | None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               progress: bool = True, tiny_weights: str | None = None) -> tuple[MiMoV2Model, ModelConfig]:
    """Load a MiMo-V2 checkpoint directory, or the built-in tiny model when ``path`` is None: random weights
    (fixed seed), over which ``tiny_weights`` (a safetensors file of some of its parameters, e.g. the trained
    models/windserve-tiny) is loaded."""
    if path is None:
        cfg = ModelConfig.tiny()
        model = init_random_(MiMoV2Model(cfg), TINY_SEED)
        if tiny_weights:
            _load_tiny_weights(model, tiny_weights)
        return set_dtype(model, dtype).to(device).eval(), cfg
    cfg, shards = _open(path)
    model = _empty_model(cfg, dtype, device)
    _fill(model, shards, Selection(cfg), progress)
    return model.eval(), cfg
