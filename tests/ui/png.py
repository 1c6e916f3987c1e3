"""A PNG decoder (8-bit RGB / RGBA, the screenshots chromium writes) with zlib and numpy:
the dashboard tests check the pixels of what the browser drew."""

from __future__ import annotations

import struct
import zlib

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"


def decode(data: bytes) -> np.ndarray:
    """The image as a (height, width, channels) uint8 array."""
    assert data[:8] == SIGNATURE, "not a PNG"
    pos, idat, width, height, channels = 8, b"", 0, 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
    raw = zlib.decompress(idat)
    stride = width * channels
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.int32)
    for y in range(height):
        start = y * (stride + 1)
        kind = raw[start]
        line = np.frombuffer(raw, dtype=np.uint8, count=stride, offset=start + 1).astype(np.int32)
        if kind == 0:
            cur = line
        elif kind == 2:  # up
            cur = (line + prev) & 0xFF
        elif kind == 1:  # sub: a running sum per channel
            cur = (np.cumsum(line.reshape(width, channels), axis=0) & 0xFF).reshape(stride)
        else:  # average (3) and paeth (4): byte by byte
            cur = _sequential(kind, line.tolist(), prev.tolist(), channels)
        out[y] = cur
        prev = cur.astype(np.int32)
    return out.reshape(height, width, channels)


def _sequential(kind: int, line: list[int], prev: list[int], bpp: int) -> np.ndarray:
    cur = [0] * len(line)
    for i, x in enumerate(line):
        a = cur[i - bpp] if i >= bpp else 0
        b = prev[i]
        if kind == 3:
            cur[i] = (x + ((a + b) >> 1)) & 0xFF
            continue
        c = prev[i - bpp] if i >= bpp else 0
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
        cur[i] = (x + pred) & 0xFF
    return np.array(cur, dtype=np.int32)


def colours(image: np.ndarray) -> int:
    """How many distinct colours the image has."""
    rgb = image[..., :3].reshape(-1, 3).astype(np.uint32)
    return len(np.unique((rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2]))
