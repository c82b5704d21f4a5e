"""ckptconv.io.torchzip against torch.save / torch.load themselves (torch 2.13)."""

from __future__ import annotations

import glob
import hashlib
import json
import multiprocessing
import os
import random
import string
import sys
import zlib
from collections import OrderedDict
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptconv.io import torchzip_read
from ckptconv.io.safe_load import TENSOR_REFERENCE_IS_STAND_IN, TensorReference, load_small
from ckptconv.io.torchzip import (
    StoredTensor,
    TensorAt,
    TensorMeta,
    TorchZipReader,
    TorchZipWriter,
    archive_name_for,
    crc32_combine,
    plan_zip,
    pwrite_extent,
    save_state_dict,
)
from tests.conftest import GOLDEN, fixture_cases

IO_MODES = ("mmap", "read")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.uint16, torch.uint32, torch.uint64]


def raw(t: torch.Tensor) -> torch.Tensor:
    """Byte view, so NaN payloads and fp8 (no torch.equal kernel) compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def rand_tensor(rng: random.Random, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bytes in a random dim order: owns exactly its storage, stride is a permutation."""
    perm = list(range(len(shape)))
    rng.shuffle(perm)
    numel = 1
    for s in shape:
        numel *= s
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    data = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        data = data % 2
    base = data.view(dtype).reshape([shape[p] for p in perm])
    return base.permute([perm.index(i) for i in range(len(shape))])


def rand_shape(rng: random.Random) -> tuple[int, ...]:
    ndim = rng.choice([0, 1, 1, 2, 2, 2, 3, 4])
    return tuple(rng.choice([0, 1, 1, 2, 3, 5, 8]) if rng.random() < 0.1 else rng.randint(1, 9) for _ in range(ndim))


def rand_plain(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 2 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([0, 1, -7, 255, 2**40, -(2**70), True, False])
    if kind == 2:
        return rng.random() * 1e3
    if kind == 3:
        return rng.choice(["cpu", "storage", "", "x" * rng.randint(1, 300), "ünï", "0"])
    if kind == 4:
        return rng.choice([torch.bfloat16, torch.float32])
    if kind == 5:
        return [rand_plain(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == 6:
        return tuple(rand_plain(rng, depth + 1) for _ in range(rng.randint(0, 4)))
    return {f"m{i}": rand_plain(rng, depth + 1) for i in range(rng.randint(0, 3))}


def rand_key(rng: random.Random, i: int) -> str:
    alphabet = string.ascii_letters + string.digits + "._-/ü"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) + f"#{i}"


def rand_basename(rng: random.Random) -> str:
    stem = "".join(rng.choice(string.ascii_lowercase + string.digits + "_-.") for _ in range(rng.randint(1, 40)))
    stem = "a" + stem.strip(".")  # torch.save refuses an empty archive name
    return stem + rng.choice([".pt", ".bin", ".tmp", "", ".pt.partial"])


def rand_state_dict(rng: random.Random, n_tensors: int, plain_prob: float = 0.15) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for i in range(n_tensors):
        if rng.random() < plain_prob:
            sd[rand_key(rng, 1000 + i)] = rand_plain(rng)
        sd[rand_key(rng, i)] = rand_tensor(rng, rng.choice(DTYPES), rand_shape(rng))
    return sd


def torch_bytes(tmp: Path, name: str, obj: Any) -> bytes:
    path = tmp / "ref" / name
    path.parent.mkdir(exist_ok=True)
    torch.save(obj, path)
    return path.read_bytes()


def ours_path(tmp: Path, name: str) -> Path:
    (tmp / "ours").mkdir(exist_ok=True)
    return tmp / "ours" / name


def first_diff(a: bytes, b: bytes) -> str:
    i = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
    return f"sizes {len(a)} vs {len(b)}, first difference at byte {i}: {a[i:i + 16].hex()} vs {b[i:i + 16].hex()}"


# ----------------------------------------------------------------------------- CRC


def test_crc32_combine_matches_zlib() -> None:
    rng = random.Random(1)
    for _ in range(300):
        a = rng.randbytes(rng.choice([0, 1, 3, 64, rng.randint(0, 5000)]))
        b = rng.randbytes(rng.choice([0, 1, 7, 4096, rng.randint(0, 5000)]))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_crc32_combine_huge_lengths() -> None:
    # Zeros have known CRCs at any length: check against chained zlib for lengths past 4 GiB.
    chunk = bytes(1 << 20)
    crc_chunk = zlib.crc32(chunk)
    crc = zlib.crc32(b"head")
    for _ in range(5000):  # 5000 MiB, beyond 2**32 bytes
        crc = crc32_combine(crc, crc_chunk, len(chunk))
    ref = zlib.crc32(b"head")
    for _ in range(5000):
        ref = zlib.crc32(chunk, ref)
    assert crc == ref
    with pytest.raises(ValueError, match="len2"):
        crc32_combine(0, 0, -1)


# ----------------------------------------------------------------------------- names / layout


@pytest.mark.parametrize("name", ["model.pt", "a.b.pt", "noext", "x..pt", "a-b c.pt.tmp", "ünï.pt", "d.x/f.pt",
                                  "dir/sub\\back.pt"])
def test_archive_name_matches_torch(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"a": torch.zeros(1)}, path)
    with TorchZipReader(path) as r:
        assert archive_name_for(path) == r.archive
    assert archive_name_for(str(path)) == r.archive


def test_non_ascii_file_name(tmp_path: Path) -> None:
    """torch writes non-ASCII paths through a Python stream, with the generic archive name."""
    sd = {"w": torch.arange(6.0).reshape(2, 3)}
    save_state_dict(ours_path(tmp_path, "ünï_模型.pt"), sd)
    assert ours_path(tmp_path, "ünï_模型.pt").read_bytes() == torch_bytes(tmp_path, "ünï_模型.pt", sd)


def test_archive_name_empty_is_refused() -> None:
    with pytest.raises(ValueError, match="empty archive name"):
        archive_name_for("/x/.pt")


def test_layout_is_pure_and_aligned() -> None:
    metas = {f"k{i}": TensorMeta.contiguous(torch.bfloat16, (i + 1, 3)) for i in range(5)}
    a, b = plan_zip("/some/dir/shard.pt", metas), plan_zip("shard.bin", metas)
    assert a == b and a.archive == "shard" and a.keys == tuple(metas)
    assert all(off % 64 == 0 for off in a.data_offset.values())
    assert a.nbytes == {k: m.nbytes for k, m in metas.items()}
    assert a.file_size > max(a.data_offset[k] + a.nbytes[k] for k in a.keys)


def test_tensor_meta() -> None:
    t = torch.zeros(4, 6).t().contiguous().t()
    m = TensorMeta.of(t)
    assert (m.shape, m.stride, m.nbytes) == ((4, 6), (1, 4), 96)
    assert TensorMeta.contiguous(torch.int8, [2, 0, 3]).stride == (3, 3, 1)
    assert TensorMeta(torch.float32, [2, 3], torch.Size([3, 1])).shape == (2, 3)
    with pytest.raises(ValueError, match="not a dense layout"):
        TensorMeta(torch.float32, (4, 6), (6, 2))
    with pytest.raises(ValueError, match="not a dense layout"):
        TensorMeta.of(torch.zeros(3).expand(2, 3))
    with pytest.raises(ValueError, match="unsupported dtype"):
        TensorMeta(torch.qint8, (1,), (1,))


# ----------------------------------------------------------------------------- byte equality


def test_random_dicts_byte_identical_to_torch_save(tmp_path: Path) -> None:
    rng = random.Random(2024)
    for case in range(250):
        sd = rand_state_dict(rng, rng.randint(0, 10))
        name = rand_basename(rng)
        ref = torch_bytes(tmp_path, name, sd)
        save_state_dict(ours_path(tmp_path, name), sd)
        ours = ours_path(tmp_path, name).read_bytes()
        assert ours == ref, f"case {case} ({name}): {first_diff(ours, ref)}"


@pytest.mark.parametrize("n", list(range(1, 61)))
def test_storage_counts(tmp_path: Path, n: int) -> None:
    """serialization_id's name hash changes with the number of storages."""
    rng = random.Random(n)
    sd = {f"layer.{i}.w": rand_tensor(rng, rng.choice(DTYPES[:10]), (rng.randint(1, 4), 3)) for i in range(n)}
    name = f"dp_rank_00_tp_rank_{n:02d}_pp_rank_00.pt"
    save_state_dict(ours_path(tmp_path, name), sd)
    assert ours_path(tmp_path, name).read_bytes() == torch_bytes(tmp_path, name, sd)


def test_basename_lengths_change_padding(tmp_path: Path) -> None:
    sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4).t().contiguous().t(), "b": torch.ones(3)}
    for length in range(1, 70):
        name = "n" * length + ".pt"
        save_state_dict(ours_path(tmp_path, name), sd)
        assert ours_path(tmp_path, name).read_bytes() == torch_bytes(tmp_path, name, sd), name


def test_one_meta_object_shared_by_many_keys(tmp_path: Path) -> None:
    """Pickle memoizes by identity: a reused TensorMeta must still give fresh size/stride tuples."""
    meta, scalar = TensorMeta.contiguous(torch.bfloat16, (4, 3)), TensorMeta(torch.float32, (), ())
    metas = {"a": meta, "b": meta, "s1": scalar, "s2": scalar, "c": meta}
    sd = {k: torch.zeros(m.shape, dtype=m.dtype) for k, m in metas.items()}
    layout = plan_zip("shared.pt", metas)
    with TorchZipWriter(ours_path(tmp_path, "shared.pt"), layout) as w:
        for key, t in sd.items():
            w.write_tensor(key, t)
    assert ours_path(tmp_path, "shared.pt").read_bytes() == torch_bytes(tmp_path, "shared.pt", sd)


def test_ordered_dict_state_dict_with_metadata(tmp_path: Path) -> None:
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    sd = module.state_dict()
    clone = OrderedDict((k, v.detach().clone()) for k, v in sd.items())
    clone._metadata = sd._metadata  # type: ignore[attr-defined]
    save_state_dict(ours_path(tmp_path, "m.pt"), clone)
    assert ours_path(tmp_path, "m.pt").read_bytes() == torch_bytes(tmp_path, "m.pt", clone)


def test_bare_tensor_file(tmp_path: Path) -> None:
    t = rand_tensor(random.Random(5), torch.bfloat16, (6, 4))
    layout = plan_zip(ours_path(tmp_path, "tensor_3.pt"), TensorMeta.of(t))
    assert layout.keys == ("",)
    with TorchZipWriter(ours_path(tmp_path, "tensor_3.pt"), layout) as w:
        w.write_tensor("", t)
    assert ours_path(tmp_path, "tensor_3.pt").read_bytes() == torch_bytes(tmp_path, "tensor_3.pt", t)
    with TorchZipReader(ours_path(tmp_path, "tensor_3.pt")) as r:
        assert r.keys() == [""]
        assert torch.equal(r.read_rows("", 1, 3), t[1:3])
    scalar = torch.tensor(2.5)
    save_state_dict(ours_path(tmp_path, "s.pt"), scalar)
    assert ours_path(tmp_path, "s.pt").read_bytes() == torch_bytes(tmp_path, "s.pt", scalar)
    with TorchZipReader(ours_path(tmp_path, "s.pt")) as r:
        assert r.read_rows("", 0, 1).reshape(()).item() == 2.5


def test_tensor_reference_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An xser refs file pickles like torch_xla's own TensorReference (a plain class with ``tid``)."""
    if not TENSOR_REFERENCE_IS_STAND_IN:
        pytest.skip("real torch_xla installed")
    import types

    class RealLike:  # what torch_xla.utils.serialization.TensorReference is
        def __init__(self, tid: int) -> None:
            self.tid = tid

    RealLike.__module__, RealLike.__qualname__ = "torch_xla.utils.serialization", "TensorReference"
    fake = types.ModuleType("torch_xla.utils.serialization")
    fake.TensorReference = RealLike  # type: ignore[attr-defined]
    rng = random.Random(3)
    for case in range(20):
        # Refs mixed with tensors and plain values: our pure-Python pickling path must match too.
        plain = rand_state_dict(rng, rng.randint(0, 4), plain_prob=0.5)
        tids = [rng.randrange(1000) for _ in range(rng.randint(1, 6))]
        with monkeypatch.context() as m:
            for name in ("torch_xla", "torch_xla.utils", "torch_xla.utils.serialization"):
                m.setitem(sys.modules, name, fake)  # the C pickler imports the parents too
            real = {**plain, **{f"r{i}.weight": RealLike(t) for i, t in enumerate(tids)}, "nested": [RealLike(7)]}
            ref = torch_bytes(tmp_path, "refs.pt", real)
        ours = {**plain, **{f"r{i}.weight": TensorReference(t) for i, t in enumerate(tids)},
                "nested": [TensorReference(7)]}
        save_state_dict(ours_path(tmp_path, "refs.pt"), ours)
        assert "torch_xla" not in sys.modules and "torch_xla.utils.serialization" not in sys.modules
        assert ours_path(tmp_path, "refs.pt").read_bytes() == ref, f"case {case}"
    loaded = load_small(ours_path(tmp_path, "refs.pt"))
    assert [loaded[f"r{i}.weight"] for i in range(len(tids))] == [TensorReference(t) for t in tids]
    with TorchZipReader(ours_path(tmp_path, "refs.pt")) as r:
        assert r.entry("r0.weight").tid == tids[0]


# ----------------------------------------------------------------------------- extents


def _plan(tmp_path: Path, sd: dict[str, Any], name: str) -> tuple[Any, Path]:
    metas = {k: TensorMeta.of(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    return plan_zip(name, metas), ours_path(tmp_path, name)


def _pieces(rng: random.Random, nbytes: int) -> list[tuple[int, int]]:
    cuts = sorted({0, nbytes, *(rng.randint(0, nbytes) for _ in range(rng.randint(0, 5)))})
    return list(pairwise(cuts))


def _storage_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.untyped_storage())


def test_extents_in_random_order_and_pieces(tmp_path: Path) -> None:
    rng = random.Random(7)
    for case in range(40):
        sd = rand_state_dict(rng, rng.randint(1, 8))
        name = f"shard_{case}.pt"
        layout, path = _plan(tmp_path, sd, name)
        jobs = [(k, lo, hi) for k in layout.keys for lo, hi in _pieces(rng, layout.nbytes[k])]
        rng.shuffle(jobs)
        with TorchZipWriter(path, layout) as w:
            fd = os.open(path, os.O_WRONLY)  # a second writer, as another process would have
            for key, lo, hi in jobs:
                data = _storage_bytes(sd[key])[lo:hi]
                if rng.random() < 0.3:
                    w.add_extent_crc(key, lo, hi - lo, pwrite_extent(fd, layout, key, lo, data))
                elif rng.random() < 0.5:
                    w.write_extent(key, lo, torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else b"")
                else:
                    w.write_extent(key, lo, memoryview(data))
            os.close(fd)
        assert path.read_bytes() == torch_bytes(tmp_path, name, sd), f"case {case}"


def _child_write(path: str, layout: Any, key: str, lo: int, data: bytes) -> int:
    fd = os.open(path, os.O_WRONLY)
    try:
        return pwrite_extent(fd, layout, key, lo, data)
    finally:
        os.close(fd)


def test_extents_from_other_processes(tmp_path: Path) -> None:
    rng = random.Random(11)
    sd = {f"w{i}": rand_tensor(rng, torch.bfloat16, (64, 33)) for i in range(4)}
    layout, path = _plan(tmp_path, sd, "mp.pt")
    jobs = [(k, lo, hi) for k in layout.keys for lo, hi in _pieces(rng, layout.nbytes[k])]
    with TorchZipWriter(path, layout) as w, multiprocessing.get_context("fork").Pool(2) as pool:
        results = [pool.apply_async(_child_write, (str(path), layout, k, lo, _storage_bytes(sd[k])[lo:hi]))
                   for k, lo, hi in jobs]
        for (k, lo, hi), res in zip(jobs, results, strict=True):
            w.add_extent_crc(k, lo, hi - lo, res.get(timeout=60))
    assert path.read_bytes() == torch_bytes(tmp_path, "mp.pt", sd)


def test_missing_extent_names_key_and_gap(tmp_path: Path) -> None:
    sd = {"a": torch.arange(8, dtype=torch.float32), "b.weight": torch.arange(16, dtype=torch.float32)}
    layout, path = _plan(tmp_path, sd, "gap.pt")
    w = TorchZipWriter(path, layout)
    w.write_tensor("a", sd["a"])
    data = _storage_bytes(sd["b.weight"])
    w.write_extent("b.weight", 0, data[:16])
    w.write_extent("b.weight", 40, data[40:])
    with pytest.raises(ValueError, match=r"gap\.pt: tensor 'b\.weight': bytes \[16, 40\) missing"):
        w.finish()
    w.write_extent("b.weight", 16, data[16:24])
    with pytest.raises(ValueError, match=r"'b\.weight': bytes \[24, 40\) missing; expected extents tiling \[0, 64\)"):
        w.finish()
    w.write_extent("b.weight", 20, data[20:40])
    with pytest.raises(ValueError, match=r"'b\.weight': bytes \[20, 24\) written twice"):
        w.finish()
    w.close()
    w = TorchZipWriter(path, layout)
    w.write_tensor("b.weight", sd["b.weight"])
    w.write_tensor("b.weight", sd["b.weight"])  # an identical retry is fine
    with pytest.raises(ValueError, match=r"tensor 'a': bytes \[0, 32\) missing"):
        w.finish()
    with pytest.raises(ValueError, match=r"extent \[60, 68\) of 'b\.weight' is outside its record"):
        w.write_extent("b.weight", 60, b"12345678")
    with pytest.raises(KeyError, match="no tensor 'zz'"):
        w.add_extent_crc("zz", 0, 1, 0)
    w.close()


def test_exception_inside_context_does_not_finish(tmp_path: Path) -> None:
    layout, path = _plan(tmp_path, {"a": torch.ones(4)}, "boom.pt")
    with pytest.raises(RuntimeError, match="boom"), TorchZipWriter(path, layout):
        raise RuntimeError("boom")
    assert path.stat().st_size == layout.file_size  # preallocated, never finished


def test_write_tensor_checks_meta(tmp_path: Path) -> None:
    layout, path = _plan(tmp_path, {"w": torch.zeros(4, 3).t()}, "meta.pt")
    with TorchZipWriter(path, layout) as w:
        with pytest.raises(ValueError, match=r"meta\.pt: tensor 'w': expected dtype/shape/stride"):
            w.write_tensor("w", torch.zeros(3, 4))  # row-major, planned column-major
        w.write_tensor("w", torch.arange(12.0).reshape(4, 3).t())
    with TorchZipReader(path) as r:
        assert torch.equal(r.read("w"), torch.arange(12.0).reshape(4, 3).t())


def test_write_tensor_from_non_owning_view(tmp_path: Path) -> None:
    """write_tensor takes any tensor with the planned stride, e.g. a slice of a bigger buffer."""
    big = torch.arange(40, dtype=torch.int32).reshape(10, 4)
    view = big[3:7]  # storage offset 12, same stride as a (4, 4) contiguous tensor
    layout, path = _plan(tmp_path, {"v": view.clone()}, "view.pt")
    with TorchZipWriter(path, layout) as w:
        w.write_tensor("v", view)
    assert path.read_bytes() == torch_bytes(tmp_path, "view.pt", {"v": view.clone()})


def test_save_state_dict_rejects_what_torch_would_write_differently(tmp_path: Path) -> None:
    base = torch.zeros(4, 4)
    cases = {
        "storage offset 4": {"v": base[1]},
        "shares its storage with 'a'": {"a": base, "b": base.view(16)},
        "type Parameter": {"p": torch.nn.Parameter(torch.zeros(2))},
        "requires_grad True": {"g": torch.zeros(2, requires_grad=True)},
        "tensors are only supported as top-level values": {"nested": {"t": torch.zeros(1)}},
        "unsupported value type object": {"o": object()},
        "unsupported value type bytes": {"b": [b"raw"]},
    }
    for message, sd in cases.items():
        with pytest.raises(ValueError, match=message):
            save_state_dict(tmp_path / "bad.pt", sd)


# ----------------------------------------------------------------------------- reading


@pytest.mark.parametrize("io", IO_MODES)
def test_reader_round_trip_against_torch_load(tmp_path: Path, io: str) -> None:
    rng = random.Random(99)
    for case in range(40):
        sd = rand_state_dict(rng, rng.randint(1, 8))
        path = tmp_path / f"r{case}.pt"
        torch.save(sd, path)
        ref = torch.load(path, weights_only=True)
        with TorchZipReader(path, io=io) as r:
            assert r.keys() == list(ref)
            for key, value in ref.items():
                entry = r.entry(key)
                if not isinstance(value, torch.Tensor):
                    assert entry == value
                    continue
                assert isinstance(entry, StoredTensor) and entry.key == key
                got = r.read(key)
                assert (got.dtype, got.shape, got.stride()) == (value.dtype, value.shape, value.stride())
                assert torch.equal(raw(got), raw(value))
                assert got.untyped_storage().nbytes() == value.untyped_storage().nbytes()
                rows = value.shape[0] if value.dim() else 1
                lo = rng.randint(0, rows)
                hi = rng.randint(lo, rows)
                part = r.read_rows(key, lo, hi)
                expected = value[lo:hi] if value.dim() else value.reshape(1)[lo:hi]
                assert part.is_contiguous() and part.shape == expected.shape
                assert torch.equal(raw(part), raw(expected))


@pytest.mark.parametrize("io", IO_MODES)
def test_read_rows_reads_only_what_it_needs(tmp_path: Path, io: str, monkeypatch: pytest.MonkeyPatch) -> None:
    row_major = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    col_major = row_major.t().contiguous().t()
    path = tmp_path / "rows.pt"
    torch.save({"r": row_major, "c": col_major, "c3": torch.arange(4 * 5 * 6.0).reshape(6, 5, 4).permute(2, 1, 0)}, path)
    with TorchZipReader(path, io=io) as r:
        seen: list[int] = []
        read_into = r._src.read_into
        monkeypatch.setattr(r._src, "read_into", lambda off, dst: (seen.append(len(dst)), read_into(off, dst))[1])
        assert torch.equal(r.read_rows("r", 10, 13), row_major[10:13])
        assert seen == [3 * 48 * 4]
        seen.clear()
        assert torch.equal(r.read_rows("c", 10, 13), col_major[10:13])
        assert seen == [3 * 4] * 48  # one run per column
        seen.clear()
        c3 = r.read("c3")
        for lo, hi in [(0, 4), (1, 2), (2, 4), (3, 3)]:
            assert torch.equal(r.read_rows("c3", lo, hi), c3[lo:hi])
        with pytest.raises(ValueError, match=r"rows \[3, 70\) out of range; expected within \[0, 64\]"):
            r.read_rows("r", 3, 70)


def test_reader_rejects_non_torch_files(tmp_path: Path) -> None:
    (tmp_path / "x.pt").write_bytes(b"not a zip at all" * 10)
    with pytest.raises(ValueError, match="not a zip file"):
        TorchZipReader(tmp_path / "x.pt")
    with pytest.raises(ValueError, match="io must be 'mmap' or 'read'"):
        TorchZipReader(tmp_path / "x.pt", io="fast")


def test_reader_plain_value_is_not_a_tensor(tmp_path: Path) -> None:
    torch.save({"step": 3, "w": torch.ones(2)}, tmp_path / "p.pt")
    with TorchZipReader(tmp_path / "p.pt") as r:
        assert r.entry("step") == 3
        with pytest.raises(ValueError, match="'step' is a int, not a tensor"):
            r.read("step")
        with pytest.raises(KeyError, match="no key 'nope'"):
            r.entry("nope")


# ----------------------------------------------------------------------------- golden files


def _fixture_files() -> list[str]:
    fixture_cases(GOLDEN)  # fails, naming the folder, when it is missing
    return sorted(glob.glob(str(GOLDEN / "*" / "out" / "model" / "*.pt")) + glob.glob(str(GOLDEN / "*" / "*.pt")))


@pytest.mark.parametrize("io", IO_MODES)
def test_golden_files_rewrite_to_the_same_sha256(tmp_path: Path, io: str) -> None:
    """Official converter outputs (and the inputs torch.save wrote) re-written under their archive name."""
    files = _fixture_files()
    # 6 merged.pt, 3 expected_full.pt, 20 official shards
    assert len(files) == 29, files
    for src in files:
        with TorchZipReader(src, io=io) as r:
            sd = r.container_type((k, r.read(k)) for k in r.keys())
            if r.attributes:  # e.g. an nn.Module state_dict's _metadata
                sd.__dict__.update(r.attributes)
            out = tmp_path / f"{r.archive}.pt"
        save_state_dict(out, sd)
        digest = hashlib.sha256(out.read_bytes()).hexdigest()
        assert digest == hashlib.sha256(Path(src).read_bytes()).hexdigest(), src
        case = json.loads((Path(src).parents[2] / "case.json").read_text()) if "out" in Path(src).parts else None
        if case is not None:
            assert digest == case["sha256"][str(Path(src).relative_to(Path(src).parents[2]))], src


# ----------------------------------------------------------------------------- > 4 GiB


def _compare_files(a: Path, b: Path) -> None:
    assert a.stat().st_size == b.stat().st_size
    with open(a, "rb") as fa, open(b, "rb") as fb:
        pos = 0
        while chunk := fa.read(1 << 26):
            other = fb.read(len(chunk))
            assert chunk == other, f"at {pos}: {first_diff(chunk, other)}"
            pos += len(chunk)


@pytest.mark.slow
def test_zip64_past_4_gib_matches_torch_save(tmp_path: Path) -> None:
    """Records >= 0xFFFFFFFF bytes, headers past 4 GiB, both at once, and an empty record past 4 GiB.

    Needs ~9 GiB RAM (for torch.save's tensors) and ~18 GiB disk.
    """
    sizes = {"a": 10, "big1": 2**32 + 197, "e": 0, "c": 5, "big2": 2**32 - 1}
    metas: dict[str, Any] = {k: TensorMeta.contiguous(torch.uint8, (n,)) for k, n in sizes.items()}
    metas["note"] = "past 4 GiB"
    name = "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    layout = plan_zip(name, metas)
    assert layout.file_size > 2**33
    zeros = bytes(1 << 28)
    with TorchZipWriter(ours_path(tmp_path, name), layout) as w:
        for key, n in sizes.items():
            starts = list(range(0, n, len(zeros)))
            for lo in reversed(starts):  # back to front, in pieces
                w.write_extent(key, lo, memoryview(zeros)[: min(len(zeros), n - lo)])
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    sd: dict[str, Any] = {k: torch.zeros(n, dtype=torch.uint8) for k, n in sizes.items()}
    sd["note"] = "past 4 GiB"
    torch.save(sd, ref_dir / name)
    del sd
    _compare_files(ours_path(tmp_path, name), ref_dir / name)
    with TorchZipReader(ref_dir / name, io="read") as r:
        assert r.entry("big2").data_offset == layout.data_offset["big2"]
        assert r.read_rows("big1", 2**32 + 190, 2**32 + 197).tolist() == [0] * 7


@pytest.mark.slow
def test_more_than_65535_records_matches_torch_save(tmp_path: Path) -> None:
    """The end record caps its entry counts at 0xFFFF; the zip64 end record has the real count."""
    sd = {f"t{i}": torch.full((i % 3,), i % 251, dtype=torch.uint8) for i in range(65540)}
    save_state_dict(ours_path(tmp_path, "many.pt"), sd)
    assert ours_path(tmp_path, "many.pt").read_bytes() == torch_bytes(tmp_path, "many.pt", sd)
    with TorchZipReader(ours_path(tmp_path, "many.pt"), io="read") as r:
        assert len(r.keys()) == 65540 and r.read("t65539").tolist() == [65539 % 251] * (65539 % 3)


def test_zip64_layout_offsets_without_data() -> None:
    """The layout alone (no data) for a 140 GB shard: monotone, aligned, zip64 where needed."""
    metas = {f"layers.{i}.w": TensorMeta.contiguous(torch.bfloat16, (8192, 8192 + i)) for i in range(1100)}
    layout = plan_zip("dp_rank_00_tp_rank_00_pp_rank_00.pt", metas)
    assert layout.file_size > 140 * 10**9
    prev_end = 0
    for rec in layout.records:
        assert rec.header_offset == prev_end
        if rec.name.split("/", 1)[1].startswith("data/"):
            assert rec.data_offset % 64 == 0
        assert rec.zip64 == (rec.header_offset >= 0xFFFFFFFF or rec.size >= 0xFFFFFFFF)
        prev_end = rec.end
    assert layout.central_dir_offset == prev_end


def test_reader_module_has_no_pickle_import() -> None:
    """Only safe_load may unpickle: the reader module must not import pickle or call torch.load."""
    source = Path(torchzip_read.__file__).read_text()
    assert "import pickle" not in source and "torch.load" not in source


def test_nested_tensors_byte_identical_to_torch_save(tmp_path: Path) -> None:
    """Tensors inside nested containers (NxD's optimizer files: ``base_state[i]["exp_avg"]``, int keys, a master
    table after them) placed by TensorAt: the bytes torch.save writes, storages numbered in pickling order."""
    rng = random.Random(3)
    state = {i: {"step": torch.tensor(2.0), "exp_avg": rand_tensor(rng, dtype, shape),
                 "exp_avg_sq": rand_tensor(rng, dtype, shape)}
             for i, (dtype, shape) in enumerate([(torch.float32, (4, 3)), (torch.bfloat16, (5,)), (torch.float64, (2, 2))])}
    masters = {i: rand_tensor(rng, torch.float32, (3,)) for i in range(2)}
    obj = {"state": {}, "param_groups": [{"lr": 0.01, "betas": [0.9, 0.95], "params": [0, 1, 2]}],
           "base_state": state, "shape_info": {0: [4, 3], 1: [5], 2: [2, 2]}, "sharded_master_weights": masters}
    entries = {**obj, "base_state": {i: {k: TensorAt(f"{i}.{k}", TensorMeta.of(v)) for k, v in s.items()}
                                     for i, s in state.items()},
               "sharded_master_weights": {i: TensorAt(f"m{i}", TensorMeta.of(v)) for i, v in masters.items()}}
    path = ours_path(tmp_path, "optim.pt")
    with TorchZipWriter(path, plan_zip(path, entries)) as writer:
        for i, s in state.items():
            for k, v in s.items():
                writer.write_tensor(f"{i}.{k}", v)
        for i, v in masters.items():
            writer.write_tensor(f"m{i}", v)
    ours, ref = path.read_bytes(), torch_bytes(tmp_path, "optim.pt", obj)
    assert ours == ref, first_diff(ours, ref)


@pytest.mark.parametrize("io", ["mmap", "read"])
def test_read_columns_reads_only_a_block(tmp_path: Path, io: str) -> None:
    """Columns of a row-major matrix, of a column-major one (NxD's ``o_proj`` with QKV linear) and of a view into a
    larger storage equal the slices torch reads; a row-major matrix under checks declines (False, ``out`` untouched),
    a column-major one reads its one run and the file's CRCs still pass."""
    from ckptconv.io.checked import CheckedFiles

    base = torch.arange(7 * 11 * 3, dtype=torch.float32).reshape(21, 11)
    state = {"rows": base[:7].clone(), "columns": base[:7].t().contiguous().t(), "view": base[5:12],
             "half": base[:7].to(torch.bfloat16).t().contiguous().t()}
    path = tmp_path / "m.pt"
    torch.save(state, path)
    with TorchZipReader(path, io=io) as r:
        for key, tensor in state.items():
            for start, stop in [(0, 11), (3, 8), (10, 11), (4, 4)]:
                out = torch.full((tensor.shape[0], stop - start), -1.0, dtype=tensor.dtype)
                assert r.read_columns(key, start, stop, out), key
                assert torch.equal(out, tensor[:, start:stop]), (key, start, stop)
        with pytest.raises(ValueError, match="no columns"):
            r.read_columns("rows", 5, 12, torch.empty(7, 7))
        with pytest.raises(ValueError, match="out must be"):
            r.read_columns("rows", 0, 2, torch.empty(7, 3))
    checks = CheckedFiles(tmp_path, None)
    with TorchZipReader(path, io=io, checks=checks) as r:
        out = torch.full((7, 5), -1.0)
        assert not r.read_columns("rows", 2, 7, out) and bool((out == -1).all())
        assert r.read_columns("columns", 2, 7, out) and torch.equal(out, state["columns"][:, 2:7])
        assert checks.finish(workers=1) == 1
