"""``ckptconv diff A B``: two checkpoints of one model, in any formats, compared tensor by tensor under HF names.

Each side is read through the plan its converter uses to write HF (:func:`ckptconv.core.plan.plan_to_hf` for NxD
shards and tags, :func:`ckptconv.titan.plans.plan_dcp_to_hf` for DCP, the identity for HF), so the comparison
sees what ``to-hf`` of either side would write, without writing it. A training state's AdamW tensors are named
``state.<hf key>.<component>`` on both sides (a tag's read like its weight, a DCP's through TorchTitan's table
backwards). Tensors are compared in row bands of at most ``max_memory`` (both sides' bands, in float64), on
``workers`` threads at once, each within its share of ``max_memory``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptconv.core.plan import OutTensor, compose
from ckptconv.engine.columns import column_band
from ckptconv.engine.execute import read_tensor, row_band
from ckptconv.engine.options import default_workers
from ckptconv.engine.progress import byte_progress
from ckptconv.errors import ConversionError


@dataclass
class Side:
    """One checkpoint seen under HF names: its tensors (weights, then AdamW state) and the reader they read from."""

    path: str
    kind: str  # hf | nxd | dcp
    reader: Any
    tensors: dict[str, OutTensor]
    notes: list[str] = field(default_factory=list)


def open_side(path: str | Path, stack: contextlib.ExitStack, *, config: str | Path | None, io: str,
              check: bool) -> Side:
    """``path`` as a :class:`Side` (a DCP directory or TorchTitan root, NxD shards or a tag, or an HF folder);
    what it opens is closed by ``stack``."""
    path = Path(path)
    if not path.exists():
        raise ConversionError(f"{path}: no such file or directory")
    from ckptconv.commands.inspect_dcp import is_dcp

    if is_dcp(path):
        return _dcp_side(path, stack, config, io, check)
    try:
        return _nxd_side(path, stack, config, io, check)
    except ConversionError as nxd_error:
        try:
            return _hf_side(path, stack, config, io)
        except ConversionError as hf_error:
            raise ConversionError(f"{path}: neither DCP, NxD ({nxd_error}) nor HF ({hf_error})") from None


def _hf_side(path: Path, stack: contextlib.ExitStack, config: str | Path | None, io: str) -> Side:
    from ckptconv.core.plan import Piece, Source
    from ckptconv.io.hf import HfCheckpoint

    hf = stack.enter_context(HfCheckpoint(path, config=config, io=io))
    tensors = {key: OutTensor(key, dtype, shape, 0, (Piece(Source(None, key), 0, shape[0] if shape else 1),))
               for key, dtype in hf.dtypes().items() for shape in [hf.shapes()[key]]}
    return Side(str(path), "hf", hf, tensors)


def _nxd_side(path: Path, stack: contextlib.ExitStack, config: str | Path | None, io: str, check: bool) -> Side:
    from ckptconv.core.plan import plan_to_hf
    from ckptconv.sources.nxd import open_nxd
    from ckptconv.titan.export import open_training
    from ckptconv.training.nxdtrain_format.state import TagReader, state_tensors

    opened = open_nxd(path, config=config, io=io, check=check, masters=False)
    ckpt = stack.enter_context(opened.ckpt)
    plan = plan_to_hf(opened.spec, opened.layout, ckpt.dtypes())
    weights = {t.key: t for f in plan.files for t in f.tensors}
    training = open_training(ckpt, opened.spec, opened.layout, io=io)
    if training is None:
        return Side(str(path), "nxd", ckpt, weights, list(opened.notes))
    stack.enter_context(training)
    state = {}
    for weight in weights.values():
        with contextlib.suppress(KeyError, ConversionError):  # an untrained tensor (inv_freq) has no state
            state.update({t.key: t for t in state_tensors(weight, training.optim).values()})
    return Side(str(path), "nxd", TagReader(ckpt, training.optim), {**weights, **state}, list(opened.notes))


def _dcp_side(path: Path, stack: contextlib.ExitStack, config: str | Path | None, io: str, check: bool) -> Side:
    from ckptconv.commands.dcp import open_dcp
    from ckptconv.titan.names import OPTIMIZER_STATE_FIELDS, trained_params
    from ckptconv.titan.plans import plan_dcp_to_hf, titan_tiles
    from ckptconv.training.nxdtrain_format.state import state_key

    ckpt, spec, notes = open_dcp(path, config=config, io=io, check=check,
                                 carried=("optimizer", "lr_scheduler", "train_state"), left_as="not compared")
    stack.enter_context(ckpt)
    plan = plan_dcp_to_hf(spec, ckpt.dtypes())
    weights = {t.key: t for f in plan.files for t in f.tensors}
    dtypes = ckpt.dtypes()
    state: dict[str, OutTensor] = {}
    if any(k.startswith("optimizer.state.") for k in dtypes):
        from ckptconv.core.plan import Piece, Source
        from ckptconv.titan.plans import whole_hf_plan

        whole = {t.key: t for f in whole_hf_plan(spec, {k: t.dtype for k, t in weights.items()}, 2**62,
                                                 lambda _k, d: d).files for t in f.tensors}
        for component in OPTIMIZER_STATE_FIELDS[1:]:
            tiles = titan_tiles(trained_params(spec), spec, source_of=_optimizer_source(component))
            for key, tensor in whole.items():
                if key not in tiles:
                    continue
                moment = compose(tensor, tiles)
                dtype = dtypes[moment.pieces[0].source.key]
                state[state_key(key, component)] = OutTensor(state_key(key, component), dtype, moment.shape,
                                                             moment.dim, moment.pieces, slabs=moment.slabs,
                                                             transposed=moment.transposed)
                if component == "exp_avg":  # the parameter's step, one per parameter
                    step = moment.pieces[0].source.key[:-len("exp_avg")] + "step"
                    state[state_key(key, "step")] = OutTensor(state_key(key, "step"), dtypes[step], (), 0,
                                                              (Piece(Source(None, step), 0, 1),))
    return Side(str(path), "dcp", ckpt, {**weights, **state}, notes)


def _optimizer_source(component: str) -> Callable[[str], Any]:
    """Where TorchTitan keeps ``component`` of the parameter ``key`` (its table read backwards onto the moments)."""
    from ckptconv.core.plan import Source
    from ckptconv.titan.names import optimizer_key

    return lambda key: Source(None, optimizer_key(key, component))


# --------------------------------------------------------------------------------------------
# Comparing


@dataclass
class TensorDiff:
    key: str
    status: str  # equal | close | differ | shape | missing (only in B) | extra (only in A)
    max_abs: float = 0.0
    max_rel: float = 0.0
    dtypes: tuple[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "status": self.status}
        if self.status in ("equal", "close", "differ"):
            out.update(max_abs=self.max_abs, max_rel=self.max_rel)
        if self.dtypes is not None:
            out["dtypes"] = list(self.dtypes)
        return out


def _rows(tensor: OutTensor, reader: Any, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of the planned tensor, as the executor builds them, in fresh memory of the stored dtype."""
    if not tensor.shape:
        return row_band(tensor, 0, 0, reader).clone()
    if tensor.by_slab:
        return read_tensor(tensor, reader)[start:stop]
    band = column_band(tensor, start, stop, reader, {}) if tensor.dim else row_band(tensor, start, stop, reader)
    return band.clone()  # a copy: the next read may reuse the executor's buffers


def _period(tensor: OutTensor) -> int:
    return math.lcm(1, *(len(p.row_perm) for p in tensor.pieces if p.row_perm))


def _band_rows(a: OutTensor, b: OutTensor, max_memory: int) -> int:
    rows = a.shape[0] if a.shape else 1
    if a.by_slab or b.by_slab or not a.shape:
        return rows
    per_row = max(1, math.prod(a.shape[1:])) * (8 * 3 + a.dtype.itemsize + b.dtype.itemsize)
    period = math.lcm(_period(a), _period(b))
    n = max(1, max_memory // per_row)
    return max(period, n - n % period)


def compare_tensor(a: OutTensor, ra: Any, b: OutTensor, rb: Any, *, atol: float, rtol: float,
                   max_memory: int) -> TensorDiff:
    """One tensor of both sides, band by band: exact, within ``atol + rtol * |b|``, or not."""
    dtypes = (str(a.dtype).removeprefix("torch."), str(b.dtype).removeprefix("torch."))
    if tuple(a.shape) != tuple(b.shape):
        return TensorDiff(a.key, "shape", dtypes=dtypes)
    rows = a.shape[0] if a.shape else 1
    step = _band_rows(a, b, max_memory)
    max_abs = max_rel = 0.0
    within = exact = True
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        x, y = _rows(a, ra, lo, hi), _rows(b, rb, lo, hi)
        if x.dtype == y.dtype and torch.equal(x, y):  # the common case, without widening
            continue
        x, y = x.to(torch.float64), y.to(torch.float64)
        same = (x == y) | (x.isnan() & y.isnan())
        if bool(same.all()):
            continue
        exact = False
        delta = (x - y).abs().masked_fill_(same, 0.0)
        scale = torch.maximum(x.abs(), y.abs())
        max_abs = max(max_abs, float(delta.max()))
        max_rel = max(max_rel, float(torch.where(scale > 0, delta / scale, delta).max()))
        within = within and bool((delta <= atol + rtol * y.abs()).all())
    status = "equal" if exact else "close" if within else "differ"
    return TensorDiff(a.key, status, max_abs, max_rel, dtypes)


def diff(
    a: str | Path,
    b: str | Path,
    *,
    config: str | Path | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
    max_memory: int = 2 << 30,
    io: str = "read",
    check: bool = True,
    progress: bool = False,
    workers: int | None = None,
) -> dict[str, Any]:
    """Compare two checkpoints of the same model in any formats (HF, NxD shards or tags, DCP) under HF names.

    Every tensor of either side is ``equal`` (bitwise as values), ``close`` (within ``atol + rtol * |b|``),
    ``differ``, ``shape`` (shapes differ), ``extra`` (only in A) or ``missing`` (only in B); AdamW state
    (``state.<hf key>.{exp_avg,exp_avg_sq,step}``) is compared where both sides have it, and only said to be
    one-sided otherwise. ``ok`` is True when nothing differs, is missing or extra. ``workers``: tensors compared at
    once (default :func:`ckptconv.engine.options.default_workers`), each in bands of its share of ``max_memory``.

    Example:
        >>> diff("llama-hf", "llama-dcp")["ok"]     # doctest: +SKIP
        True
    """
    with contextlib.ExitStack() as stack:
        sa = open_side(a, stack, config=config, io=io, check=check)
        sb = open_side(b, stack, config=config, io=io, check=check)
        keys = [*sa.tensors, *(k for k in sb.tensors if k not in sa.tensors)]
        with byte_progress(f"diff {Path(a).name} {Path(b).name}", len(keys), quiet=not progress, of="tensors") as advance:
            results = _compare(sa, sb, keys, atol=atol, rtol=rtol, max_memory=max_memory,
                               workers=default_workers() if workers is None else workers, advance=advance)
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    state_only = [r for r in results if r.status in ("extra", "missing") and r.key.startswith("state.")]
    bad = [r for r in results if r.status in ("differ", "shape", "extra", "missing") and r not in state_only]
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    return {
        "a": {"path": sa.path, "kind": sa.kind}, "b": {"path": sb.path, "kind": sb.kind},
        "ok": not bad, "counts": counts, "atol": atol, "rtol": rtol,
        "summary": f"{len(results)} tensors: {summary}" + ("" if bad else " (same model)" if not state_only else
                                                            " (same weights; optimizer state on one side only)"),
        "problems": [_problem(r) for r in bad],
        "tensors": [r.to_json() for r in results],
        "notes": [*sa.notes, *sb.notes],
    }


def _compare(sa: Side, sb: Side, keys: list[str], *, atol: float, rtol: float, max_memory: int, workers: int,
             advance: Callable[[int], None]) -> list[TensorDiff]:
    """Every key's :class:`TensorDiff`, in ``keys``' order; ``workers`` tensors at once (the readers are read from
    several threads as the executor reads them), each in bands of its share of ``max_memory``."""
    if workers < 1:
        raise ConversionError(f"--workers {workers}: the tensors compared at once, a number >= 1")
    share = max_memory // (2 * workers)

    def one(key: str) -> TensorDiff:
        if key not in sb.tensors:
            return TensorDiff(key, "extra")
        if key not in sa.tensors:
            return TensorDiff(key, "missing")
        return compare_tensor(sa.tensors[key], sa.reader, sb.tensors[key], sb.reader, atol=atol, rtol=rtol,
                              max_memory=share)

    results = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for result in pool.map(one, keys):
            results.append(result)
            advance(1)
    return results


def _problem(r: TensorDiff) -> str:
    if r.status == "extra":
        return f"{r.key}: only in A"
    if r.status == "missing":
        return f"{r.key}: only in B"
    if r.status == "shape":
        return f"{r.key}: shapes differ"
    return f"{r.key}: max abs difference {r.max_abs:.3g}, max relative {r.max_rel:.3g}"
