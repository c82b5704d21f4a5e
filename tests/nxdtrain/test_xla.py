"""nxdtrain on torch-xla, one rank on XLA:CPU (the XLA lane: ``make test-xla``, which sets ``PJRT_DEVICE=CPU``;
skipped without torch_xla). Runs name ``--device`` explicitly: ``auto`` never picks XLA:CPU.

The cpu path is the reference: same shards, same rows, same options. Every run here is in-process
(one rank, a world of 1), so the XLA compilation cache and metrics are this test process's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nxdtrain.device import torch_xla_api  # noqa: E402

if torch_xla_api() is None:
    pytest.skip("torch_xla does not import here (the XLA lane: make setup-xla test-xla)", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

from ckptconv.core.layout import shard_file  # noqa: E402
from ckptconv.io.nxd_read import load_shard  # noqa: E402
from nxdtrain.checkpoint.tags import optim_file  # noqa: E402
from nxdtrain.config.options import TrainConfig  # noqa: E402
from nxdtrain.parallel.dist import detect_env, init_world  # noqa: E402
from nxdtrain.train import Trainer, export, prepare, train  # noqa: E402
from tests.conftest import hf_state, warns_no_tokenizer  # noqa: E402
from tests.nxdtrain.harness import read_log, train_options  # noqa: E402
from tests.nxdtrain.parallel.test_context import ADAMW  # noqa: E402

# The XLA runtime starts before any backward of this process: autograd sizes its per-device queues at
# its first backward, and a cpu run here comes first (one real run uses one device, so only tests need this).
torch_xla.device()
TOL = 1e-5
LAYOUTS = {"fused": dict(attention="qkv_linear", fuse_qkv=True), "separate": dict(attention="separate")}


def run(tmp: Path, name: str, device: str, *, log_name: str | None = None, **options: Any) -> list[dict[str, Any]]:
    """``nxdtrain run`` in this process, checkpoints in ``tmp/name``; the jsonl log of the run."""
    log = tmp / f"{log_name or name}.jsonl"
    train(TrainConfig.from_flat({**train_options(optimizer="adamw"), "device": device, "log_jsonl": str(log),
                                 "checkpoint_dir": str(tmp / name), **options}))
    return read_log(log)


@pytest.mark.parametrize("layout,mbs", [("fused", 1), ("separate", 1), ("fused", 4)],
                         ids=["fused-4microbatches", "separate-4microbatches", "fused-1microbatch"])
def test_xla_matches_cpu(tmp_path, hf_model, nxd_model, layout, mbs):
    """5 steps on XLA:CPU give the cpu path's per-step losses and exported weights within 1e-5 (fp32)."""
    src = nxd_model("gqa2", **LAYOUTS[layout])
    options = dict(resume=str(src), steps=5, gbs=4, mbs=mbs, export_hf=None)
    cpu = run(tmp_path, "cpu", "cpu", **options)
    xla = run(tmp_path, "xla", "xla", **options)
    assert [r["step"] for r in xla] == [1, 2, 3, 4, 5]
    assert len(cpu) == 5 and cpu[0]["loss"] > 1.0
    worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(cpu, xla, strict=True))
    assert worst <= TOL, ([r["loss"] for r in cpu], [r["loss"] for r in xla])
    assert max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(cpu, xla, strict=True)) <= TOL
    with warns_no_tokenizer():
        export(tmp_path / "cpu", tmp_path / "cpu-hf")
    with warns_no_tokenizer():
        export(tmp_path / "xla", tmp_path / "xla-hf")
    got, want = hf_state(tmp_path / "xla-hf"), hf_state(tmp_path / "cpu-hf")
    assert set(got) == set(want)
    assert max((got[k] - want[k]).abs().max().item() for k in got) <= TOL
    initial = hf_state(hf_model("gqa2"))
    assert max((want[k] - initial[k]).abs().max().item() for k in want) > 1e-4  # training changed the weights, so the comparison above is not of two copies of the input


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_families_on_xla_match_cpu(tmp_path, hf_model, nxd_model, family):
    """Qwen2's q/k/v biases, Qwen3's q/k norms with tied embeddings, Mistral's window of 16 over rows of 32: 3 steps
    on XLA:CPU give the cpu path's losses and exported weights within 1e-5 (fp32). AdamW with eps 1e-6 (test_context_parallel's
    ADAMW): at the default 1e-8 one v_proj element of Qwen2 and Qwen3 ended 5e-5 apart while every loss agreed within
    2e-6, AdamW turning fp32 rounding of a tiny gradient into a step (ADAMW's comment says why); updates stay ~1e-4."""
    src = nxd_model(family, attention="qkv_linear", fuse_qkv=True)
    options = dict(resume=str(src), steps=3, gbs=4, mbs=2, seq_len=32 if family == "mistral" else 16, export_hf=None,
                   **ADAMW)
    cpu = run(tmp_path, "cpu", "cpu", **options)
    xla = run(tmp_path, "xla", "xla", **options)
    assert [r["step"] for r in xla] == [1, 2, 3]
    worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(cpu, xla, strict=True))
    assert worst <= TOL, ([r["loss"] for r in cpu], [r["loss"] for r in xla])
    with warns_no_tokenizer():
        export(tmp_path / "cpu", tmp_path / "cpu-hf")
    with warns_no_tokenizer():
        export(tmp_path / "xla", tmp_path / "xla-hf")
    got, want = hf_state(tmp_path / "xla-hf"), hf_state(tmp_path / "cpu-hf")
    assert set(got) == set(want)
    assert max((got[k] - want[k]).abs().max().item() for k in got) <= TOL
    initial = hf_state(hf_model(family))
    assert max((want[k] - initial[k]).abs().max().item() for k in want) > 1e-4  # training moved the weights


@pytest.mark.parametrize("log_every,seq_len", [(1, 12), (4, 8)])
def test_compiles_once_then_never(tmp_path, nxd_model, monkeypatch, log_every, seq_len):
    """The compile count after step 3 equals the count after step 10, and nothing reads the device inside a step.

    Each case has its own row length, so its graphs are new to this process's compilation cache.
    """
    src = nxd_model("gqa2", attention="qkv_linear", fuse_qkv=True)
    seen: dict[int, int] = {}
    original = Trainer.train_step

    def counted(self: Trainer, step: int) -> Any:
        out = original(self, step)
        seen[step] = _count("CompileTime")
        return out

    monkeypatch.setattr(Trainer, "train_step", counted)
    met.clear_all()
    # lr goes up (warmup), down (cosine) and to min_lr 0 at step 10: an lr baked into the graph would recompile.
    log = run(tmp_path, "run", "xla", resume=str(src), steps=10, warmup=2, min_lr=0.0, log_every=log_every,
              clip_grad=0.5, seq_len=seq_len)
    assert [r["step"] for r in log] == list(range(1, 11))
    assert log[-1]["lr"] == 0.0 and log[2]["grad_norm"] > 0.5  # clipping was active
    assert seen[3] >= 1 and _count("ExecuteTime") >= 10
    assert seen[10] == seen[3], seen
    # The only host reads: loss, grad norm and parameter norm of each step, at the log points (after the step's sync).
    assert met.executed_fallback_ops() == ["aten::_local_scalar_dense"]
    assert met.counter_value("aten::_local_scalar_dense") == 3 * 10


def _count(metric: str) -> int:
    data = met.metric_data(metric)
    return int(data[0]) if data else 0


def test_resume_equals_straight_run(tmp_path, nxd_model):
    """On xla, 2 steps + resume + 2 steps == 4 steps: losses and saved weights and optimizer state, bitwise."""
    src = nxd_model("gqa2", attention="qkv_linear", fuse_qkv=True)
    options = dict(steps=4, decay_steps=4, warmup=2, gbs=4, mbs=2)
    straight = run(tmp_path, "a", "xla", resume=str(src), **options)
    first = run(tmp_path, "b", "xla", resume=str(src), **{**options, "steps": 2})
    resumed = run(tmp_path, "b", "xla", resume=str(tmp_path / "b"), log_name="b2", **options)
    assert [r["step"] for r in first + resumed] == [1, 2, 3, 4]
    for key in ("loss", "lr", "grad_norm", "consumed_samples"):
        assert [r[key] for r in first + resumed] == [r[key] for r in straight], key
    for part in ("model", "optim"):
        for file in sorted((tmp_path / "a/step_4" / part).iterdir()):
            assert file.read_bytes() == (tmp_path / "b/step_4" / part / file.name).read_bytes(), file


def _restored(tag: Path, device: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model and optimizer state a run resuming from ``tag`` on ``device`` starts with, on the host."""
    config = TrainConfig.from_flat({**train_options(optimizer="adamw"), "resume": str(tag), "device": device,
                                    "steps": 2, "no_checkpoint": True})
    plan = prepare(config, 1)
    dev = init_world(detect_env({}), 60.0, plan.device)
    try:
        trainer = Trainer(plan, dev)
        assert trainer.step == 2 and next(trainer.model.parameters()).device.type == device
        model = {k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}
        optim = _state_tensors(trainer.optimizer.state_dict())
    finally:
        dist.destroy_process_group()
    return model, optim


def _saved_optim(tag: Path) -> dict[str, torch.Tensor]:
    return _state_tensors(torch.load(optim_file(tag, tp_rank=0, pp_rank=0, dp_rank=0), weights_only=True))


def _state_tensors(optimizer_file: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The per-parameter tensors of an optimizer file in the neutral form (format 2), by key, on the host."""
    assert optimizer_file["format"] == 2
    return {k: v.detach().cpu() for k, v in optimizer_file.items() if k.startswith("state.")}


@pytest.mark.parametrize("xser", [False, True], ids=["plain", "xser"])
def test_tags_move_between_xla_and_cpu(tmp_path, nxd_model, xser):
    """A tag written on xla resumes on cpu and the reverse, with bitwise weights and optimizer state."""
    import torch_xla.utils.serialization as xser_io

    src = nxd_model("gqa2", attention="qkv_linear", fuse_qkv=True)  # o_proj is stored column-major here
    for saver, loader in (("xla", "cpu"), ("cpu", "xla")):
        run(tmp_path, saver, saver, resume=str(src), steps=2, xser=xser)
        tag = tmp_path / saver / "step_2"
        shard = load_shard(tag / shard_file(tp_rank=0, pp_rank=0))
        model, optim = _restored(tag, loader)
        assert set(model) == set(shard)
        for key, value in shard.items():
            assert torch.equal(model[key], value), (saver, loader, key)
        saved = _saved_optim(tag)
        assert set(optim) == set(saved) and len(saved) > 10
        for key, value in saved.items():
            assert torch.equal(optim[key].float(), value.float()), (saver, loader, key)
        if xser:  # torch-xla's own reader takes our xser split files too
            theirs = xser_io.load(str(tag / shard_file(tp_rank=0, pp_rank=0)))
            assert set(theirs) == set(shard)
            assert all(torch.equal(theirs[k].cpu(), shard[k]) for k in shard)
    # ckptconv to-hf exports a tag written on xla: HF weights are the shard's (tp 1: same names but for q/k/v).
    with warns_no_tokenizer():
        export(tmp_path / "xla" / "step_2", tmp_path / "hf")
    hf = hf_state(tmp_path / "hf")
    shard = load_shard(tmp_path / "xla/step_2" / shard_file(tp_rank=0, pp_rank=0))
    same = [k for k in hf if k in shard]
    assert len(same) >= 10 and all(torch.equal(hf[k], shard[k]) for k in same)
    gate_up = shard["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(torch.cat([hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]]),
                       gate_up)
