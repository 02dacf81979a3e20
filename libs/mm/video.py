"""Video decoding for the encoder tier: frames sampled at ``vc.video_fps`` (at most ``vc.video_max_frames``, spread
evenly over the clip when more would be sampled), decoded in parallel by a thread pool.

`decode_video` writes the bytes to a temporary file (always removed), splits the sampled frames into at most
``workers`` contiguous segments of about equal cost (`split_segments`, counting a seek as
`SEEK_COST_FRAMES` decodes) and decodes each on its own capture; opencv's decode releases the GIL. Limits
(bytes, seconds, source frames, pixels per frame) are checked on the header before decoding and raise
:class:`EncodeError`, as does a file opencv cannot open or with no decodable frame.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import cv2
import numpy as np

from libs.mm.api import EncodeError
from libs.model.vision_config import VisionConfig


def single_threaded_opencv() -> None:
    """OpenCV without its own thread pool, process-wide (what the encoder runs with): a media decode here is
    parallel by windserve's pools (`workers` above, the encoder's decode threads), and OpenCV's pool on top
    would only oversubscribe the cores."""
    cv2.setNumThreads(1)


@dataclass(frozen=True)
class VideoHeader:
    frames: int
    fps: float
    width: int
    height: int

    @property
    def seconds(self) -> float:
        return self.frames / self.fps


def sample_indices(frames: int, fps: float, target_fps: float, max_frames: int) -> list[int]:
    """Source frame indices to keep: one every ``fps / target_fps`` frames from the first; when that gives more
    than `max_frames`, `max_frames` indices spread evenly over the whole clip (first and last included)."""
    if frames <= 0:
        return []
    n = max(1, math.ceil(frames * target_fps / fps))
    if n <= max_frames:
        picked = [min(frames - 1, round(k * fps / target_fps)) for k in range(n)]
    else:
        picked = np.linspace(0, frames - 1, max_frames).round().astype(int).tolist()
    return sorted(set(picked))


# What a worker's seek costs, in frame decodes: opencv's FFmpeg seek restarts from the keyframe before `target - 16`
# and decodes forward, ~4.3 ms for a 640x480 mp4v clip (GOP 12) whose frames decode in ~0.15 ms each (bench.mm_prep's
# clip); a longer GOP costs more. Converting a kept frame to RGB costs about one decode.
SEEK_COST_FRAMES = 28
KEEP_COST_FRAMES = 1


def split_segments(indices: Sequence[int], workers: int, seek_cost: float = SEEK_COST_FRAMES,
                   keep_cost: float = KEEP_COST_FRAMES) -> list[list[int]]:
    """`indices` (sorted source frames) in at most `workers` contiguous, non-empty runs of about equal decode cost:
    a run costs the frames decoded from its first index to its last, `keep_cost` per index kept, and `seek_cost`
    unless it starts the clip (worker 0 reads from frame 0 without a seek), so the first run is the longest. Fewer
    runs when a seeking worker would spend its whole share seeking."""
    n = len(indices)
    if n == 0:
        return []
    # cost of decoding from frame 0 through indices[j], keeping every index up to it
    cum = [indices[j] + 1 + keep_cost * (j + 1) for j in range(n)]
    k = max(1, min(workers, n))
    while k > 1 and (cum[-1] + (k - 1) * seek_cost) / k <= seek_cost:
        k -= 1
    share = (cum[-1] + (k - 1) * seek_cost) / k
    runs, start = [], 0
    for b in range(1, k):
        bound = b * share - (b - 1) * seek_cost  # where run b - 1 should end, in cumulative cost
        end = start
        while end < n and cum[end] <= bound:
            end += 1
        if end > start and end < n:
            runs.append(list(indices[start:end]))
            start = end
    runs.append(list(indices[start:]))
    return runs


@contextmanager
def _temp_file(data: bytes) -> Iterator[str]:
    fd, path = tempfile.mkstemp(suffix=".video", prefix="windserve-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        yield path
    finally:
        os.unlink(path)


@contextmanager
def _capture(path: str) -> Iterator[cv2.VideoCapture]:
    # one FFmpeg thread per capture: parallelism is the pool's (`workers`), not FFmpeg's own frame threads, so
    # an encoder's CPU use is what its config says
    cap = cv2.VideoCapture(path, cv2.CAP_FFMPEG, [cv2.CAP_PROP_N_THREADS, 1])
    try:
        if not cap.isOpened():
            raise EncodeError("the video could not be opened (not a video, or an unsupported container / codec)")
        yield cap
    finally:
        cap.release()


def read_header(cap: cv2.VideoCapture) -> VideoHeader:
    header = VideoHeader(int(cap.get(cv2.CAP_PROP_FRAME_COUNT)), float(cap.get(cv2.CAP_PROP_FPS)),
                         int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)))
    if header.frames <= 0 or not header.fps > 0 or header.width <= 0 or header.height <= 0:
        raise EncodeError(f"the video header gives no usable frame count / fps / size ({header})")
    return header


def check_limits(h: VideoHeader, max_seconds: float | None, max_frames: int | None,
                 max_pixels: int | None) -> None:
    if max_seconds is not None and h.seconds > max_seconds:
        raise EncodeError(f"video of {h.seconds:.1f} s is over the limit of {max_seconds} s")
    if max_frames is not None and h.frames > max_frames:
        raise EncodeError(f"video of {h.frames} frames is over the limit of {max_frames} frames")
    if max_pixels is not None and h.width * h.height > max_pixels:
        raise EncodeError(f"video frames of {h.width}x{h.height} pixels are over the limit of {max_pixels}")


class _Frames:
    """The output array, ``[len(rows), *frame shape]``: made from the first frame segment 0 keeps (the clip's first
    frame: its size can differ from the header's, e.g. a rotated clip turned upright by opencv), so the other
    segments' workers wait for it (`get`) before their first kept frame, while they seek."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._out: Future[np.ndarray] = Future()

    def make(self, shape: tuple[int, ...]) -> np.ndarray:
        self._out.set_result(np.empty((self.rows, *shape), dtype=np.uint8))
        return self._out.result()

    def fail(self, exc: BaseException) -> None:
        if not self._out.done():
            self._out.set_exception(exc)

    def get(self) -> np.ndarray:
        return self._out.result()


def _read_segment(cap: cv2.VideoCapture, wanted: list[int], frames: _Frames, row: dict[int, int],
                  first: bool = False) -> list[int]:
    """Frames `wanted` (sorted) from `cap` (seek to the first unless `cap` is at it, then walk forward), each
    converted to RGB straight into its row of the output (`row`: source frame -> row); the rows written. The
    `first` segment makes the output from its first kept frame (EncodeError, for every segment, when none
    decodes); EncodeError for a frame whose size is not that frame's."""
    rows: list[int] = []
    out = None
    try:
        if wanted[0] > 0:
            cap.set(cv2.CAP_PROP_POS_FRAMES, wanted[0])
        pos = wanted[0]
        while pos <= wanted[-1]:
            if not cap.grab():
                break  # the container promised more frames than it holds: keep what decoded
            if pos in row:
                ok, frame = cap.retrieve()
                if ok:
                    if out is None:
                        out = frames.make(frame.shape) if first else frames.get()
                    if frame.shape != out.shape[1:]:
                        raise EncodeError("the video's frames change size mid-stream (not supported)")
                    cv2.cvtColor(frame, cv2.COLOR_BGR2RGB, dst=out[row[pos]])
                    rows.append(row[pos])
                elif first and out is None:
                    break  # (the clip's first frame does not decode: nothing to size the output by)
            pos += 1
        if first and out is None:
            raise EncodeError("the video could not be decoded (no frame)")
    except BaseException as exc:
        if first:
            frames.fail(exc)
        raise
    return rows


def decode_video(data: bytes, vc: VisionConfig, workers: int = 1, max_bytes: int | None = None,
                 max_seconds: float | None = None, max_frames: int | None = None,
                 max_pixels: int | None = None) -> np.ndarray:
    """File bytes (mp4 and the like) -> RGB uint8 frames ``[T, H, W, 3]`` sampled at ``vc.video_fps``, at most
    ``vc.video_max_frames``, decoded by `workers` threads. EncodeError past `max_bytes` / `max_seconds` /
    `max_frames` (frames in the source) / `max_pixels` (per frame), or when no frame decodes."""
    if max_bytes is not None and len(data) > max_bytes:
        raise EncodeError(f"video of {len(data)} bytes is over the limit of {max_bytes} bytes")
    if not data:
        raise EncodeError("the video is empty (0 bytes)")
    with _temp_file(data) as path, _capture(path) as head:
        header = read_header(head)
        check_limits(header, max_seconds, max_frames, max_pixels)
        wanted = sample_indices(header.frames, header.fps, vc.video_fps, vc.video_max_frames)
        parts = split_segments(wanted, workers)
        # every frame lands in its row of one array (the RGB conversion writes it there, in the worker): no
        # stacking copy after the workers, which was serial; segment 0 goes on with the capture that read the header
        frames, row = _Frames(len(wanted)), {f: r for r, f in enumerate(wanted)}

        def segment(k: int) -> list[int]:
            if k == 0:
                return _read_segment(head, parts[0], frames, row, first=True)
            with _capture(path) as cap:
                return _read_segment(cap, parts[k], frames, row)

        if len(parts) == 1:
            rows = segment(0)
        else:
            with ThreadPoolExecutor(len(parts), thread_name_prefix="video-decode") as pool:
                rows = [r for seg in pool.map(segment, range(len(parts))) for r in seg]
        out = frames.get()
    if len(rows) < len(wanted):
        out = out[sorted(rows)]  # (a short container: what decoded)
    if not len(out):
        raise EncodeError("the video could not be decoded (no frame)")
    return out
