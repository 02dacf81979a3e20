"""Media preparation benchmark (#16): windserve's decode + device preprocessing against transformers' Qwen2-VL
image processor, and parallel against sequential video frame decode.

    python -m bench.mm_prep [--quick] [--out PATH]

1. Images: `libs.mm.image.decode_image` + `libs.mm.preprocess.preprocess` against pillow +
   `Qwen2VLImageProcessorPil` on the same encoded images, taking turns; the median round.
2. Video: `decode_video` with 1 and with 2 workers, taking turns; wall and CPU time.

Headline: `HEADLINE_KEYS` (goals in `GOALS`). `measure(quick)` returns the figures (bench.encoder embeds
them); `main` writes bench/results/mm_prep.json. Method: docs/multimodal.md, "Media preparation".
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from PIL import Image

from libs.mm.image import decode_image
from libs.mm.preprocess import default_device, preprocess
from libs.mm.video import decode_video, single_threaded_opencv
from libs.model.vision_config import VisionConfig

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUICK_RESULTS = ROOT / ".run" / "bench-quick"
SIZES = ((480, 640), (720, 1280), (768, 1024), (1080, 1920), (1200, 1600), (600, 800))
GOALS = {"preprocess_speedup_vs_transformers": 2.0, "video_parallel_speedup": 1.7}
HEADLINE_KEYS = tuple(GOALS)  # top-level keys of mm_prep.json (and of bench.encoder's JSON)


def photo(h: int, w: int, seed: int) -> np.ndarray:
    """Photo-like RGB (smooth gradients + noise): compresses like a photo, unlike pure noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([127 + 100 * np.sin(xx / (31 + 7 * c) + c) * np.cos(yy / 37 - c) for c in range(3)], -1)
    return np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)


def images(quick: bool) -> list[bytes]:
    out = []
    for i, (h, w) in enumerate(SIZES[:3] if quick else SIZES):
        bgr = cv2.cvtColor(photo(h, w, i), cv2.COLOR_RGB2BGR)
        ext, params = (".jpg", [cv2.IMWRITE_JPEG_QUALITY, 90]) if i % 2 == 0 else (".png", [])
        out.append(cv2.imencode(ext, bgr, params)[1].tobytes())
    return out


def timed_rounds(fn: Callable[[], object], rounds: int, cpu: list[float] | None = None) -> list[float]:
    """Wall seconds of each round after a warm-up (imports, allocator, kernel selection); the process CPU seconds
    (all threads) of each round go to `cpu` when given."""
    return taking_turns([fn], rounds, None if cpu is None else [cpu])[0]


def taking_turns(fns: Sequence[Callable[[], object]], rounds: int,
                 cpu: Sequence[list[float]] | None = None) -> list[list[float]]:
    """Wall seconds of each round of each of `fns`, which take turns round by round after a warm-up each (a slow
    spell of a shared machine, e.g. a neighbour on the second core, hits them alike); the process CPU seconds of
    each round go to `cpu[i]` when given."""
    for fn in fns:
        fn()
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            out[i].append(time.perf_counter() - start)
            if cpu is not None:
                cpu[i].append(time.process_time() - start_cpu)
    return out


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside the block."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_preprocess(quick: bool, vc: VisionConfig) -> dict[str, Any]:
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    data = images(quick)
    device = default_device()
    hf = Qwen2VLImageProcessorPil(min_pixels=vc.min_pixels, max_pixels=vc.max_pixels, patch_size=vc.patch_size,
                                  temporal_patch_size=vc.temporal_patch_size, merge_size=vc.spatial_merge_size,
                                  image_mean=list(vc.image_mean), image_std=list(vc.image_std))

    def ours() -> None:
        for d in data:
            preprocess([decode_image(d, 1 << 26)], vc, device)
        _sync(device)

    def theirs() -> None:
        for d in data:
            hf(images=[Image.open(io.BytesIO(d)).convert("RGB")], return_tensors="pt")

    def ours_one_thread() -> None:  # the headline: one thread each, as pillow and transformers' numpy steps use
        with torch_threads(1):
            ours()

    rounds = 3 if quick else 7
    default_threads = torch.get_num_threads()
    t_ours_default = timed_rounds(ours, rounds)
    t_ours, t_theirs = taking_turns([ours_one_thread, theirs], rounds)
    # the same without the decode (already-decoded arrays / pillow images): the preprocessing on its own
    arrays = [decode_image(d, 1 << 26) for d in data]
    pils = [Image.fromarray(a) for a in arrays]

    def ours_only() -> None:
        with torch_threads(1):
            for a in arrays:
                preprocess([a], vc, device)
            _sync(device)

    p_ours, p_theirs = taking_turns([ours_only, lambda: [hf(images=[im], return_tensors="pt") for im in pils]],
                                    rounds)
    n = len(data)
    return {
        "images": n, "rounds": rounds, "device": str(device), "torch_threads": 1,
        "windserve_default_threads": default_threads,
        "windserve_default_threads_ms_per_image": 1000 * statistics.median(t_ours_default) / n,
        "windserve_ms_per_image": 1000 * statistics.median(t_ours) / n,
        "transformers_ms_per_image": 1000 * statistics.median(t_theirs) / n,
        "windserve_best_ms_per_image": 1000 * min(t_ours) / n,
        "transformers_best_ms_per_image": 1000 * min(t_theirs) / n,
        "preprocess_speedup_vs_transformers": statistics.median(t_theirs) / statistics.median(t_ours),
        "preprocess_speedup_best": min(t_theirs) / min(t_ours),
        "preprocess_only_windserve_ms_per_image": 1000 * statistics.median(p_ours) / n,
        "preprocess_only_transformers_ms_per_image": 1000 * statistics.median(p_theirs) / n,
        "preprocess_only_speedup": statistics.median(p_theirs) / statistics.median(p_ours),
    }


def write_clip(seconds: float, fps: float, w: int, h: int) -> bytes:
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
        base = cv2.cvtColor(photo(h, w, 99), cv2.COLOR_RGB2BGR)
        for i in range(int(seconds * fps)):
            writer.write(np.roll(base, 4 * i, axis=1))  # a panning shot: every frame differs
        writer.release()
        return Path(path).read_bytes()
    finally:
        os.unlink(path)


def measure_video(quick: bool, vc: VisionConfig) -> dict[str, Any]:
    seconds, fps = (4.0, 25.0) if quick else (12.0, 25.0)
    clip = write_clip(seconds, fps, 640, 480)
    vc = replace(vc, video_fps=4.0, video_max_frames=64)
    rounds = 3 if quick else 15
    frames = decode_video(clip, vc, workers=1).shape[0]
    seq_cpu: list[float] = []
    par_cpu: list[float] = []
    seq, par = taking_turns([lambda: decode_video(clip, vc, workers=1), lambda: decode_video(clip, vc, workers=2)],
                            rounds, [seq_cpu, par_cpu])
    cpu_share = statistics.median(s / w for s, w in zip(seq_cpu, seq, strict=True))
    return {
        "clip": {"seconds": seconds, "fps": fps, "size": "640x480", "codec": "mp4v", "bytes": len(clip)},
        "sampled_frames": frames, "sample_fps": vc.video_fps, "rounds": rounds,
        "sequential_ms": 1000 * statistics.median(seq), "parallel2_ms": 1000 * statistics.median(par),
        "video_parallel_speedup": statistics.median(seq) / statistics.median(par),
        "video_parallel_speedup_best": min(seq) / min(par),
        # CPU seconds: what the split costs (seeks), and the speedup two free cores would give (2 x seq / par CPU)
        "sequential_cpu_ms": 1000 * statistics.median(seq_cpu), "parallel2_cpu_ms": 1000 * statistics.median(par_cpu),
        "speedup_on_two_free_cores": 2 * statistics.median(seq_cpu) / statistics.median(par_cpu),
        "sequential_cpu_share": cpu_share,  # < 1: the sequential decode did not even get one whole core
    }


def measure(quick: bool) -> dict[str, Any]:
    vc = VisionConfig()
    load = os.getloadavg()[0]
    single_threaded_opencv()  # as the encoder service runs (libs/mm/video.py): both figures below
    pre = measure_preprocess(quick, vc)
    vid = measure_video(quick, vc)
    out: dict[str, Any] = {
        "preprocess_speedup_vs_transformers": pre["preprocess_speedup_vs_transformers"],
        "video_parallel_speedup": vid["video_parallel_speedup"],
        "goals": GOALS,
        "cpus": os.cpu_count(), "opencv_threads": cv2.getNumThreads(), "load_average_at_start": load, "quick": quick,
        "preprocess": pre, "video": vid,
    }
    out["met"] = {k: out[k] >= g for k, g in GOALS.items()}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 image sizes, a 4 s clip, 3 rounds (a smoke run)")
    ap.add_argument("--out", type=Path, default=None, help="the JSON; default bench/results/mm_prep.json, with "
                    "--quick .run/bench-quick/mm_prep.json")
    args = ap.parse_args(argv)
    out = args.out or (QUICK_RESULTS if args.quick else RESULTS) / "mm_prep.json"
    res = measure(args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    for key, goal in GOALS.items():
        print(f"{key}: {res[key]:.2f} (goal >= {goal}) {'met' if res['met'][key] else 'MISSED'}")
    print(f"load average at start {res['load_average_at_start']:.1f} on {res['cpus']} cpus; "
          f"windserve {res['preprocess']['windserve_ms_per_image']:.1f} ms/image vs transformers "
          f"{res['preprocess']['transformers_ms_per_image']:.1f}; video sequential "
          f"{res['video']['sequential_ms']:.0f} ms vs parallel {res['video']['parallel2_ms']:.0f} ms "
          f"(CPU-bound estimate on two free cores {res['video']['speedup_on_two_free_cores']:.2f}x, sequential got "
          f"{res['video']['sequential_cpu_share']:.2f} of a core)")


if __name__ == "__main__":
    main()
