"""--device: resolution, the combinations refused before anything starts, and saving tensors whose strides say nothing."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from ckptconv.core.layout import ParallelLayout
from ckptconv.core.model_spec import ModelSpec
from ckptconv.io.nxd import Flavour
from ckptconv.io.nxd_write import save_shard
from nxdtrain import cli
from nxdtrain.device import resolve_kind, to_host, torch_xla_api
from nxdtrain.errors import TrainError
from nxdtrain.model.stage import LlamaStage
from nxdtrain.parallel.layers import TpGroup

PP_REFUSAL = ("nxdtrain: error: --pp 2 with --device xla: torch.distributed.pipelining sends activations with "
              "point-to-point send/recv, which torch-xla's 'xla' process-group backend runs as one compiled graph "
              "and host sync per message; nxdtrain does not pipeline on xla. Reshard to --pp 1 (ckptconv reshard "
              "... --pp 1) and use --tp/data parallelism, or train with --pp on --device cpu/cuda\n")


def _no_spawn(*args: object, **kwargs: object) -> int:
    raise AssertionError("a process was started")


@pytest.mark.parametrize("argv,expected", [
    (["--pp", "2", "--nproc", "2"], PP_REFUSAL),
    (["--optimizer", "sgd"], "nxdtrain: error: --optimizer sgd with --device xla: torch's SGD reads a tensor "
                             "learning rate on the host every step (a graph break); use --optimizer adamw\n"),
])
def test_unsupported_xla_runs_fail_before_starting(tmp_path, monkeypatch, capsys, argv, expected):
    """Refused in the config validation: no torch_xla, no checkpoint and no process needed to say no."""
    monkeypatch.setattr("nxdtrain.parallel.dist.spawn", _no_spawn)
    monkeypatch.setattr("nxdtrain.train.train", _no_spawn)
    code = cli.main(["run", "--resume", str(tmp_path / "missing"), "--data", "synthetic", "--device", "xla", *argv])
    assert code == 1
    assert capsys.readouterr().err == expected


def test_auto_and_explicit_devices(monkeypatch):
    assert resolve_kind("cpu", {"PJRT_DEVICE": "NEURON"}) == "cpu"
    cuda = torch.cuda.is_available()
    assert resolve_kind("auto", {}) == ("cuda" if cuda else "cpu")
    assert resolve_kind("auto", {"PJRT_DEVICE": "CPU"}) == ("cuda" if cuda else "cpu")  # XLA:CPU only when asked
    if torch_xla_api() is not None:  # the XLA lane: an accelerator's PJRT device makes auto choose xla
        assert resolve_kind("auto", {"PJRT_DEVICE": "NEURON"}) == "xla"
        assert resolve_kind("xla", {}) == "xla"
    if not cuda:
        with pytest.raises(TrainError, match=r"^--device cuda: torch.cuda.is_available\(\) is false"):
            resolve_kind("cuda", {})
    # A module named torch_xla without its API is not torch-xla: auto falls back, an explicit xla is an error.
    monkeypatch.setitem(sys.modules, "torch_xla", types.ModuleType("torch_xla"))
    assert torch_xla_api() is None
    assert resolve_kind("auto", {"PJRT_DEVICE": "NEURON"}) == ("cuda" if cuda else "cpu")
    with pytest.raises(TrainError, match=r"^--device xla: torch_xla does not import here"):
        resolve_kind("xla", {})


def test_to_host_copies_tensors_only():
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.arange(4.0)}}, "param_groups": [{"lr": 0.1}]}
    assert to_host(state)["state"][0]["exp_avg"] is state["state"][0]["exp_avg"]  # CPU tensors are not copied
    assert to_host(state)["param_groups"] == [{"lr": 0.1}]


@pytest.mark.parametrize("flavour", [Flavour.PLAIN, Flavour.XSER_SPLIT])
def test_shard_saved_from_row_major_tensors_is_byte_identical(tmp_path, flavour):
    """The device path (plain row-major tensors + the column-major keys named) writes the bytes of the cpu path."""
    spec = ModelSpec(hidden=16, heads=4, kv_heads=2, head_dim=4, intermediate=24, vocab=32, layers=2, tied=False,
                     config={"hidden_size": 16, "num_attention_heads": 4, "rms_norm_eps": 1e-5})
    stage = LlamaStage(spec, ParallelLayout(tp=1, pp=1, attention="qkv_linear", fuse_qkv=True), tp=TpGroup(), pp_rank=0)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in stage.parameters():
            p.copy_(torch.randn_like(p))
    records = stage.records()
    column_major = {r.key for r in records if r.column_major}
    assert column_major  # o_proj: the case this is about
    (tmp_path / "cpu").mkdir()
    (tmp_path / "dev").mkdir()
    save_shard(tmp_path / "cpu/m.pt", stage.shard_state(), flavour)
    params = stage.state_dict()
    save_shard(tmp_path / "dev/m.pt", {r.key: params[r.key].contiguous() for r in records}, flavour,
               column_major=column_major)
    cpu = {p.relative_to(tmp_path / "cpu"): p.read_bytes() for p in (tmp_path / "cpu").rglob("*") if p.is_file()}
    dev = {p.relative_to(tmp_path / "dev"): p.read_bytes() for p in (tmp_path / "dev").rglob("*") if p.is_file()}
    assert cpu == dev and len(cpu) >= 1


def test_log_every_reads_every_step_in_batches(tmp_path, nxd_model):
    """--log-every 3 logs the same per-step values as --log-every 1, read back at steps 3 and 4."""
    from nxdtrain.config.options import TrainConfig
    from nxdtrain.train import train
    from tests.nxdtrain.harness import read_log, train_options

    src = nxd_model("mha", attention="separate")
    logs = {}
    for every in (1, 3):
        log = tmp_path / f"every{every}.jsonl"
        history = train(TrainConfig.from_flat({**train_options(optimizer="adamw"), "resume": str(src), "steps": 4,
                                               "device": "cpu", "log_every": every, "log_jsonl": str(log),
                                               "no_checkpoint": True}))
        logs[every] = read_log(log)
        assert [m.step for m in history] == [1, 2, 3, 4]
    for key in ("step", "loss", "grad_norm", "lr", "consumed_samples"):
        assert [r[key] for r in logs[3]] == [r[key] for r in logs[1]], key
    assert logs[1][0]["loss"] != logs[1][3]["loss"]


def test_each_local_rank_gets_its_own_gpu_or_is_refused(monkeypatch):
    """Local rank r opens cuda:r; a rank past the visible GPUs would reach NCCL's "Duplicate GPU detected" at the
    first collective: refused when it opens its device. One visible GPU is the launcher's binding (srun
    --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank): every local rank uses it as cuda:0."""
    from nxdtrain.device import open_device

    opened = []
    monkeypatch.setattr(torch.cuda, "set_device", opened.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert open_device("cuda", 3).torch_device == torch.device("cuda", 3)
    with pytest.raises(TrainError, match=r"local rank 4 has no GPU of its own: this process sees 4 CUDA devices"):
        open_device("cuda", 4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert open_device("cuda", 5).torch_device == torch.device("cuda", 0)
    assert opened == [torch.device("cuda", 3), torch.device("cuda", 0)]


def test_more_local_processes_than_gpus_is_refused_by_the_launcher(tmp_path, monkeypatch, capsys):
    """--nproc 2 on a one-GPU node: one line before any process starts (the launcher's processes see its GPUs)."""
    monkeypatch.setattr("nxdtrain.parallel.dist.spawn", _no_spawn)
    monkeypatch.setattr("nxdtrain.train.resolve_kind", lambda requested: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code = cli.main(["run", "--resume", str(tmp_path / "missing"), "--data", "synthetic", "--device", "cuda",
                     "--nproc", "2", "--no-checkpoint"])
    assert code != 0
    assert capsys.readouterr().err == ("nxdtrain: error: --nproc 2 with --device cuda on a node with 1 CUDA "
                                       "device(s): NCCL runs one rank per GPU; use --nproc 1 or fewer (more nodes "
                                       "for a larger world)\n")


def test_an_fsdp_gathered_stage_on_a_device_is_saved_by_its_file_records():
    """--shard-params on a GPU: the gathered whole tensors live on the device, so the tag writer takes the device
    path (tensors as they are, column-major keys named) through the gathered stage's file_records. (This failed on
    an H200 with AttributeError at the first save; on CPU the other path hid it.)"""
    from nxdtrain.checkpoint.save import _device_shard, _on_host
    from nxdtrain.parallel.fsdp import _SavedStage

    spec = ModelSpec(hidden=16, heads=4, kv_heads=2, head_dim=4, intermediate=24, vocab=32, layers=2, tied=False,
                     config={"hidden_size": 16, "num_attention_heads": 4, "rms_norm_eps": 1e-5})
    stage = LlamaStage(spec, ParallelLayout(tp=1, pp=1, attention="qkv_linear", fuse_qkv=True), tp=TpGroup(), pp_rank=0)
    on_device = {k: v.detach().to("meta") for k, v in stage.state_dict().items()}  # not cpu: the device path
    saved = _SavedStage(stage, on_device)
    assert not _on_host(saved)
    tensors, column_major = _device_shard(saved)
    records = stage.file_records()
    assert list(tensors) == [r.key for r in records]
    assert all(tensors[k] is on_device[k] or tensors[k].device.type == "meta" for k in tensors)
    assert column_major == {r.key for r in records if r.column_major} and column_major
