"""Image decoding (CONTRACT STUB: the vision work hardens it — header check before decode, formats, limits)."""

from __future__ import annotations

import cv2
import numpy as np

from libs.mm.api import EncodeError


def decode_image(data: bytes, max_pixels: int) -> np.ndarray:
    """File bytes -> RGB uint8 ``[H, W, 3]``; EncodeError for bytes that are not an image or an image with more
    than `max_pixels` pixels."""
    arr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if arr is None:
        raise EncodeError("the image could not be decoded (not an image, or truncated)")
    if arr.shape[0] * arr.shape[1] > max_pixels:
        raise EncodeError(f"image of {arr.shape[1]}x{arr.shape[0]} pixels is over the limit of {max_pixels}")
    return cv2.cvtColor(arr, cv2.COLOR_BGR2RGB)
