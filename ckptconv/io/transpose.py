"""A matrix's transpose copied into another (``dst.copy_(src.t())``), through ckptconv's native kernel where it
applies, else torch's copy.

NxD stores every expert matrix transposed against HF, so each expert byte of an MoE conversion goes through one
transpose. torch's CPU transpose of 2-byte elements moves one element at a time (~0.45 CPU s/GB against ~0.09 for a
copy, ``benchmarks/transpose_floor.py``); the kernel (``_transpose.c``, an optional extension built by ``setup.py``)
moves tiles of 8 x 8 (SSE2) or 16 x 16 (AVX2) elements in SIMD registers (~0.16 for Mixtral's expert matrices). It
takes 2- and 4-byte elements in rows of unit stride, source and target rows any distance apart (a column slice of a
larger matrix, a view at an offset); anything else, or no kernel built, or ``CKPTCONV_NATIVE=0`` in the environment,
goes to torch's copy. ``python -m ckptconv.io.transpose`` says which.
"""

from __future__ import annotations

import os

import torch

try:
    from ckptconv.io import _transpose as _native
except ImportError:  # built without a C compiler (the extension is optional): torch's copy
    _native = None

ENV = "CKPTCONV_NATIVE"  # "0": torch's copy even where the kernel is built (the benchmark's before, the tests' other lane)
# moved as bits, so any dtype of 2 or 4 bytes without views of its own (conjugate, negative) is one of these
_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.int16, torch.float32, torch.int32})


_ENABLED = _native is not None and os.environ.get(ENV, "1") != "0"  # read once: the process's environment decides
TILE_ROWS = 16  # the AVX2 kernel's tile height: rows past its last 16-row tile take slower 8-row tiles, then one
#                  element at a time (fewer than 8; SSE2's tiles are 8 rows high)


def whole_tiles(rows: int) -> int:
    """``rows`` rounded down to a multiple of :data:`TILE_ROWS` (where one tile remains): how many source rows a
    caller that transposes a matrix in chunks takes at a time, so that no chunk leaves rows to the kernel's element
    loop (Mixtral's chunks: 292 rows 0.197 CPU s/GB, 288 rows 0.143; ``benchmarks/transpose_floor.py``)."""
    return rows - rows % TILE_ROWS if rows >= TILE_ROWS else rows


def native_kernel() -> str | None:
    """The instruction set the kernel transposes 2-byte elements with (``"avx2"``, ``"sse2"``, ``"portable"``),
    or None where every transpose is torch's copy (not built, or ``CKPTCONV_NATIVE=0``)."""
    return str(_native.kernel()) if _ENABLED and _native is not None else None


def native_dtype(dtype: torch.dtype) -> bool:
    """Whether the native kernel is on and takes elements of ``dtype``: a caller that stages a transpose through a
    compact matrix only for torch's sake (torch is fast only into one) need not."""
    return _ENABLED and dtype in _DTYPES


def transpose_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src.t())``; returns ``dst``. The native kernel where :func:`native_transpose` takes the pair,
    torch's copy otherwise.

    >>> src = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    >>> transpose_into(torch.empty(3, 2, dtype=torch.bfloat16), src).tolist()
    [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
    """
    return dst if native_transpose(dst, src) else dst.copy_(src.t())


def native_transpose(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """``dst.copy_(src.t())`` by the native kernel, if it takes the pair: 2-D CPU matrices of one 2- or 4-byte dtype,
    each row of unit stride, ``dst`` of ``src.t()``'s shape, apart in memory. False (nothing done) otherwise: for a
    caller whose torch path first makes its operands compact (torch is fast only then)."""
    strides = _native_strides(dst, src) if _ENABLED else None
    if strides is None:
        return False
    assert _native is not None
    _native.transpose(src.data_ptr(), dst.data_ptr(), src.size(0), src.size(1), *strides, src.element_size())
    return True


def transposed(src: torch.Tensor) -> torch.Tensor:
    """``src.t().contiguous()``: a new matrix through :func:`transpose_into` (``src.t()`` itself where it is
    contiguous, as torch's; torch's for other than 2-D)."""
    flipped = src.t()
    if src.dim() != 2 or flipped.is_contiguous():
        return flipped.contiguous()
    return transpose_into(torch.empty(tuple(flipped.shape), dtype=src.dtype, device=src.device), src)


def native_takes(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether :func:`native_transpose` takes the pair by its layout alone (dtypes, shapes, row strides), which views
    on the ``meta`` device show as well: what a memory budget asks before any buffer exists. At run time the kernel
    also needs both on the CPU and apart in memory (two buffers of a band always are)."""
    return _ENABLED and _layout_strides(dst, src) is not None


def _native_strides(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int] | None:
    """The row strides (in elements) the kernel takes ``src`` and ``dst`` with, or None if it does not apply."""
    if src.device.type != "cpu" or dst.device.type != "cpu":
        return None
    strides = _layout_strides(dst, src)
    if strides is None or _overlap(dst, strides[1], src, strides[0]):  # overlapping rows: torch's copy decides
        return None
    return strides


def _layout_strides(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int] | None:
    """:func:`_native_strides` but for where the pair lies: what its dtypes, shapes and strides allow."""
    if (src.dim() != 2 or dst.dim() != 2 or src.dtype != dst.dtype or src.dtype not in _DTYPES
            or src.is_neg() or dst.is_neg() or src.requires_grad or dst.requires_grad
            or tuple(dst.shape) != (src.size(1), src.size(0)) or src.numel() == 0):
        return None
    rows, cols = src.shape
    # a dimension of size 1 may carry any stride: only the ones the kernel walks matter
    if (cols > 1 and src.stride(1) != 1) or (rows > 1 and dst.stride(1) != 1):
        return None
    ss = src.stride(0) if rows > 1 else cols
    ds = dst.stride(0) if cols > 1 else rows
    return (ss, ds) if ss >= cols and ds >= rows else None


def _overlap(dst: torch.Tensor, ds: int, src: torch.Tensor, ss: int) -> bool:
    """Whether the bytes the kernel would write meet the bytes it reads (two views of one buffer may be apart)."""
    size = src.element_size()
    lo_s, lo_d = src.data_ptr(), dst.data_ptr()
    hi_s = lo_s + ((src.size(0) - 1) * ss + src.size(1)) * size
    hi_d = lo_d + ((dst.size(0) - 1) * ds + dst.size(1)) * size
    return lo_s < hi_d and lo_d < hi_s


def main() -> None:
    """``python -m ckptconv.io.transpose``: which transpose this installation uses, and why."""
    if _ENABLED and _native is not None:
        print(f"native transpose: {native_kernel()} ({_native.__file__})")
    elif _native is not None:
        print(f"native transpose: built, off ({ENV}=0): torch's copy")
    else:
        print("native transpose: not built (no C compiler at install, or an install without build_ext): torch's copy")


if __name__ == "__main__":
    main()
