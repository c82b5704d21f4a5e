"""FP8 weights with a scale per block (``quant_method: fp8``, DeepSeek-V3's release format), dequantized by rows.

A quantized weight ``W`` ``[R, C]`` is stored as a float8 tensor under its own name and ``W_scale_inv`` (float32)
``[ceil(R / br), ceil(C / bc)]``, with ``[br, bc]`` = ``quantization_config.weight_block_size``: the plain value of
``W[r, c]`` is ``W[r, c] * W_scale_inv[r // br, c // bc]`` (the edge blocks are partial). The block size is read from
the config, never guessed from shapes: a guess that fits the shapes would put every scale on the wrong rows.

    >>> describe({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    'fp8 (float8 weights with a float32 scale per 128 x 128 block)'
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from ckptconv.errors import ConversionError
from ckptconv.io.quantized import Quantized, RawRead

SCALE_SUFFIX = "_scale_inv"
FLOAT8 = frozenset(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                     "float8_e5m2fnuz") if hasattr(torch, name))


def block_size(qconfig: dict[str, Any], source: str = "config.json") -> tuple[int, int]:
    """``weight_block_size`` ``[rows, cols]``, validated."""
    block = qconfig.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(type(b) is int and b > 0 for b in block)):
        raise ConversionError(f"{source}: quantization_config.weight_block_size must be [rows, cols] of positive "
                              f"integers, got {block!r}")
    return block[0], block[1]


def describe(qconfig: dict[str, Any]) -> str:
    br, bc = block_size(qconfig)
    return f"fp8 (float8 weights with a float32 scale per {br} x {bc} block)"


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale tensor a weight of ``shape`` needs (partial blocks at the edges count)."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def quantized_tensors(qconfig: dict[str, Any], stored: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                      source: str) -> dict[str, Quantized]:
    """Every float8 weight with its scale; a float8 weight without one, a scale of the wrong shape, or a scale
    whose weight is not float8 is refused naming the tensor and the shape expected."""
    block = block_size(qconfig, source)
    out: dict[str, Quantized] = {}
    for key, (dtype, shape) in stored.items():
        if key.endswith(SCALE_SUFFIX):
            weight = key[:-len(SCALE_SUFFIX)]
            if weight not in stored or stored[weight][0] not in FLOAT8:
                found = "missing" if weight not in stored else str(stored[weight][0]).removeprefix("torch.")
                raise ConversionError(f"{source}: {key} scales {weight!r}, which is {found}, not float8")
            continue
        if dtype not in FLOAT8:
            continue
        scale = key + SCALE_SUFFIX
        want = scale_shape(shape, block) if len(shape) == 2 else None
        if want is None:
            raise ConversionError(f"{source}: {key} is {str(dtype).removeprefix('torch.')} of shape {list(shape)}; "
                                  "fp8 blocks are read for 2-D weights only")
        if scale not in stored:
            raise ConversionError(f"{source}: {key} is {str(dtype).removeprefix('torch.')} but has no {scale} "
                                  f"(expected float32 {list(want)} for blocks {list(block)})")
        if tuple(stored[scale][1]) != want:
            raise ConversionError(f"{source}: {scale} has shape {list(stored[scale][1])}; {key} {list(shape)} in "
                                  f"blocks {list(block)} (quantization_config.weight_block_size) needs {list(want)}")
        out[key] = Quantized(key, tuple(shape), (key, scale), partial(_rows, key, scale, block, shape[1]))
    return out


def _rows(key: str, scale: str, block: tuple[int, int], cols: int, read: RawRead, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of ``key`` dequantized in float32: only those rows and their scale rows are read; each
    scale row multiplies its block of rows in place (no scale-sized copy of the band)."""
    br, bc = block
    rows = read(key, start, stop).to(torch.float32)
    first = start // br
    scales = read(scale, first, -(-stop // br)).to(torch.float32)
    for i in range(scales.shape[0]):
        lo = max(start, (first + i) * br) - start
        hi = min(stop, (first + i + 1) * br) - start
        rows[lo:hi].mul_(scales[i].repeat_interleave(bc)[:cols])
    return rows
