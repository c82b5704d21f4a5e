"""ckptconv.io.safe_load: the restricted unpickler, load_small and is_torch_zip."""

from __future__ import annotations

import importlib.util
import io
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from ckptconv.io.safe_load import (
    TENSOR_REFERENCE_IS_STAND_IN,
    PickledTensor,
    StorageRef,
    TensorReference,
    UnsafeCheckpointError,
    is_torch_zip,
    load_small,
    unpickle_restricted,
)
from ckptconv.io.torchzip import TorchZipReader


def evil_pickle(marker: Path, module: str = "os", name: str = "system") -> bytes:
    """Protocol-0 pickle that calls module.name('touch <marker>') when loaded."""
    return f"c{module}\n{name}\n(S'touch {marker}'\ntR.".encode()


def torch_like_zip(path: Path, data_pkl: bytes) -> None:
    """A zip shaped like torch's (``<archive>/data.pkl`` first) holding an arbitrary pickle."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{path.stem}/data.pkl", data_pkl)
        z.writestr(f"{path.stem}/version", "3\n")


@pytest.mark.parametrize(("module", "name"), [("os", "system"), ("posix", "system"), ("builtins", "eval"),
                                              ("torch", "load"), ("torch._utils", "_rebuild_parameter")])
def test_reader_refuses_malicious_global_without_running_it(tmp_path: Path, module: str, name: str) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch_like_zip(path, evil_pickle(marker, module, name))
    for io_mode in ("mmap", "read"):
        with pytest.raises(UnsafeCheckpointError) as info:
            TorchZipReader(path, io=io_mode)
        assert str(info.value) == f"{path}: refusing to unpickle global {module}.{name} (not in the allowlist)"
    assert isinstance(info.value, ValueError)
    assert not marker.exists()


def test_malicious_global_nested_inside_a_real_checkpoint(tmp_path: Path) -> None:
    """A dangerous REDUCE hidden after legitimate tensors is refused just the same."""
    marker = tmp_path / "pwned"
    good = io.BytesIO()
    torch.save({"w": torch.ones(2)}, good)
    with zipfile.ZipFile(good) as z:
        pkl = z.read("archive/data.pkl")
    # Replace the final STOP with: pop the dict, then call os.system.
    evil = pkl[:-1] + b"0" + evil_pickle(marker)[:-1] + b"."
    path = tmp_path / "mixed.pt"
    torch_like_zip(path, evil)
    with pytest.raises(UnsafeCheckpointError, match=r"mixed\.pt: refusing to unpickle global os\.system"):
        TorchZipReader(path)
    assert not marker.exists()


def test_unpickle_restricted_records_tensors_without_building_them() -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(3, 4).t(), "f8": torch.zeros(5, dtype=torch.float8_e4m3fn), "n": 3}, buf)
    with zipfile.ZipFile(buf) as z:
        obj = unpickle_restricted(z.read("archive/data.pkl"), "buf")
    w, f8 = obj["w"], obj["f8"]
    assert isinstance(w, PickledTensor) and not isinstance(w, torch.Tensor)
    assert (w.dtype, w.shape, w.stride, w.storage_offset) == (torch.float32, (4, 3), (1, 4), 0)
    assert w.storage == StorageRef("0", torch.float32, 12, "cpu", untyped=False)
    assert (f8.dtype, f8.storage.untyped, f8.storage.nbytes) == (torch.float8_e4m3fn, True, 5)
    assert obj["n"] == 3


def test_unpickle_restricted_allows_plain_containers() -> None:
    value = OrderedDict(a=[1, 2.5, None, "x", (True, "b")], s=torch.Size([2, 3]), d=torch.bfloat16)
    assert unpickle_restricted(pickle.dumps(value, protocol=2)) == value


def test_bad_persistent_id_is_refused() -> None:
    class P(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            return ("storage", "not a class", "0", "cpu", 4) if obj == "X" else None

    buf = io.BytesIO()
    P(buf, protocol=2).dump(["X"])
    with pytest.raises(UnsafeCheckpointError, match="f.pt: unsupported persistent id"):
        unpickle_restricted(buf.getvalue(), "f.pt")


def test_corrupt_pickle_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="broken.pkl: cannot unpickle"):
        unpickle_restricted(b"\x80\x02}q\x00(X", "broken.pkl")


def test_is_torch_zip(tmp_path: Path) -> None:
    torch.save({"a": torch.ones(1)}, tmp_path / "new.pt")
    torch.save({"a": torch.ones(1)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as z:
        z.writestr("readme.txt", "hi")
    (tmp_path / "text.pt").write_text("hello")
    assert is_torch_zip(tmp_path / "new.pt")
    assert not is_torch_zip(tmp_path / "old.pt")
    assert not is_torch_zip(tmp_path / "other.zip")
    assert not is_torch_zip(tmp_path / "text.pt")
    assert not is_torch_zip(tmp_path / "missing.pt")
    assert not is_torch_zip(tmp_path)


def test_load_small_legacy_and_zip(tmp_path: Path) -> None:
    info = {0: {"dtype": torch.bfloat16, "shape": torch.Size([4, 2]), "expert_model_parallel": False}}
    torch.save(info, tmp_path / "x.pt.info.pt", _use_new_zipfile_serialization=False)
    assert load_small(tmp_path / "x.pt.info.pt") == info
    torch.save({"w": torch.arange(3)}, tmp_path / "z.pt")
    assert torch.equal(load_small(tmp_path / "z.pt")["w"], torch.arange(3))


def test_load_small_refuses_malicious(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch_like_zip(path, evil_pickle(marker))
    with pytest.raises(UnsafeCheckpointError, match=r"evil.pt: refusing to unpickle: .*GLOBAL .*system") as info:
        load_small(path)
    assert str(info.value).startswith(f"{path}: ") and "weights_only" not in str(info.value)
    assert not marker.exists()


def test_tensor_reference_stand_in() -> None:
    ref = TensorReference(5)
    assert ref.tid == 5
    assert f"{type(ref).__module__}.{type(ref).__qualname__}" == "torch_xla.utils.serialization.TensorReference"
    assert TENSOR_REFERENCE_IS_STAND_IN == (importlib.util.find_spec("torch_xla") is None)
    # A pickle naming torch_xla's class loads as TensorReference, here and in torch.load.
    data = b"\x80\x02ctorch_xla.utils.serialization\nTensorReference\nq\x00)\x81q\x01}q\x02X\x03\x00\x00\x00tidq\x03K\x05sb."
    assert unpickle_restricted(data) == TensorReference(5)
