"""What verify measures (HF against NxD shards or a DCP): a check's errors and verdict, the default tolerance,
the layers sampled, and how a check is said."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ckptconv.errors import ConversionError

DEFAULT_TOL = 1e-4  # relative to the largest reference value; both sides compute in fp32
CAST_TOL = {torch.bfloat16: 3e-2, torch.float16: 3e-3}


@dataclass
class Check:
    name: str
    max_abs: float
    rel: float
    ranks: list[int] = field(default_factory=list)  # ranks whose own piece disagrees
    detail: str = ""

    def ok(self, tol: float) -> bool:
        return self.rel <= tol and not self.ranks


def compare(name: str, actual: torch.Tensor, expected: torch.Tensor) -> Check:
    if actual.shape != expected.shape:
        return Check(name, float("inf"), float("inf"), detail=f"shape {list(actual.shape)} vs {list(expected.shape)}")
    diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return Check(name, diff, diff / scale if scale else diff)


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> bool:
    check = compare("", actual, expected)
    return check.rel <= tol


def default_tol(hf: Any, ckpt: Any) -> float:
    hf_dtypes = set(hf.dtypes().values())
    shard_dtypes = set(ckpt.dtypes().values())
    if shard_dtypes <= hf_dtypes:
        return DEFAULT_TOL
    return max([CAST_TOL.get(d, DEFAULT_TOL) for d in shard_dtypes - hf_dtypes] + [DEFAULT_TOL])


def as_json(check: Check) -> dict[str, Any]:
    return {"max_abs": check.max_abs, "rel": check.rel, "ranks": check.ranks, "detail": check.detail}


def problem(where: str, check: Check, tol: float) -> str:
    text = f"{where}: max abs error {check.max_abs:.3g} (relative {check.rel:.3g}, tolerance {tol:g})"
    if check.detail:
        text += f"; {check.detail}"
    return text


def sample_layers(layers: int, which: int | str) -> list[int]:
    if which == "all" or (isinstance(which, int) and which >= layers):
        return list(range(layers))
    count = int(which)
    if count < 1:
        raise ConversionError(f"--layers must be 'all' or a positive count, got {which!r}")
    if count == 1:
        return [0]
    return sorted({round(i * (layers - 1) / (count - 1)) for i in range(count)})


def read_whole(reader: Any, key: str) -> torch.Tensor:
    """A tensor of an HF or DCP reader (``Source(None, key)``), whole, in fp32."""
    from ckptconv.core.plan import Source

    _, shape, _ = reader.info(Source(None, key))
    return reader.read_rows(Source(None, key), 0, shape[0] if shape else 1).reshape(shape).float()


def hf_layer(hf: Any, layer: int) -> dict[str, torch.Tensor]:
    """One HF layer's weights by their names without ``model.layers.N.`` (no ``inv_freq``), in fp32."""
    prefix = f"model.layers.{layer}."
    return {k[len(prefix):]: read_whole(hf, k) for k in hf.keys() if k.startswith(prefix) and not k.endswith("inv_freq")}
