"""Vision tower weights: the built-in tiny tower (fixed seed) or a checkpoint's ``visual.*`` tensors.

Checkpoint names (MiMo-V2.5 and Qwen2.5-VL alike), under ``visual.`` or ``model.visual.``
(transformers >= 4.52):

    patch_embed.proj.weight                      [hidden, C, T, P, P]   (Conv3d, no bias)
    blocks.{i}.norm1.weight, norm2.weight        [hidden]               (RMSNorm)
    blocks.{i}.attn.qkv.weight / .bias           [(H + 2 KV) D, hidden] (fused, q | k | v)
    blocks.{i}.attn.proj.weight / .bias          [hidden, H D]
    blocks.{i}.attn.sinks                        [H]                    (local-attention blocks, when use_sink)
    blocks.{i}.mlp.{gate,up,down}_proj.weight / .bias
    merger.ln_q.weight                           [hidden]               (RMSNorm)
    merger.mlp.0.weight / .bias, merger.mlp.2.weight / .bias

Absent merger biases stay zero; anything else missing, unexpected or mis-shaped raises
:class:`CheckpointError` naming the tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from libs.model.loader import CheckpointError, _read, _Shards
from libs.model.vision import TINY_VISION_SEED, VisionTower
from libs.model.vision_config import VisionConfig

PREFIXES = ("model.visual.", "visual.")
OPTIONAL = frozenset({"merger.mlp.0.bias", "merger.mlp.2.bias"})


def vision_names(names: list[str]) -> dict[str, str]:
    """Tower parameter name -> checkpoint name, for the checkpoint's vision tensors."""
    out: dict[str, str] = {}
    for name in names:
        for prefix in PREFIXES:
            if name.startswith(prefix):
                out[name[len(prefix):]] = name
                break
    return out


def load_vision_tower(path: str | Path | None, vc: VisionConfig, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> VisionTower:
    """The tower of checkpoint directory `path` (config `vc`, e.g. ``ModelConfig.vision``), or the seeded tiny
    tower when `path` is None."""
    if path is None:
        return VisionTower(vc, seed=TINY_VISION_SEED).to(device=device, dtype=dtype).eval()
    shards = _Shards(Path(path))
    found = vision_names(shards.names())
    if not found:
        raise CheckpointError(f"no vision tensors (prefix {' or '.join(PREFIXES)}) in {path}")
    with torch.device("meta"):
        tower = VisionTower(vc, seed=None)
    tower.to_empty(device=device)
    params = dict(tower.named_parameters())
    for name, ckpt in sorted(found.items()):
        if name not in params:
            raise CheckpointError(f"unexpected vision tensor {ckpt} for this vision config")
        src = _read(shards, ckpt, None)
        if tuple(src.shape) != tuple(params[name].shape):
            raise CheckpointError(f"tensor {ckpt}: checkpoint shape {tuple(src.shape)} != expected "
                                  f"{tuple(params[name].shape)} for this vision config")
        with torch.no_grad():
            params[name].copy_(src)
    missing = sorted(set(params) - set(found) - OPTIONAL)
    if missing:
        raise CheckpointError(f"vision tensor visual.{missing[0]} is missing from the checkpoint "
                              f"({len(missing)} missing)")
    with torch.no_grad():
        for name in OPTIONAL - set(found):
            params[name].zero_()
    return tower.to(dtype).eval()
