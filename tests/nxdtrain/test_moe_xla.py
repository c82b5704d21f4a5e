"""The MoE path (issue 30) on torch-xla, one rank on XLA:CPU (the XLA lane, ``make test-xla``; skipped without
torch_xla): the cpu path's losses and aux losses within 1e-5; ``--ep 2`` on xla refused before any process."""

from __future__ import annotations

from pathlib import Path

import pytest

from nxdtrain.device import torch_xla_api

if torch_xla_api() is None:
    pytest.skip("torch_xla does not import here (the XLA lane: make setup-xla test-xla)", allow_module_level=True)

import torch_xla  # noqa: E402

from nxdtrain.config.options import TrainConfig  # noqa: E402
from nxdtrain.errors import TrainError  # noqa: E402
from nxdtrain.train import prepare, train  # noqa: E402
from tests.nxdtrain.harness import convert, read_log, train_options  # noqa: E402
from tests.nxdtrain.moe_reference import make_moe  # noqa: E402

torch_xla.device()  # the XLA runtime before any backward of this process (see test_xla.py)


def _run(tmp: Path, src: Path, device: str) -> list[dict]:
    log = tmp / f"{device}.jsonl"
    train(TrainConfig.from_flat({**train_options(optimizer="adamw", gbs=4, mbs=2, seq_len=16), "resume": str(src),
                                 "device": device, "log_jsonl": str(log), "no_checkpoint": True}))
    return read_log(log)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_on_xla_matches_cpu(tmp_path, family):
    src = convert(make_moe(tmp_path / "hf", family), tmp_path / "nxd")
    cpu, xla = _run(tmp_path, src, "cpu"), _run(tmp_path, src, "xla")
    assert [r["step"] for r in xla] == [1, 2, 3]
    for key in ("loss", "aux_loss"):
        assert max(abs(a[key] - b[key]) for a, b in zip(cpu, xla, strict=True)) <= 1e-5, (key, cpu, xla)


def test_ep_on_xla_is_refused_before_any_process(tmp_path):
    src = convert(make_moe(tmp_path / "hf", "mixtral"), tmp_path / "nxd")
    config = TrainConfig.from_flat({**train_options(gbs=4, mbs=1), "resume": str(src), "device": "xla", "ep": 2,
                                    "no_checkpoint": True})
    with pytest.raises(TrainError, match=r"^--ep 2 on xla: the all-to-all's splits are data-dependent"):
        prepare(config, 2)
