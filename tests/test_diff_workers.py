"""``ckptconv diff --workers N``: tensors compared on N threads give the answer one thread gives, tensor by tensor and
in the same order, also when each worker's share of ``--max-memory`` is a few rows; a count below 1 is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import ckptconv
from ckptconv.cli.main import main
from ckptconv.engine.options import RunOptions
from tests.conftest import make_tiny_llama


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An HF Llama and the NxD tp2 x pp2 shards of a copy whose every other tensor moved by its own amount."""
    root = tmp_path_factory.mktemp("diff-workers")
    hf = make_tiny_llama(root / "hf")
    state = load_file(hf / "model.safetensors")
    for n, key in enumerate(sorted(state)):
        if n % 2:
            state[key] = state[key] + 1e-3 * (n + 1)
    other = root / "other"
    other.mkdir()
    save_file(state, other / "model.safetensors", metadata={"format": "pt"})
    (other / "config.json").write_text((hf / "config.json").read_text())
    ckptconv.to_nxd(other, root / "nxd", tp=2, pp=2, options=RunOptions(quiet=True))
    return hf, root / "nxd"


@pytest.mark.parametrize("max_memory", [2 << 30, 4096])
def test_workers_give_the_one_thread_answer(moved: tuple[Path, Path], max_memory: int) -> None:
    hf, nxd = moved
    one = ckptconv.diff(hf, nxd, workers=1, max_memory=max_memory)
    many = ckptconv.diff(hf, nxd, workers=4, max_memory=max_memory)
    assert many == one
    assert 0 < one["counts"]["differ"] < len(one["tensors"])  # some tensors moved, some did not
    moved_by = {t["key"]: t["max_abs"] for t in one["tensors"] if t["status"] == "differ"}
    state = load_file(hf / "model.safetensors")
    for n, key in enumerate(sorted(state)):  # each by its own amount (float32 rounding of the sum)
        if n % 2:
            assert moved_by[key] == pytest.approx(1e-3 * (n + 1), rel=1e-3)


def test_workers_below_one_are_refused(moved: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    hf, nxd = moved
    assert main(["diff", str(hf), str(nxd), "--workers", "0"]) == 1
    assert "--workers 0: the tensors compared at once, a number >= 1" in capsys.readouterr().err
