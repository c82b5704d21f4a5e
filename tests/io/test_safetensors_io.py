"""Tests for ckptconv.io.safetensors_io against the reference `safetensors` package."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import random
import struct
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckptconv.io import safetensors_io as stio
from ckptconv.io.safetensors_io import (
    DTYPES,
    SafetensorsFormatError,
    SafetensorsReader,
    SafetensorsWriteError,
    SafetensorsWriter,
    open_for_extents,
    plan_safetensors,
)

IO_MODES = ("mmap", "read")
# Characters that stress JSON escaping and UTF-8 byte ordering of names.
NAME_CHARS = 'abcxyzABC0189._-/ "\\\n\t\x01\x1f\x7féü中\uffee😀'
# safetensors' own torch loader has no mapping for F8_E8M0, so it cannot read it back.
REF_LOADABLE = {n for n in DTYPES if n != "F8_E8M0"}


def raw(t: torch.Tensor) -> torch.Tensor:
    """Byte view, so NaN payloads and fp8 (no torch.equal kernel) compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def random_tensor(rng: random.Random, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    numel = 1
    for d in shape:
        numel *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def random_shape(rng: random.Random) -> tuple[int, ...]:
    kind = rng.random()
    if kind < 0.15:
        return ()
    if kind < 0.25:
        return tuple(rng.choice([0, 3]) for _ in range(rng.randint(1, 3))) + (0,)
    return tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 3)))


def random_tensors(rng: random.Random, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for _ in range(rng.randint(0, 8)):
        name = "".join(rng.choice(NAME_CHARS) for _ in range(rng.randint(1, 40)))
        if name == "__metadata__":
            continue
        dtype = DTYPES[rng.choice(sorted(names or DTYPES))]
        out[name] = random_tensor(rng, dtype, random_shape(rng))
    return out


def random_metadata(rng: random.Random) -> dict[str, str] | None:
    kind = rng.randrange(4)
    if kind == 0:
        return None
    n = {1: 0, 2: 1, 3: rng.randint(2, 5)}[kind]
    return {"".join(rng.choice(NAME_CHARS) for _ in range(rng.randint(1, 9))): f"v{i}\n" for i in range(n)}


def reference_metadata_order(path: Path) -> dict[str, str] | None:
    """safetensors emits metadata in Rust HashMap order; recover it from the file."""
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    pairs = json.loads(path.read_bytes()[8 : 8 + n], object_pairs_hook=lambda p: p)
    meta = dict(pairs).get("__metadata__")
    return None if meta is None else dict(meta)


def write_in_pieces(rng: random.Random, path: Path, tensors: dict[str, torch.Tensor], layout) -> None:
    pieces = []
    for key, t in tensors.items():
        data = bytes(raw(t).numpy())
        cuts = sorted({0, len(data), *(rng.randint(0, len(data)) for _ in range(rng.randint(0, 4)))})
        pieces += [(key, a, data[a:b]) for a, b in pairwise(cuts)]
    rng.shuffle(pieces)
    with SafetensorsWriter(path, layout) as w:
        for i, (key, off, chunk) in enumerate(pieces):
            # Exercise every accepted input type.
            data = [chunk, memoryview(chunk), torch.frombuffer(bytearray(chunk), dtype=torch.uint8)][i % 3]
            w.write_extent(key, off, data if len(chunk) else b"")


@pytest.mark.parametrize("seed", range(60))
def test_byte_identical_to_save_file(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    tensors = random_tensors(rng)
    metadata = random_metadata(rng)
    ref = tmp_path / "ref.safetensors"
    save_file(tensors, ref, metadata=metadata)
    specs = {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
    ours = tmp_path / "ours.safetensors"
    if not tensors and metadata == {}:
        # safetensors 0.8.0 writes invalid JSON here ('{},"__metadata__":{}}'); ours stays valid.
        write_in_pieces(rng, ours, tensors, plan_safetensors(specs, metadata))
        assert ours.read_bytes()[8:].rstrip() == b'{"__metadata__":{}}'
        with SafetensorsReader(ours) as r:
            assert r.metadata == {}
        return
    layout = plan_safetensors(specs, reference_metadata_order(ref))
    assert layout.total_size == ref.stat().st_size
    write_in_pieces(rng, ours, tensors, layout)
    assert ours.read_bytes() == ref.read_bytes()


def test_write_tensor_non_contiguous_matches(tmp_path: Path) -> None:
    tensors = {"t": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t(), "s": torch.tensor(7, dtype=torch.int64)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    layout = plan_safetensors({k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, {"format": "pt"})
    with SafetensorsWriter(tmp_path / "ours.safetensors", layout) as w:
        for k, v in tensors.items():
            w.write_tensor(k, v)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_plan_empty_and_order() -> None:
    assert plan_safetensors({}).header == struct.pack("<Q", 8) + b"{}      "
    lay = plan_safetensors({"b": (torch.int8, (3,)), "a": (torch.int8, (1,)), "w": (torch.float32, (2,))})
    assert list(lay.entries) == ["w", "a", "b"]
    assert len(lay.header) % 8 == 0
    with pytest.raises(ValueError):
        plan_safetensors({"x": (torch.float32, (-1,))})


@pytest.mark.parametrize("io", IO_MODES)
@pytest.mark.parametrize("seed", range(25))
def test_reader_matches_safe_open(tmp_path: Path, seed: int, io: str) -> None:
    rng = random.Random(1000 + seed)
    tensors = random_tensors(rng, sorted(REF_LOADABLE))
    metadata = random_metadata(rng) if tensors else None  # see the 0.8.0 bug noted above
    path = tmp_path / "f.safetensors"
    save_file(tensors, path, metadata=metadata)
    with SafetensorsReader(path, io=io) as r, safe_open(path, framework="pt") as ref:
        assert sorted(r.keys()) == sorted(ref.keys())
        offsets = [r.entry(k).data_offset for k in r.keys()]
        assert offsets == sorted(offsets)
        assert r.metadata == ref.metadata()
        for key in r.keys():
            e = r.entry(key)
            expected = ref.get_tensor(key)
            got = r.read(key)
            assert (e.dtype, e.shape, e.nbytes) == (expected.dtype, tuple(expected.shape), len(raw(expected)))
            assert same(got, expected) and same(got, tensors[key])
            if not expected.is_floating_point() and not expected.is_complex():  # no NaNs to trip equal
                assert torch.equal(got, expected)
            if e.shape:
                a = rng.randint(0, e.shape[0])
                b = rng.randint(a, e.shape[0])
                assert same(r.read_rows(key, a, b), ref.get_slice(key)[a:b])


@pytest.mark.parametrize("io", IO_MODES)
def test_reader_all_dtypes_roundtrip(tmp_path: Path, io: str) -> None:
    rng = random.Random(7)
    tensors = {f"t_{name}": random_tensor(rng, dt, (3, 5)) for name, dt in DTYPES.items()}
    layout = plan_safetensors({k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()})
    path = tmp_path / "all.safetensors"
    with SafetensorsWriter(path, layout) as w:
        for k, v in tensors.items():
            w.write_tensor(k, v)
    with SafetensorsReader(path, io=io) as r:
        assert r.keys() == list(layout.entries)
        for k, v in tensors.items():
            assert same(r.read(k), v)
            assert same(r.read_rows(k, 1, 3), v[1:3])


def test_read_rows_reads_only_those_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f.safetensors"
    big = torch.arange(1000 * 16, dtype=torch.float32).reshape(1000, 16)
    save_file({"big": big}, path)
    calls: list[tuple[int, int]] = []
    real = os.preadv
    monkeypatch.setattr(
        stio.os, "preadv", lambda fd, bufs, off: calls.append((off, len(bufs[0]))) or real(fd, bufs, off)
    )
    with SafetensorsReader(path, io="read") as r:
        got = r.read_rows("big", 10, 13)
        assert torch.equal(got, big[10:13])
        assert calls == [(r.entry("big").data_offset + 10 * 64, 3 * 64)]
        with pytest.raises(ValueError, match="outside"):
            r.read_rows("big", 5, 1001)


# --------------------------------------------------------------------------- malformed


def build(tmp_path: Path, header: object, data: bytes, *, name: str = "bad.safetensors", n: int | None = None) -> Path:
    body = json.dumps(header).encode()
    path = tmp_path / name
    path.write_bytes(struct.pack("<Q", len(body) if n is None else n) + body + data)
    return path


def good_header() -> dict:
    return {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "I8", "shape": [4], "data_offsets": [8, 12]},
    }


def mutated(key: str, **fields: object) -> dict:
    h = good_header()
    h[key] = {**h[key], **fields}
    return h


MALFORMED = {
    # a header whose last tensor ends past the file: truncated, said with both sizes (an incomplete download?)
    "truncated_data": (good_header(), b"\0" * 10, None, None, "truncated (an incomplete download?): the file is"),
    "header_len_too_big": (good_header(), b"\0" * 12, 10**6, None, "header length 1000000"),
    "header_len_huge": (good_header(), b"\0" * 12, 2**63, None, "header length"),
    "offsets_out_of_range": (mutated("b", data_offsets=[8, 16]), b"\0" * 12, None, None, "its header needs 146"),
    "negative_offset": (mutated("a", data_offsets=[-4, 4]), b"\0" * 12, None, "a", "outside"),
    "overlap": (mutated("b", dtype="F32", shape=[1], data_offsets=[4, 8]), b"\0" * 12, None, "b", "overlaps 'a'"),
    "unknown_dtype": (mutated("a", dtype="F12"), b"\0" * 12, None, "a", "unknown dtype 'F12'"),
    "nbytes_mismatch": (mutated("a", shape=[3]), b"\0" * 12, None, "a", "expected 12 bytes"),
    "bool_shape": (mutated("a", shape=[True, 8]), b"\0" * 12, None, "a", "shape"),
    "not_object": ([1, 2], b"", None, None, "JSON object"),
    "bad_metadata": ({"__metadata__": {"x": 1}, **good_header()}, b"\0" * 12, None, None, "__metadata__"),
}


@pytest.mark.parametrize("io", IO_MODES)
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files(tmp_path: Path, case: str, io: str) -> None:
    header, data, n, key, text = MALFORMED[case]
    path = build(tmp_path, header, data, name=f"{case}.safetensors", n=n)
    with pytest.raises(SafetensorsFormatError) as info:
        SafetensorsReader(path, io=io)
    msg = str(info.value)
    assert f"{case}.safetensors" in msg and text in msg and "\n" not in msg
    if key is not None:
        assert repr(key) in msg


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x05\x00",
        struct.pack("<Q", 4) + b"{}",
        struct.pack("<Q", 4) + b'{"a"',
        struct.pack("<Q", 2) + b"\xff\xfe",
    ],
)
def test_malformed_short_or_garbage(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "junk.safetensors"
    path.write_bytes(content)
    with pytest.raises(SafetensorsFormatError, match="junk.safetensors"):
        SafetensorsReader(path)


def test_duplicate_key_rejected(tmp_path: Path) -> None:
    body = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}'
    path = tmp_path / "dup.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"xy")
    with pytest.raises(SafetensorsFormatError, match="dup.safetensors.*duplicate key 'a'"):
        SafetensorsReader(path)


# --------------------------------------------------------------------------- writer checks


def small_layout():
    return plan_safetensors({"w": (torch.float32, (4,)), "b": (torch.int8, (3,))})


def test_finish_reports_missing_extent(tmp_path: Path) -> None:
    w = SafetensorsWriter(tmp_path / "o.safetensors", small_layout())
    w.write_tensor("b", torch.zeros(3, dtype=torch.int8))
    w.write_extent("w", 0, b"\0" * 4)
    w.write_extent("w", 12, b"\0" * 4)
    with pytest.raises(SafetensorsWriteError, match=r"o\.safetensors: tensor 'w': bytes \[4, 12\) of 16 never written"):
        w.finish()


def test_overlap_and_range_errors(tmp_path: Path) -> None:
    with SafetensorsWriter(tmp_path / "o.safetensors", small_layout()) as w:
        w.write_extent("w", 4, b"\1" * 8)
        with pytest.raises(SafetensorsWriteError, match=r"'w'.*\[0, 5\) overlaps already written \[4, 12\)"):
            w.write_extent("w", 0, b"\2" * 5)
        with pytest.raises(SafetensorsWriteError, match="outside"):
            w.write_extent("b", 2, b"\0\0")
        with pytest.raises(SafetensorsWriteError, match="expected torch.int8"):
            w.write_tensor("b", torch.zeros(3))
        with pytest.raises(SafetensorsWriteError, match="not in the layout"):
            w.write_extent("nope", 0, b"x")
        w.write_extent("w", 0, b"\0" * 4)
        w.write_extent("w", 12, b"\0" * 4)
        w.write_extent("b", 0, b"abc")


def _child_write(path: str, specs: dict, part: int) -> dict:
    layout = plan_safetensors(specs)
    with open_for_extents(path, layout) as w:
        for key, e in layout.entries.items():
            half = e.nbytes // 2
            start, stop = (0, half) if part == 0 else (half, e.nbytes)
            payload = bytes((i * 7 + len(key)) % 256 for i in range(start, stop))
            w.write_extent(key, start, payload)
        return w.written()


def test_multiprocess_extents(tmp_path: Path) -> None:
    specs = {f"layer.{i}.w": (torch.bfloat16, (64, 33)) for i in range(4)}
    specs["scalar"] = (torch.float32, ())
    layout = plan_safetensors(specs)
    path = tmp_path / "mp.safetensors"
    parent = SafetensorsWriter(path, layout)
    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as pool:
        results = list(pool.map(_child_write, [str(path)] * 2, [specs] * 2, [0, 1]))
    for written in results:
        parent.add_written(written)
    parent.finish(fsync=True)
    with SafetensorsReader(path) as r:
        for key, e in layout.entries.items():
            expected = bytes((i * 7 + len(key)) % 256 for i in range(e.nbytes))
            assert bytes(raw(r.read(key)).numpy()) == expected
    with pytest.raises(SafetensorsWriteError, match="size"):
        open_for_extents(path, plan_safetensors({"x": (torch.int8, (1,))}))
