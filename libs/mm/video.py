"""Video decoding (CONTRACT STUB: the vision work adds parallel frame decode, fps sampling and limits)."""

from __future__ import annotations

import os
import tempfile

import cv2
import numpy as np

from libs.mm.api import EncodeError
from libs.model.vision_config import VisionConfig


def decode_video(data: bytes, vc: VisionConfig, workers: int = 1) -> np.ndarray:
    """File bytes (mp4 and the like) -> RGB uint8 frames ``[T, H, W, 3]`` sampled at ``vc.video_fps``, at most
    ``vc.video_max_frames``; EncodeError when no frame decodes."""
    with tempfile.NamedTemporaryFile(suffix=".video", delete=False) as f:
        f.write(data)
    try:
        cap = cv2.VideoCapture(f.name)
        fps = cap.get(cv2.CAP_PROP_FPS) or vc.video_fps
        step = max(1, round(fps / vc.video_fps))
        frames: list[np.ndarray] = []
        i = 0
        while len(frames) < vc.video_max_frames:
            ok, frame = cap.read()
            if not ok:
                break
            if i % step == 0:
                frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
            i += 1
        cap.release()
    finally:
        os.unlink(f.name)
    if not frames:
        raise EncodeError("the video could not be decoded (no frame)")
    return np.stack(frames)
