"""ckptconv.io.transpose: the native kernel's transpose is byte for byte torch's ``src.t().contiguous()``, for every
kernel this machine has (AVX2, SSE2, the portable C tile built here) and for torch's own path; what the kernel does
not take goes to torch's copy; and where a C compiler exists the kernel was built (CI builds it in `make setup`)."""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from ckptconv.io import transpose as tr
from tests.conftest import meta_view

SOURCE = Path(tr.__file__).with_name("_transpose.c")
DTYPES = [torch.bfloat16, torch.float16, torch.int16, torch.float32, torch.int32]
# not multiples of 8 or 16 (tiles) or 128 and 256 (blocks), single rows and columns, more than one block each way
SHAPES = [(1, 1), (1, 37), (37, 1), (7, 9), (8, 8), (16, 24), (63, 65), (300, 77), (129, 1000), (1000, 129), (257, 130),
          (520, 600)]


def compiler() -> str | None:
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    return shutil.which(cc[0]) if cc else None


def bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaN payloads too: moved as bits, compared as bits), nearly all distinct."""
    g = torch.Generator().manual_seed(seed)
    ints = torch.int16 if dtype.itemsize == 2 else torch.int32
    info = torch.iinfo(ints)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(ints).view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = torch.int16 if a.element_size() == 2 else torch.int32
    return a.shape == b.shape and torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _portable_module(tmp: Path):  # type: ignore[no-untyped-def]
    """The kernel compiled with its plain C tile (what aarch64 runs), loaded from ``tmp``."""
    cc = compiler()
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp / f"_transpose{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-DCK_PORTABLE", f"-I{sysconfig.get_paths()['include']}",
                    str(SOURCE), "-o", str(out)], check=True, capture_output=True, timeout=120)
    spec = importlib.util.spec_from_file_location("_transpose", out)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.kernel() == "portable"
    return module


@pytest.fixture(scope="module")
def portable(tmp_path_factory):  # type: ignore[no-untyped-def]
    return _portable_module(tmp_path_factory.mktemp("portable"))


@pytest.fixture(params=["avx2", "sse2", "portable", "torch"])
def kernel(request, monkeypatch, portable):  # type: ignore[no-untyped-def]
    """Each way a transpose can run, set on the module for one test."""
    name = request.param
    if name == "torch":
        monkeypatch.setattr(tr, "_ENABLED", False)
        yield name
        return
    if tr._native is None:
        pytest.skip("the native kernel is not built (see test_the_kernel_is_built)")
    monkeypatch.setattr(tr, "_ENABLED", True)
    if name == "portable":
        monkeypatch.setattr(tr, "_native", portable)
        yield name
        return
    if tr._native.allow_avx2(name == "avx2") != name:
        pytest.skip(f"this CPU has no {name}")
    yield name
    tr._native.allow_avx2(True)


def test_the_kernel_is_built():
    """Where a C compiler exists, `make setup` (an editable install) built the kernel: its absence is a failed build,
    not a choice. Without a compiler the install still works, on torch's copy."""
    if compiler() is None:
        pytest.skip("no C compiler: torch's copy is the transpose")
    assert tr._native is not None, "ckptconv/io/_transpose.c is not built: run `make setup` (or build_ext --inplace)"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_transpose_into_is_torchs_transpose(kernel, dtype, shape):
    src = bits(shape, dtype)
    dst = torch.empty(shape[::-1], dtype=dtype)
    assert tr.native_transpose(torch.empty_like(dst), src) == (kernel != "torch")
    assert tr.transpose_into(dst, src) is dst
    assert same_bits(dst, src.t().contiguous())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1, 37), (37, 1), (63, 65), (300, 77)], ids=str)
def test_strided_rows_and_offsets_each_way(kernel, dtype, shape):
    """A view at an offset with rows further apart than their width, into a column slice of a larger matrix (the
    engine's chunks into columns of an expert's slab): only the slice's bytes change."""
    rows, cols = shape
    big_src = bits((rows + 5, cols + 11), dtype, seed=1)
    src = big_src[3:3 + rows, 4:4 + cols]
    big_dst = bits((cols + 2, rows + 9), dtype, seed=2)
    before = big_dst.clone()
    dst = big_dst[1:1 + cols, 6:6 + rows]
    tr.transpose_into(dst, src)
    assert same_bits(dst, src.t())
    dst.copy_(before[1:1 + cols, 6:6 + rows])
    assert same_bits(big_dst, before)  # nothing outside the slice was written


@pytest.mark.parametrize("make", [
    lambda: (torch.empty(5, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)),  # 8-byte elements
    lambda: (torch.empty(5, 3, dtype=torch.int8), torch.randint(0, 9, (3, 5), dtype=torch.int8)),  # 1-byte
    lambda: (torch.empty(5, 3, dtype=torch.bfloat16), torch.randn(5, 3).to(torch.bfloat16).t()),  # columns of src
    lambda: (torch.empty(3, 5, dtype=torch.bfloat16).t(), torch.randn(3, 5).to(torch.bfloat16)),  # columns of dst
    lambda: (torch.empty(5, 3, dtype=torch.float32), torch.randn(3, 5).to(torch.bfloat16)),  # a cast
    lambda: (torch.empty(5, 3, dtype=torch.bfloat16), torch.randn(3, 10).to(torch.bfloat16)[:, ::2]),  # a step
    lambda: (torch.empty(4, 0, dtype=torch.bfloat16), torch.empty(0, 4, dtype=torch.bfloat16)),  # empty
], ids=["float64", "int8", "src-columns", "dst-columns", "cast", "stepped", "empty"])
def test_what_the_kernel_does_not_take_is_torchs_copy(make):
    dst, src = make()
    assert not tr.native_transpose(dst, src)
    assert not tr.native_takes(meta_view(dst), meta_view(src))  # what a budget sees of the pair says the same
    expected = torch.empty_like(dst).copy_(src.t())
    assert torch.equal(tr.transpose_into(dst, src), expected)


@pytest.mark.parametrize("make", [
    lambda: (torch.empty(5, 3, dtype=torch.bfloat16), torch.randn(3, 5).to(torch.bfloat16)),
    lambda: (torch.empty(5, 8, dtype=torch.float32)[:, 2:5], torch.randn(3, 9)[:, 4:9]),  # rows any distance apart
    lambda: (torch.empty(1, 7, dtype=torch.int16).t(), torch.ones(1, 7, dtype=torch.int16)),  # a row: any stride
], ids=["plain", "column-slices", "one-row"])
def test_what_the_kernel_takes_is_told_by_the_layout_alone(make):
    """native_takes on meta views answers as native_transpose does on the CPU (when the kernel is on)."""
    dst, src = make()
    assert tr.native_takes(meta_view(dst), meta_view(src)) == tr._ENABLED
    expected = torch.empty_like(dst).copy_(src.t())
    assert tr.native_transpose(dst, src) == tr._ENABLED
    if tr._ENABLED:
        assert same_bits(dst, expected)


def test_overlapping_views_are_left_to_torch():
    """Two views of one buffer: apart, the kernel takes them (the engine's gather buffer holds both); meeting, not."""
    buffer = bits((64,), torch.bfloat16)
    src, dst = buffer[:32].view(4, 8), buffer[32:].view(8, 4)
    assert tr.native_transpose(dst, src) == tr._ENABLED  # off: CKPTCONV_NATIVE=0, or not built
    assert same_bits(tr.transpose_into(dst, src), src.t())
    assert not tr.native_transpose(buffer[20:52].view(8, 4), buffer[:32].view(4, 8))


def test_transposed_is_torchs_contiguous_transpose(kernel):
    src = bits((65, 130), torch.bfloat16)
    assert same_bits(tr.transposed(src), src.t().contiguous())
    column_major = src.t().contiguous().t()
    assert tr.transposed(column_major).data_ptr() == column_major.data_ptr()  # already its transpose's rows: a view
    three = bits((2, 3, 4), torch.float32)
    assert same_bits(tr.transposed(three[0]), three[0].t().contiguous())


def test_the_environment_turns_the_kernel_off():
    env = {**os.environ, "PYTHONPATH": str(Path(tr.__file__).parents[2])}
    run = [sys.executable, "-m", "ckptconv.io.transpose"]
    off = subprocess.run(run, env={**env, tr.ENV: "0"}, capture_output=True, text=True, timeout=120, check=True)
    assert off.stdout.startswith("native transpose: built, off" if tr._native else "native transpose: not built")
    on = subprocess.run(run, env={k: v for k, v in env.items() if k != tr.ENV}, capture_output=True, text=True,
                        timeout=120, check=True)
    if tr._native is not None:
        assert on.stdout.startswith(f"native transpose: {tr._native.kernel()} (")
