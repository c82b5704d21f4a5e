"""``data.pkl`` exactly as ``torch.save`` pickles it, built from tensor metadata alone.

torch pickles each tensor as ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
requires_grad, OrderedDict())`` (``_v3`` with an ``UntypedStorage`` and a trailing dtype for the
newer dtypes), and each storage as the persistent id
``('storage', torch.<Dtype>Storage, '<n>', 'cpu', numel)``. We feed the standard C pickler
stand-in objects whose reductions are those same tuples, so memoization (and thus every byte)
comes out the same.
"""

from __future__ import annotations

import io
import math
import pickle
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptconv.io.safe_load import TENSOR_REFERENCE_IS_STAND_IN, TensorReference

# dtype -> the legacy typed-storage class torch names in the pickle (rebuild v2).
_V2_STORAGE: dict[torch.dtype, str] = {
    torch.float64: "DoubleStorage", torch.float32: "FloatStorage", torch.float16: "HalfStorage",
    torch.int64: "LongStorage", torch.int32: "IntStorage", torch.int16: "ShortStorage",
    torch.int8: "CharStorage", torch.uint8: "ByteStorage", torch.bool: "BoolStorage",
    torch.bfloat16: "BFloat16Storage", torch.complex128: "ComplexDoubleStorage",
    torch.complex64: "ComplexFloatStorage",
}
# dtypes torch pickles as UntypedStorage + dtype (rebuild v3); see torch.storage._new_dtypes.
_V3_DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz",
                                "float8_e8m0fnu", "uint16", "uint32", "uint64", "complex32")
    if hasattr(torch, n)
)
SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(_V2_STORAGE) | _V3_DTYPES

# Plain (non-tensor) values allowed in a saved dict; the safe reader accepts exactly these.
# (no bytes: protocol 2 pickles them through _codecs.encode, which the reader does not allow)
_PLAIN_SCALARS = (type(None), bool, int, float, str, torch.dtype)


def _is_dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True if (shape, stride) tiles exactly ``numel`` elements from offset 0 (any dim order)."""
    if math.prod(shape) == 0:
        return True
    expected = 1
    # size-1 dims may carry any stride (torch allows it); the rest must nest exactly.
    for st, size in sorted((s, sz) for sz, s in zip(shape, stride, strict=True) if sz != 1):
        if st != expected:
            return False
        expected *= size
    return True


@dataclass(frozen=True)
class TensorMeta:
    """dtype/shape/stride of a tensor that owns exactly its storage (storage offset 0).

    >>> TensorMeta.contiguous(torch.bfloat16, (4, 3)).stride
    (3, 1)
    >>> TensorMeta(torch.float32, (4, 3), (1, 4)).nbytes  # column-major
    48
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def __post_init__(self) -> None:
        # Accept lists / torch.Size, but store plain int tuples (they go into the pickle).
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "stride", tuple(int(s) for s in self.stride))
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"TensorMeta: unsupported dtype {self.dtype}")
        if len(self.shape) != len(self.stride) or min(self.shape + self.stride, default=0) < 0:
            raise ValueError(f"TensorMeta: bad shape {self.shape} / stride {self.stride}")
        if not _is_dense(self.shape, self.stride):
            raise ValueError(f"TensorMeta: stride {self.stride} is not a dense layout of shape {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the storage: ``numel * itemsize``."""
        return self.numel * self.dtype.itemsize

    @staticmethod
    def contiguous(dtype: torch.dtype, shape: tuple[int, ...] | list[int] | torch.Size) -> TensorMeta:
        """Row-major meta. ``TensorMeta.contiguous(torch.float32, (2, 3)).stride == (3, 1)``."""
        shape = tuple(int(s) for s in shape)
        stride, acc = [], 1
        for size in reversed(shape):
            stride.append(acc)
            acc *= max(size, 1)
        return TensorMeta(dtype, shape, tuple(reversed(stride)))

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        """Meta of ``t`` (its own stride). ``TensorMeta.of(torch.zeros(2, 3).t()).stride == (1, 3)``."""
        return TensorMeta(t.dtype, tuple(t.shape), tuple(t.stride()))


@dataclass(frozen=True)
class TensorAt:
    """A tensor inside a nested structure (NxD's optimizer files: ``base_state[i]["exp_avg"]``), named by
    ``key`` for its writes; at the top level of a file a plain TensorMeta value does the same."""

    key: str
    meta: TensorMeta


class _StorageStandIn:
    """Takes the place of the TypedStorage/UntypedStorage torch hands to persistent_id."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


class _TensorStandIn:
    """Reduces like ``Tensor._reduce_ex_internal`` for a CPU tensor with no hooks or metadata."""

    __slots__ = ("meta", "storage")

    def __init__(self, meta: TensorMeta, storage: _StorageStandIn) -> None:
        self.meta, self.storage = meta, storage

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[Any, ...]]:
        # Fresh size/stride tuples and OrderedDict, as torch builds them per call: the pickler
        # memoizes by identity, so sharing one TensorMeta between keys must not share tuples.
        # (tuple(a_tuple) would return the same object; tuple(list(...)) does not.)
        size, stride = tuple(list(self.meta.shape)), tuple(list(self.meta.stride))
        args: tuple[Any, ...] = (self.storage, 0, size, stride, False, OrderedDict())
        if self.meta.dtype in _V3_DTYPES:
            return torch._utils._rebuild_tensor_v3, args + (self.meta.dtype,)
        return torch._utils._rebuild_tensor_v2, args


def _storage_pid(meta: TensorMeta, key: str) -> tuple[Any, ...]:
    # 'storage' and 'cpu' are interned literals here and in torch, so they memoize alike.
    if meta.dtype in _V3_DTYPES:
        return ("storage", torch.UntypedStorage, key, "cpu", meta.nbytes)
    return ("storage", getattr(torch, _V2_STORAGE[meta.dtype]), key, "cpu", meta.numel)


class _StandInPickler(pickle.Pickler):
    """The C pickler, as torch.save uses it."""

    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if type(obj) is _StorageStandIn else None


_PurePythonPickler: Any = pickle._Pickler  # type: ignore[attr-defined]


class _PyStandInPickler(_PurePythonPickler):
    """Pure-Python pickler (same opcodes at protocol 2) that can name the TensorReference
    stand-in as a global without importing torch_xla, which the C pickler insists on doing."""

    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if type(obj) is _StorageStandIn else None

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is not TensorReference:
            super().save_global(obj, name)
            return
        self.write(pickle.GLOBAL + f"{obj.__module__}\n{obj.__qualname__}\n".encode())
        self.memoize(obj)


def _check_plain(value: Any, where: str) -> bool:
    """Reject anything the safe reader could not load back (and any nested tensor but a TensorAt).

    Returns True if a TensorReference occurs in ``value``."""
    if isinstance(value, (torch.Tensor, TensorMeta)):
        raise ValueError(f"{where}: tensors are only supported as top-level values (nested: TensorAt)")
    if type(value) is TensorReference:
        return True
    if isinstance(value, _PLAIN_SCALARS) or type(value) is torch.Size or type(value) is TensorAt:
        return False
    if type(value) in (list, tuple):
        return any([_check_plain(v, f"{where}[{i}]") for i, v in enumerate(value)])
    if type(value) in (dict, OrderedDict):
        return any([_check_plain(k, f"{where} key") | _check_plain(v, f"{where}[{k!r}]") for k, v in value.items()])
    raise ValueError(f"{where}: unsupported value type {type(value).__name__} (expected tensor or plain data)")


class _Storages:
    """Storage numbering in first-pickled order (torch.save's), by tensor key."""

    def __init__(self) -> None:
        self.keys: dict[str, str] = {}
        self.metas: dict[str, TensorMeta] = {}

    def stand_in(self, key: str, meta: TensorMeta) -> _TensorStandIn:
        if key in self.keys:
            raise ValueError(f"tensor key {key!r} occurs twice")
        self.keys[key] = str(len(self.keys))
        self.metas[key] = meta
        return _TensorStandIn(meta, _StorageStandIn(_storage_pid(meta, self.keys[key])))


def map_tensor_at(value: Any, fn: Any) -> Any:
    """``value`` with every TensorAt ``t`` replaced by ``fn(t)``, in pickling (depth-first, insertion) order.
    Containers without a TensorAt are kept as they are (the same objects: the same pickle memo)."""
    if type(value) is TensorAt:
        return fn(value)
    if type(value) in (dict, OrderedDict) and _holds_tensor_at(value):
        return type(value)((k, map_tensor_at(v, fn)) for k, v in value.items())
    if type(value) in (list, tuple) and _holds_tensor_at(value):
        return type(value)(map_tensor_at(v, fn) for v in value)
    return value


def _holds_tensor_at(value: Any) -> bool:
    if type(value) is TensorAt:
        return True
    if type(value) in (dict, OrderedDict):
        return any(_holds_tensor_at(v) for v in value.values())
    if type(value) in (list, tuple):
        return any(_holds_tensor_at(v) for v in value)
    return False


def _stand_in_container(entries: Mapping[str, Any]) -> tuple[Any, _Storages, bool]:
    """Copy of ``entries`` with stand-ins for TensorMeta values (and nested TensorAt), the storages by
    tensor key, and whether a TensorReference occurs."""
    if type(entries) not in (dict, OrderedDict):
        raise ValueError(f"expected a dict or OrderedDict, got {type(entries).__name__}")
    out: Any = type(entries)()
    if type(entries) is OrderedDict:
        out.__dict__.update(vars(entries))  # e.g. state_dict()._metadata is pickled too
    storages = _Storages()
    has_ref = False
    for key, value in entries.items():
        if not isinstance(key, str):
            raise ValueError(f"key {key!r}: keys must be str")
        if isinstance(value, TensorMeta):
            out[key] = storages.stand_in(key, value)
        else:
            has_ref |= _check_plain(value, f"key {key!r}")
            out[key] = map_tensor_at(value, lambda t: storages.stand_in(t.key, t.meta))
    for k, v in getattr(out, "__dict__", {}).items():
        has_ref |= _check_plain(v, f"attribute {k!r}")
    return out, storages, has_ref


def pickle_entries(entries: Mapping[str, Any] | TensorMeta) -> tuple[bytes, dict[str, str], dict[str, TensorMeta]]:
    """``data.pkl`` bytes for ``entries``, the storage key of each tensor key, and each tensor's meta.

    A bare TensorMeta stands for ``torch.save(tensor)``; its key is ``""``.

    >>> data, keys, _ = pickle_entries({"w": TensorMeta.contiguous(torch.float32, (2,))})
    >>> keys
    {'w': '0'}
    """
    has_ref = False
    if isinstance(entries, TensorMeta):
        obj: Any = _TensorStandIn(entries, _StorageStandIn(_storage_pid(entries, "0")))
        storage_keys, metas = {"": "0"}, {"": entries}
    else:
        obj, storages, has_ref = _stand_in_container(entries)
        storage_keys, metas = storages.keys, storages.metas
    buf = io.BytesIO()
    pickler = _PyStandInPickler if has_ref and TENSOR_REFERENCE_IS_STAND_IN else _StandInPickler
    pickler(buf, protocol=2).dump(obj)  # torch.save's default protocol is 2
    return buf.getvalue(), storage_keys, metas
