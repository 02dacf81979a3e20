"""Tensor <-> byte-buffer helpers: gather pages into one payload, scatter a payload into pages."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .protocol import LayerSpec

# A layer payload: one tensor, or the layer's pages (gathered / scattered in order).
Payload = torch.Tensor | Sequence[torch.Tensor]


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _parts(payload: Payload) -> list[torch.Tensor]:
    return [payload] if isinstance(payload, torch.Tensor) else list(payload)


def payload_nbytes(payload: Payload) -> int:
    return sum(t.numel() * t.element_size() for t in _parts(payload))


def check_payload(spec: LayerSpec, payload: Payload, what: str) -> None:
    """Raise ValueError naming the layer when ``payload`` cannot carry ``spec``'s bytes."""
    parts = _parts(payload)
    if not parts:
        raise ValueError(f"{what}: layer {spec.group}/{spec.layer_index} has no tensors")
    bad = {dtype_name(t) for t in parts} - {spec.dtype}
    if bad:
        raise ValueError(f"{what}: layer {spec.group}/{spec.layer_index} dtype {bad} != header {spec.dtype}")
    got = payload_nbytes(parts)
    if got != spec.nbytes:
        raise ValueError(f"{what}: layer {spec.group}/{spec.layer_index} has {got} bytes, header says "
                         f"{spec.nbytes} (shape {spec.shape}, {spec.dtype})")


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor (shares memory; works for bfloat16/fp8 too)."""
    if not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor")
    return t.reshape(-1).view(torch.uint8)


def gather(payload: Payload) -> torch.Tensor:
    """One contiguous uint8 tensor with the payload's bytes (no copy when already contiguous)."""
    parts = _parts(payload)
    if len(parts) == 1 and parts[0].is_contiguous():
        return byte_view(parts[0])
    return torch.cat([byte_view(p.contiguous()) for p in parts])


def landing_buffer(dest: Payload) -> torch.Tensor:
    """Where received bytes land: the destination itself when contiguous, else a staging buffer."""
    parts = _parts(dest)
    if len(parts) == 1 and parts[0].is_contiguous():
        return byte_view(parts[0])
    return torch.empty(payload_nbytes(parts), dtype=torch.uint8, device=parts[0].device)


def scatter(landing: torch.Tensor, dest: Payload) -> None:
    """Copy staged bytes into the destination pages (no-op when they landed in place)."""
    parts = _parts(dest)
    if len(parts) == 1 and parts[0].is_contiguous():
        return
    offset = 0
    for part in parts:
        n = part.numel() * part.element_size()
        chunk = landing[offset:offset + n]
        if part.is_contiguous():
            byte_view(part).copy_(chunk)
        else:
            part.copy_(chunk.view(part.dtype).view(part.shape))
        offset += n


def host_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy memoryview of a CPU uint8 tensor (the TCP engine's socket buffers)."""
    return memoryview(t.numpy())  # type: ignore[arg-type]  # ndarray implements the buffer protocol


def ucx_buffer(t: torch.Tensor) -> object:
    """An object ucxx accepts: numpy view for host memory, the tensor itself on CUDA."""
    return t if t.is_cuda else t.numpy()
