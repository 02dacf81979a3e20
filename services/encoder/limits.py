"""Input limits the encoder checks besides what decoding checks itself (images: pixels, in `decode_image`)."""

from __future__ import annotations

import os
import tempfile

import cv2

from libs.mm.api import EncodeError


def video_seconds(data: bytes) -> float | None:
    """A video's duration from its container (frame count / fps) without decoding a frame; None when the
    container does not say (the frame cap of decoding still bounds the work)."""
    with tempfile.NamedTemporaryFile(suffix=".video", delete=False) as f:
        f.write(data)
    try:
        cap = cv2.VideoCapture(f.name)
        try:
            if not cap.isOpened():
                raise EncodeError("the video could not be opened (not a video, or truncated)")
            frames, fps = cap.get(cv2.CAP_PROP_FRAME_COUNT), cap.get(cv2.CAP_PROP_FPS)
        finally:
            cap.release()
    finally:
        os.unlink(f.name)
    return frames / fps if frames > 0 and fps > 0 else None


def check_video_seconds(data: bytes, max_seconds: float) -> None:
    seconds = video_seconds(data)
    if seconds is not None and seconds > max_seconds:
        raise EncodeError(f"video of {seconds:.1f} s is over the limit of {max_seconds:g} s")
