"""ckptconv.io.mxfp4's decode, bit for bit, through the native transpose and through torch's copy
(``CKPTCONV_NATIVE=0``), against a reference written here from the MX format's definition (sign, 2-bit exponent of
bias 1, 1-bit mantissa, times 2^(scale - 127)) in float64, not from the module's tables. The GPT-OSS conversions
that use it are tests/test_gpt_oss.py's (against transformers' own dequantization)."""

from __future__ import annotations

import pytest
import torch

from ckptconv.io import mxfp4
from ckptconv.io import transpose as tr


def reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The bf16 ``[..., 32 G, R]`` that ``blocks`` ``[..., R, G, 16]`` and ``scales`` ``[..., R, G]`` encode."""
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2).long()  # the low nibble first
    sign = torch.where(codes >= 8, -1.0, 1.0).double()
    exponent, mantissa = ((codes >> 1) & 3).double(), (codes & 1).double()
    magnitude = torch.where(exponent == 0, mantissa / 2, (1 + mantissa / 2) * torch.pow(2.0, exponent - 1))
    values = sign * magnitude * torch.pow(2.0, scales.double() - 127).unsqueeze(-1)
    return values.flatten(-2).transpose(-1, -2).to(torch.bfloat16).contiguous()


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


@pytest.fixture(params=["kernel", "torch"])
def lane(request, monkeypatch):  # type: ignore[no-untyped-def]
    """The native kernel (its calls counted), or torch's copy as CKPTCONV_NATIVE=0 sets it."""
    calls: list[int] = []
    if request.param == "torch":
        monkeypatch.setattr(tr, "_ENABLED", False)
        return calls
    if tr._native is None:
        pytest.skip("the native kernel is not built (tests/io/test_transpose.py says why)")
    monkeypatch.setattr(tr, "_ENABLED", True)
    transpose = tr._native.transpose

    def counted(*args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return transpose(*args)

    monkeypatch.setattr(tr._native, "transpose", counted)
    return calls


# rows past two steps and not a multiple of one, 32 G != R; one and two leading dims; the doctest's single block
SHAPES = [(3, 2 * mxfp4.ROWS_PER_STEP + 37, 3), (2, 2, 70, 5), (1, 1, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_is_the_formats_values_transposed(lane, shape):
    *lead, rows, groups = shape
    g = torch.Generator().manual_seed(rows)
    blocks = torch.randint(0, 256, (*shape, mxfp4.BLOCK_BYTES), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, mxfp4.NAN_SCALE, tuple(shape), generator=g, dtype=torch.uint8)  # 254: overflows to inf
    extremes = torch.tensor([0, 1, 254], dtype=torch.uint8)[:scales.numel()]  # the smallest (bf16 subnormals), largest
    scales.view(-1)[:len(extremes)] = extremes
    out = mxfp4.decode(blocks, scales)
    want = reference(blocks, scales)
    assert out.dtype == torch.bfloat16 and out.shape == want.shape == (*lead, 32 * groups, rows)
    assert torch.equal(bits(out), bits(want))
    steps = -(-rows // mxfp4.ROWS_PER_STEP)
    if tr._ENABLED:  # each step of each leading index's matrix went through the kernel
        assert len(lane) == steps * torch.Size(lead).numel()
    else:
        assert lane == []
