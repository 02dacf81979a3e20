"""Image decoding for the encoder tier: the size is read from the header before any pixel is decoded (pillow's
lazy ``Image.open`` parses the header only), so a decompression bomb is refused for free; the pixels are then
decoded by opencv (``imdecode``, faster than pillow), GIF's first frame by pillow (opencv has no GIF reader).

Accepted: PNG, JPEG, WebP, GIF (first frame), BMP. Alpha is dropped (RGB out). Bad bytes, a truncated file, an
unsupported format or a size over the limits raise :class:`EncodeError` (the client gets a 400 with its text).
"""

from __future__ import annotations

import io
import struct
import warnings
from dataclasses import dataclass

import cv2
import numpy as np
from PIL import Image, UnidentifiedImageError

from libs.mm.api import EncodeError

FORMATS = {"PNG": "png", "JPEG": "jpeg", "MPO": "jpeg", "WEBP": "webp", "GIF": "gif", "BMP": "bmp"}


@dataclass(frozen=True)
class ImageHeader:
    width: int
    height: int
    format: str  # png | jpeg | webp | gif | bmp


def probe_image(data: bytes, max_pixels: int, max_bytes: int | None = None) -> ImageHeader:
    """Format and size from the header alone (no decode); EncodeError past `max_pixels` / `max_bytes`, for an
    unknown format or for bytes that are not an image."""
    if max_bytes is not None and len(data) > max_bytes:
        raise EncodeError(f"image of {len(data)} bytes is over the limit of {max_bytes} bytes")
    if not data:
        raise EncodeError("the image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:  # lazy: parses the header only
                width, height, fmt = im.width, im.height, im.format or ""
    except Image.DecompressionBombError as e:
        raise EncodeError(f"image header claims more pixels than any decoder allows ({e}); "
                          f"the limit is {max_pixels} pixels") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, struct.error):
        raise EncodeError("the data is not an image in a supported format (PNG, JPEG, WebP, GIF, BMP)") from None
    if fmt not in FORMATS:
        raise EncodeError(f"image format {fmt} is not supported (PNG, JPEG, WebP, GIF, BMP)")
    if width <= 0 or height <= 0:
        raise EncodeError(f"image of {width}x{height} pixels is empty")
    if width * height > max_pixels:
        raise EncodeError(f"image of {width}x{height} pixels is over the limit of {max_pixels} pixels")
    return ImageHeader(width, height, FORMATS[fmt])


def looks_complete(data: bytes, fmt: str) -> bool:
    """Whether the file's end marker is there: opencv decodes a truncated JPEG (and some PNGs) into a partly grey
    image with only a warning, so truncation is checked on the bytes."""
    if fmt == "png":
        return data.rfind(b"IEND") != -1
    if fmt == "jpeg":
        return data.rfind(b"\xff\xd9") != -1
    if fmt == "webp":  # RIFF header: little-endian size of what follows the first 8 bytes
        return len(data) >= 12 and len(data) >= 8 + int.from_bytes(data[4:8], "little")
    if fmt == "bmp":  # BITMAPFILEHEADER: total file size at bytes 2..6
        return len(data) >= 6 and len(data) >= int.from_bytes(data[2:6], "little")
    return data.rstrip(b"\x00").endswith(b"\x3b")  # gif trailer


def decode_image(data: bytes, max_pixels: int, max_bytes: int | None = None) -> np.ndarray:
    """File bytes -> RGB uint8 ``[H, W, 3]``; EncodeError for bytes that are not an image, a truncated image, or an
    image with more than `max_pixels` pixels (refused from its header, before decoding) or `max_bytes` bytes."""
    header = probe_image(data, max_pixels, max_bytes)
    if not looks_complete(data, header.format):
        raise EncodeError(f"the {header.format} image is truncated (its end is missing)")
    if header.format == "gif":
        return _first_gif_frame(data)
    arr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)  # 3 channels: alpha dropped
    if arr is None:
        raise EncodeError(f"the {header.format} image could not be decoded (corrupt or truncated)")
    if arr.shape[:2] != (header.height, header.width):
        raise EncodeError(f"the image decoded to {arr.shape[1]}x{arr.shape[0]}, its header says "
                          f"{header.width}x{header.height}")
    return cv2.cvtColor(arr, cv2.COLOR_BGR2RGB)


def _first_gif_frame(data: bytes) -> np.ndarray:
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.seek(0)
            return np.asarray(im.convert("RGB"))
    except (OSError, ValueError, SyntaxError) as e:
        raise EncodeError(f"the gif image could not be decoded ({e})") from None
