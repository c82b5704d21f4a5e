"""MXFP4 weights (``quant_method: mxfp4``, GPT-OSS's release format), dequantized expert by expert as they stream.

A quantized weight ``W`` is stored as two tensors: ``W_blocks`` (uint8 ``[*prefix, R, G, 16]``: each byte two FP4
e2m1 values, the low nibble first, so 32 values per block of a row) and ``W_scales`` (uint8 ``[*prefix, R, G]``: one
e8m0 exponent per block). The value of element ``j`` of block ``g`` of row ``r`` is ``fp4 * 2^(scale - 127)``, and
the plain weight is the ``[*prefix, R, 32 G]`` matrix **transposed** in its last two dims (``[*prefix, 32 G, R]``:
GPT-OSS's ``gate_up_proj_blocks`` ``[E, 2I, H/32, 16]`` is ``gate_up_proj`` ``[E, H, 2I]``), as transformers'
``convert_moe_packed_tensors`` dequantizes it. Every such value is exact in bf16 (and fp32), so it is decoded straight into bf16: a 2-bit exponent and
1-bit mantissa times a power of two. Rows of the plain weight are read along its first dim (an expert at a time), so
only that expert's blocks and scales are in memory.

    >>> describe({"quant_method": "mxfp4"})
    'mxfp4 (FP4 e2m1 values in blocks of 32, an e8m0 scale per block)'
    >>> decode(torch.tensor([[[[0x21] + [0] * 15]]], dtype=torch.uint8), torch.tensor([[[128]]], dtype=torch.uint8))[0, :3, 0]
    tensor([1., 2., 0.], dtype=torch.bfloat16)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from ckptconv.errors import ConversionError
from ckptconv.io.quantized import Quantized, RawRead
from ckptconv.io.transpose import native_dtype, transpose_into

BLOCKS, SCALES = "_blocks", "_scales"
BLOCK_BYTES = 16  # 32 FP4 values per block, two per byte
# FP4 e2m1: sign, 2 exponent bits (bias 1), 1 mantissa bit; code 0-7 positive, 8-15 their negatives
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = torch.tensor([*_E2M1, *(-v for v in _E2M1)], dtype=torch.float32)
# both nibbles of every byte at once: PAIRS[b] = (value of the low nibble, value of the high nibble)
PAIRS = torch.stack([FP4_VALUES[torch.arange(256) & 0xF], FP4_VALUES[torch.arange(256) >> 4]], dim=1)
# e8m0: SCALE_VALUES[s] = 2^(s - 127), exact in bf16 (its exponent is e8m0's, its subnormals reach 2^-133)
SCALE_VALUES = torch.ldexp(torch.ones(256), torch.arange(256, dtype=torch.int32) - 127)
NAN_SCALE = 255
ROWS_PER_STEP = 512  # rows decoded at a time: the index and value temporaries stay a few MiB


def describe(qconfig: dict[str, Any]) -> str:
    return "mxfp4 (FP4 e2m1 values in blocks of 32, an e8m0 scale per block)"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def quantized_tensors(qconfig: dict[str, Any], stored: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                      source: str) -> dict[str, Quantized]:
    """Every ``*_blocks`` with its ``*_scales`` as the plain weight; a missing or misshapen scale, blocks that are not
    uint8 ``[..., R, G, 16]``, or scales without blocks are refused naming the tensor and what was expected."""
    out: dict[str, Quantized] = {}
    for key, (dtype, shape) in stored.items():
        if key.endswith(SCALES) and key[:-len(SCALES)] + BLOCKS not in stored:
            raise ConversionError(f"{source}: {key} has no {key[:-len(SCALES)] + BLOCKS} (MXFP4 scales without blocks)")
        if not key.endswith(BLOCKS):
            continue
        weight = key[:-len(BLOCKS)]
        scales = weight + SCALES
        if dtype != torch.uint8 or len(shape) < 4 or shape[-1] != BLOCK_BYTES:
            raise ConversionError(f"{source}: {key} is {_name(dtype)} {list(shape)}; MXFP4 blocks are uint8 "
                                  f"[..., rows, blocks, {BLOCK_BYTES}] with at least one leading (expert) dim")
        want = tuple(shape[:-1])
        if scales not in stored:
            raise ConversionError(f"{source}: {key} has no {scales} (expected uint8 {list(want)}: an e8m0 exponent "
                                  "per block of 32)")
        if stored[scales][0] != torch.uint8 or tuple(stored[scales][1]) != want:
            raise ConversionError(f"{source}: {scales} is {_name(stored[scales][0])} {list(stored[scales][1])}; "
                                  f"{key} {list(shape)} needs uint8 {list(want)}")
        if weight in stored:
            raise ConversionError(f"{source}: {weight} is stored both plain and as MXFP4 ({key})")
        plain = (*shape[:-3], shape[-2] * 2 * BLOCK_BYTES, shape[-3])
        out[weight] = Quantized(weight, plain, (key, scales), partial(_rows, key, scales))
    return out


def decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blocks`` ``[..., R, G, 16]`` and ``scales`` ``[..., R, G]`` as the bf16 ``[..., 32 G, R]`` they encode (exact:
    each FP4 value times a power of two), ``ROWS_PER_STEP`` stored rows at a time: computed in fp32 (CPUs multiply it
    fast), written transposed into the bf16 result (so fp32 temporaries stay a few MiB). Where the native kernel takes
    bf16 (``ckptconv.io.transpose``), a step is cast to bf16 in its stored order into one reused buffer (a fresh one
    per step costs its page faults) and each leading index's matrix of it transposed into its columns by the kernel:
    torch's copy that casts and transposes at once moves an element at a time."""
    *lead, rows, groups, _ = blocks.shape
    width = groups * 2 * BLOCK_BYTES
    out = torch.empty(*lead, width, rows, dtype=torch.bfloat16)
    count = math.prod(lead)
    native = native_dtype(torch.bfloat16)
    staging = torch.empty(count * min(rows, ROWS_PER_STEP) * width if native else 0, dtype=torch.bfloat16)
    for r in range(0, rows, ROWS_PER_STEP):
        part = blocks[..., r:r + ROWS_PER_STEP, :, :]
        values = PAIRS[part.long()].view(*part.shape[:-1], 2 * BLOCK_BYTES)
        values.mul_(SCALE_VALUES[scales[..., r:r + ROWS_PER_STEP, :].long()].unsqueeze(-1))
        if not native:
            out[..., r:r + ROWS_PER_STEP] = values.view(*part.shape[:-2], width).transpose(-1, -2)
            continue
        step = part.size(-3)
        stored = staging[:count * step * width].view(count, step, width).copy_(values.view(count, step, width))
        for n, matrix in enumerate(stored):  # [step, 32 G]: the step's rows of one leading index, as stored
            transpose_into(out.view(count, width, rows)[n, :, r:r + step], matrix)
    return out


def _rows(blocks: str, scales: str, read: RawRead, start: int, stop: int) -> torch.Tensor:
    """Plain rows ``[start, stop)`` (along the first, expert dim): only those experts' blocks and scales read; a scale
    of 255 (NaN in the MX format) is refused naming the tensor."""
    exponents = read(scales, start, stop)
    if bool((exponents == NAN_SCALE).any()):
        raise ConversionError(f"{scales}: an e8m0 scale of {NAN_SCALE} (NaN in the MX format) in rows {start}..{stop - 1}")
    return decode(read(blocks, start, stop), exponents)
