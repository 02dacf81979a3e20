"""Media decoding and device preprocessing (libs/mm/image, video, preprocess). All media are written here with
opencv (``cv2.imencode``, ``cv2.VideoWriter`` mp4v), or forged byte by byte where a header must lie."""

from __future__ import annotations

import os
import struct
import tempfile
import zlib
from dataclasses import replace

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from libs.mm import image as image_mod
from libs.mm.api import EncodeError
from libs.mm.image import decode_image, probe_image
from libs.mm.placeholders import smart_resize
from libs.mm.preprocess import preprocess
from libs.mm.video import decode_video, sample_indices, split_segments
from libs.model.vision_config import VisionConfig

pytestmark = pytest.mark.unit

VC = VisionConfig(out_hidden_size=64)  # MiMo-V2.5 preprocessing: patch 16, merge 2, CLIP mean / std
TINY = VisionConfig.tiny()
LIMIT = 4096 * 4096


def smooth_rgb(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A photo-like image (smooth gradients plus noise), so that resize filters are compared on real content."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([127 + 100 * np.sin(xx / 17 + c) * np.cos(yy / 23 - c) for c in range(3)], -1)
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


def encode(rgb: np.ndarray, ext: str, *params: int) -> bytes:
    ok, buf = cv2.imencode(ext, cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), list(params))
    assert ok
    return buf.tobytes()


def png_header_only(width: int, height: int) -> bytes:
    """A well-formed PNG whose IHDR claims `width` × `height` (its pixel data is a few bytes)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


# -- images ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ext,params,exact", [(".png", (), True), (".bmp", (), True),
                                              (".webp", (cv2.IMWRITE_WEBP_QUALITY, 101), True),
                                              (".jpg", (cv2.IMWRITE_JPEG_QUALITY, 95), False),
                                              (".gif", (), False)])
def test_formats_decode_to_rgb(ext, params, exact):
    rgb = smooth_rgb(48, 64)
    out = decode_image(encode(rgb, ext, *params), LIMIT)
    assert out.shape == (48, 64, 3) and out.dtype == np.uint8
    if exact:  # lossless formats: exactly the pixels, in RGB order
        assert np.array_equal(out, rgb)
    else:
        assert np.abs(out.astype(int) - rgb).mean() < 25  # lossy / palette, but the same picture, RGB order


def test_alpha_is_dropped():
    rgb = smooth_rgb(20, 30)
    rgba = np.dstack([rgb, np.full((20, 30, 1), 7, np.uint8)])
    ok, buf = cv2.imencode(".png", cv2.cvtColor(rgba, cv2.COLOR_RGBA2BGRA))
    out = decode_image(buf.tobytes(), LIMIT)
    assert out.shape == (20, 30, 3) and np.array_equal(out, rgb)


def test_bomb_is_refused_from_the_header_before_any_decode(monkeypatch):
    def no_decode(*_a, **_k):
        raise AssertionError("decoded a bomb")
    monkeypatch.setattr(image_mod.cv2, "imdecode", no_decode)
    monkeypatch.setattr(image_mod, "_first_gif_frame", no_decode)
    with pytest.raises(EncodeError, match="pixels"):
        decode_image(png_header_only(50_000, 50_000), LIMIT)
    with pytest.raises(EncodeError, match="5000x5000 pixels is over the limit of 16777216"):
        decode_image(png_header_only(5000, 5000), LIMIT)
    assert probe_image(png_header_only(5000, 5000), 10**8).format == "png"


@pytest.mark.parametrize("ext", [".png", ".jpg", ".webp", ".bmp", ".gif"])
def test_truncated_image_is_refused(ext):
    data = encode(smooth_rgb(64, 64), ext)
    with pytest.raises(EncodeError, match="truncated|not an image"):
        decode_image(data[: len(data) * 2 // 3], LIMIT)


@pytest.mark.parametrize("data", [b"", b"hello, this is text", b"\x89PNG\r\n\x1a\n" + b"\0" * 40, b"GIF89a"])
def test_non_image_bytes_are_refused(data):
    with pytest.raises(EncodeError):
        decode_image(data, LIMIT)


def test_byte_limit():
    data = encode(smooth_rgb(32, 32), ".png")
    assert decode_image(data, LIMIT, max_bytes=len(data)).shape == (32, 32, 3)
    with pytest.raises(EncodeError, match=f"image of {len(data)} bytes is over the limit of {len(data) - 1}"):
        decode_image(data, LIMIT, max_bytes=len(data) - 1)


def test_unsupported_format_is_refused():
    data = encode(smooth_rgb(16, 16), ".tiff")
    with pytest.raises(EncodeError, match="TIFF is not supported"):
        decode_image(data, LIMIT)


# -- video -----------------------------------------------------------------------------------------------------

def write_mp4(frames: int, fps: float, w: int = 96, h: int = 64) -> bytes:
    """An mp4v clip whose frame i has a distinct, decodable content (a bright bar at column 2*i)."""
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        vw = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
        for i in range(frames):
            f = np.full((h, w, 3), 40, np.uint8)
            f[:, (2 * i) % w:(2 * i) % w + 2] = 250
            vw.write(f)
        vw.release()
        with open(path, "rb") as fh:
            return fh.read()
    finally:
        os.unlink(path)


def bar_column(frame: np.ndarray) -> int:
    return int(np.argmax(frame[:, :, 0].mean(0))) // 2 * 2


def test_sample_indices_by_fps_and_cap():
    assert sample_indices(50, 25.0, 5.0, 64) == list(range(0, 50, 5))
    assert sample_indices(7, 30.0, 2.0, 64) == [0]
    capped = sample_indices(1000, 25.0, 5.0, 8)
    assert len(capped) == 8 and capped[0] == 0 and capped[-1] == 999
    assert sample_indices(0, 25.0, 2.0, 8) == []


def test_split_segments_is_contiguous_complete_and_balanced():
    idx = list(range(0, 100, 7))
    for workers in (1, 2, 3, 5, 40):
        parts = split_segments(idx, workers)
        assert [i for p in parts for i in p] == idx and 1 <= len(parts) <= min(workers, len(idx)) and all(parts)
    assert split_segments(idx, 1) == [idx]
    # without a seek cost: equal runs; with one, the first run (no seek) takes about the seek's worth more frames
    assert [len(p) for p in split_segments(list(range(100)), 2, seek_cost=0, keep_cost=0)] == [50, 50]
    first, second = split_segments(list(range(100)), 2, seek_cost=20, keep_cost=0)
    assert (first[-1] - first[0] + 1) - (second[-1] - second[0] + 1) in (19, 20, 21)
    # a clip too short for a seek to pay: one run
    assert split_segments([0, 1, 2], 3) == [[0, 1, 2]]


@pytest.fixture
def clean_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    yield tmp_path
    assert list(tmp_path.iterdir()) == [], "decode_video left a temporary file behind"


def test_video_frames_sampled_and_parallel_equals_sequential(clean_tmp):
    data = write_mp4(40, fps=20.0)
    vc = replace(TINY, video_fps=4.0, video_max_frames=64)
    seq = decode_video(data, vc, workers=1)
    assert seq.shape == (8, 64, 96, 3) and seq.dtype == np.uint8
    assert [bar_column(f) for f in seq] == [(2 * i) % 96 for i in range(0, 40, 5)]  # frames 0, 5, 10, ...
    for workers in (2, 3):
        assert len(split_segments(list(range(0, 40, 5)), workers)) > 1  # (the parallel path runs)
        assert np.array_equal(decode_video(data, vc, workers=workers), seq)
    capped = decode_video(data, replace(vc, video_max_frames=3), workers=2)
    assert [bar_column(f) for f in capped] == [0, 40, 78]  # frames 0, 20 (19.5 rounded to even), 39


@pytest.mark.parametrize("limits,match", [({"max_bytes": 100}, "bytes is over the limit of 100 bytes"),
                                          ({"max_seconds": 1.5}, r"video of 2.0 s is over the limit of 1.5 s"),
                                          ({"max_frames": 39}, "40 frames is over the limit of 39"),
                                          ({"max_pixels": 96 * 63}, "96x64 pixels are over the limit")])
def test_video_limits(clean_tmp, limits, match):
    with pytest.raises(EncodeError, match=match):
        decode_video(write_mp4(40, fps=20.0), TINY, workers=2, **limits)


@pytest.mark.parametrize("data", [b"definitely not a video", encode(smooth_rgb(16, 16), ".png"), b""])
def test_non_video_bytes_are_refused(clean_tmp, data):
    with pytest.raises(EncodeError):
        decode_video(data, TINY, workers=2)


# -- preprocessing ---------------------------------------------------------------------------------------------

def reference_preprocess(rgb: np.ndarray, vc: VisionConfig) -> np.ndarray:
    """Straightforward NumPy / PIL: PIL bicubic resize on uint8, /255, CLIP normalise, repeat in time, patchify."""
    h, w = smart_resize(rgb.shape[0], rgb.shape[1], vc)
    img = np.asarray(Image.fromarray(rgb).resize((w, h), Image.BICUBIC)) if (h, w) != rgb.shape[:2] else rgb
    x = (img.astype(np.float64) / 255.0 - np.array(vc.image_mean)) / np.array(vc.image_std)
    x = np.repeat(x.transpose(2, 0, 1)[None], vc.temporal_patch_size, axis=0)  # [T, C, H, W]
    p, m = vc.patch_size, vc.spatial_merge_size
    rows = []
    for a in range(h // p // m):
        for b in range(w // p // m):
            for i in range(m):
                for j in range(m):
                    y0, x0 = (a * m + i) * p, (b * m + j) * p
                    rows.append(x[:, :, y0:y0 + p, x0:x0 + p].transpose(1, 0, 2, 3).reshape(-1))
    return np.stack(rows)


def test_patch_order_exact_without_resize():
    rgb = smooth_rgb(64, 96)  # multiples of 32 within the budget: no resize, so only order and normalisation
    got, grid = preprocess([rgb], VC)
    assert grid.tolist() == [[1, 4, 6]] and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), reference_preprocess(rgb, VC), atol=1e-5, rtol=0)


# Resize tolerance: torch's antialiased bicubic is PIL's filter (a = -0.5, support scaled on downsampling) and both
# round to uint8, but PIL rounds between its horizontal and vertical pass too; that differs by at most 2-3 of 255
# levels on some pixels, i.e. 3 / 255 / min(std) = 0.045 after normalisation, and by a third of a level (5e-3)
# on average at worst (near-1 scale factors, where most pixels sit close to a rounding edge).
RESIZE_MAX, RESIZE_MEAN = 0.05, 5e-3


@pytest.mark.parametrize("shape", [(700, 1000), (333, 517), (40, 2000)])
def test_preprocess_matches_numpy_pil_reference(shape):
    rgb = smooth_rgb(*shape, seed=shape[1])
    got, _ = preprocess([rgb], VC)
    ref = reference_preprocess(rgb, VC)
    diff = np.abs(got.numpy() - ref)
    assert got.shape == ref.shape
    assert diff.max() <= RESIZE_MAX and diff.mean() <= RESIZE_MEAN


def test_preprocess_matches_transformers_qwen2vl_processor():
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    hp = Qwen2VLImageProcessorPil(min_pixels=VC.min_pixels, max_pixels=VC.max_pixels, patch_size=VC.patch_size,
                                  temporal_patch_size=VC.temporal_patch_size, merge_size=VC.spatial_merge_size,
                                  image_mean=list(VC.image_mean), image_std=list(VC.image_std))
    images = [smooth_rgb(700, 1000, 1), smooth_rgb(300, 200, 2), smooth_rgb(1100, 1000, 3)]  # the last shrinks
    out = hp(images=[Image.fromarray(i) for i in images], return_tensors="pt")
    got, grid = preprocess(images, VC)
    assert torch.equal(grid, out["image_grid_thw"])
    diff = (got - out["pixel_values"]).abs()
    assert diff.max() <= RESIZE_MAX and diff.mean() <= RESIZE_MEAN


def test_video_preprocess_pads_time_and_several_items_concatenate():
    video = np.stack([smooth_rgb(64, 64, s) for s in range(3)])  # 3 frames -> padded to 4 = 2 temporal patches
    image = smooth_rgb(32, 64)
    got, grid = preprocess([video, image], TINY)
    assert grid.tolist() == [[2, 8, 8], [1, 4, 8]]
    assert got.shape == (2 * 64 + 32, TINY.patch_dim)
    alone, _ = preprocess([video], TINY)
    torch.testing.assert_close(got[:128], alone, atol=0, rtol=0)
    last = got[64:128].view(64, 3, 2, 8, 8)  # 2nd temporal patch: frame 2 and its copy
    torch.testing.assert_close(last[:, :, 0], last[:, :, 1], atol=0, rtol=0)
    with pytest.raises(ValueError, match="RGB uint8"):
        preprocess([image.astype(np.float32)], TINY)


@pytest.mark.gpu
def test_cuda_preprocess_matches_cpu():
    images = [smooth_rgb(700, 1000, 1), smooth_rgb(64, 96, 2)]
    cpu, g1 = preprocess(images, VC, "cpu")
    gpu, g2 = preprocess(images, VC, "cuda")
    assert gpu.is_cuda and torch.equal(g1, g2.cpu())
    diff = (gpu.cpu() - cpu).abs()
    assert diff.max() <= RESIZE_MAX and diff.mean() <= RESIZE_MEAN
