"""nxdtrain resumes NxD's own training tags (fixtures/nxdt-official/, written by NxD 2.28's save_checkpoint)
with the full optimizer state: checked by continuing step 3 with the recorded gradients in nxdtrain's own
optimizer (:class:`nxdtrain.optim.Optimizer`, restored through :class:`nxdtrain.checkpoint.restore.StageReader` as a
run's rank restores it) and comparing with what NxD itself held after its step 3.

The gradient is set directly on the optimizer's fp32 weights (the recorded gradients are not those of a
data batch); the learning rate is the one nxdtrain's schedule gives step 3 from what the tag recorded.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptconv.core.layout import ParallelLayout
from ckptconv.training import lr_at
from ckptconv.training.nxd_format.read import read_optimizer_state
from nxdtrain.checkpoint.nxd_resume import read_nxd_state
from nxdtrain.checkpoint.restore import StageReader
from nxdtrain.checkpoint.resume import resolve_resume
from nxdtrain.config.options import OptimConfig
from nxdtrain.errors import TrainError
from nxdtrain.model.stage import LlamaStage
from nxdtrain.optim import Optimizer
from nxdtrain.parallel.tp_group import TpGroup
from tests.conftest import fixture_cases
from tests.training.nxd_format.test_read import tag_of

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "nxdt-official"
CASES = fixture_cases(FIXTURES)


def manifest(case: str) -> dict[str, Any]:
    return json.loads((FIXTURES / case / "case.json").read_text())


def reference(case: str, name: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / case / "reference" / f"{name}.safetensors")


def nxd_tag(case: str, tmp: Path) -> Path:
    """A copy of the case's tag with its HF config.json in ``hf/`` (where nxdtrain looks for the model)."""
    m = manifest(case)
    shutil.copytree(FIXTURES / case / m["checkpoint_root"], tmp / m["checkpoint_root"])
    for rel in m["empty_dirs"]:  # git keeps no empty directory; NxD's xser tags have them
        (tmp / rel).mkdir(parents=True, exist_ok=True)
    tag = tmp / m["checkpoint_root"] / m["tag"]
    (tag / "hf").mkdir()
    shutil.copy(FIXTURES / case / "hf" / "config.json", tag / "hf" / "config.json")
    return tag


def precision_of(case: str) -> torch.dtype:
    return torch.bfloat16 if "bfloat16" in manifest(case)["flags"]["model_dtype"] else torch.float32


def restored(tag: Path, run: ParallelLayout, tp_rank: int, dtype: torch.dtype, *,
             same_optimizer: bool = True, pp_rank: int = 0) -> Optimizer:
    """One rank's nxdtrain optimizer after the resume of ``tag`` at layout ``run``, as Trainer restores it."""
    source = resolve_resume(str(tag), weights_only=False)
    assert source.full
    stage = StageReader(source, run, tp_rank=tp_rank, pp_rank=pp_rank, optimizer=True)
    try:
        weights = stage.weights()
        model = LlamaStage(source.spec, run, tp=TpGroup(run.tp, tp_rank), pp_rank=pp_rank,
                           with_inv_freq=source.with_inv_freq, dtype=dtype)
        model.load_shard_state(weights, str(tag))
        optimizer = Optimizer(model, OptimConfig(), initial=weights)
        optimizer.load_state(stage.optimizer_state, stage.hyper.param_groups, same_optimizer=same_optimizer)
        stage.finish()
    finally:
        stage.close()
    return optimizer


def step_lr(case: str, tag: Path) -> float:
    """Step 3's learning rate from nxdtrain's schedule as the tag records it (NxD's CosineAnnealing), checked
    against the one NxD used; the NxDT case's LambdaLR records no schedule: NxD's own value then."""
    m = manifest(case)
    state, _ = read_nxd_state(tag, None, gbs=4)
    assert state.step == m["saved_after_step"]
    used = m["steps"][m["next_step"] - 1]["lr"]
    assert len(set(used)) == 1, used  # nxdtrain steps every group at one lr
    if "schedule" not in state.run:
        assert m["flags"]["style"] == "nxdt"
        return float(used[0])
    cfg = OptimConfig(lr=state.run["lr"], min_lr=state.run["min_lr"], warmup=state.run["warmup"],
                      schedule=state.run["schedule"])
    lr = lr_at(state.step + 1, cfg, decay_steps=state.run["decay_steps"])
    assert lr == pytest.approx(used[0], rel=1e-12)
    return lr


def continue_step_3(case: str, tmp: Path, *,
                    same_optimizer: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    """(nxdtrain's fp32 weights after step 3 from the resumed tag, NxD's, the largest move of a weight)."""
    tag = nxd_tag(case, tmp)
    run = ParallelLayout(tp=1, pp=1, attention="qkv_linear", fuse_qkv=True)
    optimizer = restored(tag, run, 0, precision_of(case), same_optimizer=same_optimizer)
    grads = reference(case, "grads_next.nxd")
    before = {n: optimizer.master[n].detach().clone() for n in optimizer.names}
    for name in optimizer.names:
        optimizer.master[name].grad = grads[name].to(torch.float32)  # exact: bf16 values, NxD clipped by 1
    optimizer.step(step_lr(case, tag))
    after = {n: optimizer.master[n].detach().clone() for n in optimizer.names}
    moved = max((after[n].double() - before[n].double()).abs().max().item() for n in after)
    lost = manifest(case)["flags"]["zero1"] and not manifest(case)["flags"]["use_master_weights_in_ckpt"]
    if lost and precision_of(case) == torch.bfloat16:  # the masters restart from the bf16 weights
        return after, (reference(case, "params_after_next_resumed.nxd") if case == "zero1_bf16"
                       else widened_step_3(case, step_lr(case, tag))), moved
    return after, reference(case, "params_after_next.nxd"), moved


def widened_step_3(case: str, lr: float) -> dict[str, torch.Tensor]:
    """Step 3 of a bf16 ZeRO-1 tag saved without its masters, computed apart from nxdtrain: plain torch AdamW
    from the bf16 weights widened, the moments ckptconv's reader returns, case.json's param groups and the
    recorded gradients (what NxD's own resume computes: ``params_after_next_resumed`` of zero1_bf16)."""
    m = manifest(case)
    held, grads = reference(case, "params_at_save.nxd"), reference(case, "grads_next.nxd")
    group_of = {name: g for g in m["param_groups"] for name in g["params"]}
    out = {}
    for p in read_optimizer_state(tag_of(case)):
        weight = held[p.name].bfloat16().float().requires_grad_(True)
        g = group_of[p.name]
        adamw = torch.optim.AdamW([weight], lr=lr, betas=tuple(g["betas"]), eps=g["eps"],
                                  weight_decay=g["weight_decay"], foreach=False)
        adamw.state[weight] = {"step": torch.tensor(p.step), "exp_avg": p.exp_avg.clone(),
                               "exp_avg_sq": p.exp_avg_sq.clone()}
        weight.grad = grads[p.name].float()
        adamw.step()
        out[p.name] = weight.detach()
    return out


def test_the_widened_reference_is_nxds_own_resume(tmp_path: Path) -> None:
    """The reference of the DCP case (no masters saved, NxD cannot load its DCP tag) computed as NxD's own
    resume of zero1_bf16 did: bit for bit against NxD's recorded result there."""
    nxd = reference("zero1_bf16", "params_after_next_resumed.nxd")
    ours = widened_step_3("zero1_bf16", step_lr("zero1_bf16", nxd_tag("zero1_bf16", tmp_path)))
    for name, value in ours.items():
        torch.testing.assert_close(value, nxd[name], rtol=0, atol=3e-8, msg=name)


FP32_STATE = [c for c in CASES if c != "plain_bf16"]


@pytest.mark.parametrize("case", FP32_STATE)
def test_resume_continues_step_3_as_nxd_did(case: str, tmp_path: Path) -> None:
    """fp32 (fp64) optimizer state: nxdtrain's step 3 equals NxD's within an fp32 ulp (measured: at most
    7.5e-9), while the step moves weights by up to 1e-2 (a wrong moment, step, master or group would be off by
    about that: test_a_fresh_optimizer_is_caught)."""
    ours, nxd, moved = continue_step_3(case, tmp_path)
    assert moved > 5e-3
    assert sorted(ours) == sorted(nxd)
    for name, value in ours.items():
        torch.testing.assert_close(value.double(), nxd[name].double(), rtol=0, atol=3e-8, msg=name)


def test_a_fresh_optimizer_is_caught(tmp_path: Path) -> None:
    """The comparison above can fail: the same step from the masters alone (a fresh AdamW) is far off."""
    ours, nxd, _ = continue_step_3("zero1_bf16_masters", tmp_path, same_optimizer=False)
    assert max((ours[n] - nxd[n]).abs().max().item() for n in ours) > 1e-3


def bf16_ulps_off(ours: dict[str, torch.Tensor], nxd: dict[str, torch.Tensor], held: dict[str, torch.Tensor]) -> float:
    """The largest distance of ``ours`` rounded to bf16 from NxD's bf16 step, in bf16 ulps of the largest operand
    (old or new weight, or the step size lr = 1e-2). Why ulps, and why a few: NxD's AdamW ran in bf16 on XLA, so
    each intermediate (the two moments, the denominator, the update, the decayed weight) was rounded to 8 bits of
    mantissa, each rounding off by up to half an ulp of its own size; nxdtrain steps the widened values in fp32
    and rounds once. A handful of such roundings bound the difference by a few ulps of the largest operand
    (measured: 3.0 at most, 2/3 of the elements equal; a zeroed exp_avg is 129 ulps off: tests/training/nxd_format/test_read.py)."""
    from tests.training.nxd_format.test_read import bf16_ulp

    worst = 0.0
    for name, value in ours.items():
        got, want = value.bfloat16().double(), nxd[name].double()
        scale = torch.stack([got.abs(), want.abs(), held[name].double().abs(), torch.full_like(want, 1e-2)]).amax(0)
        worst = max(worst, ((got - want).abs() / bf16_ulp(scale)).max().item())
    return worst


def test_bf16_moments_continue_within_a_few_bf16_ulps(tmp_path: Path) -> None:
    """ZeRO-1 off with a bf16 model: NxD's AdamW ran in bf16 (bf16 moments, no masters); nxdtrain's bf16 run
    steps fp32 masters widened from the weights with the moments widened, so its result rounded to bf16
    is compared in bf16 ulps of the largest operand, as tests/training/nxd_format/test_read.py does (measured: at most
    3.0, two thirds of the elements equal)."""
    ours, nxd, moved = continue_step_3("plain_bf16", tmp_path)
    assert moved > 5e-3
    worst = bf16_ulps_off(ours, nxd, reference("plain_bf16", "params_at_save.nxd"))
    assert worst <= 4, worst


def test_weights_only_resume_of_a_masters_only_tag_reads_the_masters(tmp_path: Path) -> None:
    """--weights-only of NxD's masters-only tag (model files without tensors): the weights are the masters."""
    case = "zero1_bf16_masters_only_xser"
    source = resolve_resume(str(nxd_tag(case, tmp_path)), weights_only=True)
    assert not source.full and source.nxd
    stage = StageReader(source, source.layout, tp_rank=0, pp_rank=0, optimizer=False)
    try:
        weights = stage.weights()
        stage.finish()
    finally:
        stage.close()
    held = reference(case, "params_at_save.nxd")
    assert sorted(weights) == sorted(held) and all(torch.equal(weights[k], held[k]) for k in held)


def as_shards(tensors: dict[str, torch.Tensor], like: Path, out: Path) -> Path:
    """``tensors`` (full tensors in NxD names at tp 1) as a one-shard NxD checkpoint beside the tag ``like``'s
    config: what each rank of another layout reads of them is then the plan's slice, as for the weights."""
    (out / "model").mkdir(parents=True)
    torch.save({k: v.contiguous() for k, v in tensors.items()}, out / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    (out / "hf").mkdir()
    shutil.copy(like / "hf" / "config.json", out / "hf" / "config.json")
    return out


def on_rank(tensors: Path, run: ParallelLayout, tp_rank: int, pp_rank: int = 0) -> dict[str, torch.Tensor]:
    stage = StageReader(resolve_resume(str(tensors), weights_only=False), run, tp_rank=tp_rank, pp_rank=pp_rank,
                        optimizer=False)
    try:
        return stage.weights()
    finally:
        stage.close()


@pytest.mark.parametrize("case", ["zero1_bf16_masters_only_xser", "plain_fp32", "zero1_bf16_dcp"])
def test_resume_at_tp2_continues_step_3_as_nxd_did(case: str, tmp_path: Path) -> None:
    """The tag (tp 1) resumed at tp 2: each rank reads its slices of NxD's moments and masters through the
    reshard plan; its step 3 with its slice of the recorded gradients is its slice of NxD's step 3."""
    tag = nxd_tag(case, tmp_path / "tag")
    assert resolve_resume(str(tag), weights_only=False).nxd
    step_3_at(case, tag, tag, ParallelLayout(tp=2, pp=1, attention="qkv_linear", fuse_qkv=True), tmp_path)


def step_3_at(case: str, nxds: Path, tag: Path, run: ParallelLayout, tmp_path: Path) -> None:
    """Every (tp, pp) rank of ``run`` resumed from ``tag`` (NxD's tag ``nxds`` or one made from it) steps its slice
    of the recorded gradients to its slice of NxD's step 3: within an fp32 ulp for fp32 (fp64) state. For
    plain_bf16 (bf16 moments) within 4 bf16 ulps of NxD's (test_bf16_moments_continue_within_a_few_bf16_ulps),
    and bit for bit the slice of nxdtrain's direct resume at NxD's tp 1: AdamW is elementwise, so no layout may
    change an element."""
    # nxdtrain's step 3 from NxD's tag at its tp 1; NxD's own step 3 (or, without masters, the widened one)
    direct, nxd, _ = continue_step_3(case, tmp_path / "tp1")
    bf16 = case == "plain_bf16"
    grads = as_shards(reference(case, "grads_next.nxd"), nxds, tmp_path / "grads")
    after = as_shards(direct if bf16 else nxd, nxds, tmp_path / "after")
    if bf16:
        nxd_after = as_shards(nxd, nxds, tmp_path / "nxd_after")
        held = as_shards(reference(case, "params_at_save.nxd"), nxds, tmp_path / "held")
    lr = step_lr(case, nxds)
    for pp_rank in range(run.pp):
        for tp_rank in range(run.tp):
            optimizer = restored(tag, run, tp_rank, precision_of(case), pp_rank=pp_rank)
            mine = on_rank(grads, run, tp_rank, pp_rank)
            for name in optimizer.names:
                optimizer.master[name].grad = mine[name].to(torch.float32)
            optimizer.step(lr)
            ours = {name: optimizer.master[name].detach() for name in optimizer.names}
            want = on_rank(after, run, tp_rank, pp_rank)
            for name, value in ours.items():
                torch.testing.assert_close(value.double(), want[name].double(), rtol=0, atol=0.0 if bf16 else 3e-8,
                                           msg=f"tp rank {tp_rank} pp rank {pp_rank}: {name}")
            if bf16:
                worst = bf16_ulps_off(ours, on_rank(nxd_after, run, tp_rank, pp_rank),
                                      on_rank(held, run, tp_rank, pp_rank))
                assert worst <= 4, (tp_rank, pp_rank, worst)


# --------------------------------------------------------------------------------------------
# End to end: nxdtrain run --resume <NxD's tag>, a few steps from data

# NxD's example schedule as the fixtures ran it (case.json "scheduler"): a resume with other values is refused
SCHEDULE = ["--schedule", "CosineAnnealing", "--lr", "0.01", "--min-lr", "0.001", "--warmup", "2", "--decay-steps", "10"]


def nxdtrain_run(tag: Path, log: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "nxdtrain.cli", "run", "--resume", str(tag), "--steps", "4", "--data", "synthetic",
            "--seq-len", "16", "--gbs", "4", "--mbs", "1", "--log-jsonl", str(log), "--no-checkpoint", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=240)


def test_run_resumes_nxds_masters_only_tag_at_four_layouts(tmp_path: Path) -> None:
    """Steps 3 and 4 from NxD's masters-only tag (weights from the masters), at the tag's tp 1, resharded to
    tp 2 and to pp 2 on load, and over dp 2 with nxdtrain's ZeRO-1: the losses agree (fp32), step 3 runs at
    NxD's lr, and the log says what was carried."""
    tag = nxd_tag("zero1_bf16_masters_only_xser", tmp_path)
    logs = []
    for k, layout in enumerate((["--tp", "1", "--nproc", "1"], ["--tp", "2", "--nproc", "2"],
                                ["--tp", "1", "--nproc", "2", "--zero1"], ["--pp", "2", "--nproc", "2"])):
        log = tmp_path / f"run{k}.jsonl"
        done = nxdtrain_run(tag, log, *SCHEDULE, "--precision", "fp32", *layout)
        assert done.returncode == 0, done.stderr[-2000:]
        logs.append([json.loads(line) for line in log.read_text().splitlines()])
        if k == 2:
            assert "-> tp 1 pp 1 kvm 1 qkv_linear fused, ZeRO-1 over 2 dp ranks" in done.stderr
        if k == 0:
            said = done.stderr
            assert "written by NxD's own code" in said and "starting at step 2 of 4" in said
            assert ("AdamW's step and moments and the fp32 masters from its optimizer files (zero1, dp 1), step 2, "
                    "the schedule from scheduler.pt (CosineAnnealing, warmup 2, max steps 10") in said
            assert "weights: NxD's master weights in optim/" in said
            assert "the data continues at sample 8 = step 2 x --gbs 4" in said
    assert [r["step"] for r in logs[0]] == [3, 4] and logs[0][0]["lr"] == pytest.approx(0.01, rel=1e-12)
    assert logs[0][0]["consumed_samples"] == 12
    for other in logs[1:]:
        for one, two in zip(logs[0], other, strict=True):
            assert one["loss"] == pytest.approx(two["loss"], abs=1e-5)


def test_run_resumes_an_nxdt_tag_and_names_what_it_cannot_carry(tmp_path: Path) -> None:
    """NxDT's tag: the data position from the tag name; its LinearAnnealingWithWarmUp (a LambdaLR) records no
    warmup or max steps, so this run's flags are used and the log says so before step 1."""
    tag = nxd_tag("nxdt_zero1_bf16_masters_xser", tmp_path)
    done = nxdtrain_run(tag, tmp_path / "log.jsonl", "--schedule", "LinearAnnealingWithWarmUp", "--lr", "0.01",
                        "--warmup", "2", "--decay-steps", "10")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "NxDT's own tag" in done.stderr and "precision bf16 (recorded in the checkpoint)" in done.stderr
    assert "not carried: schedule, min lr, warmup steps, decay steps" in done.stderr
    assert "the data continues at sample 8 (the tag name's consumed_samples)" in done.stderr
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["consumed_samples"] for r in log] == [12, 16]


def test_run_with_another_schedule_than_nxds_is_refused(tmp_path: Path) -> None:
    tag = nxd_tag("zero1_fp32", tmp_path)
    done = nxdtrain_run(tag, tmp_path / "log.jsonl", *SCHEDULE[:-4], "--warmup", "3", "--decay-steps", "10")
    assert done.returncode != 0 and "warmup steps 2 -> 3" in done.stderr and "--override-schedule" in done.stderr
    assert not (tmp_path / "log.jsonl").exists()


def test_steps_that_disagree_are_refused(tmp_path: Path) -> None:
    tag = nxd_tag("plain_fp32", tmp_path)
    user = torch.load(tag / "user_content.pt", weights_only=True)
    torch.save({**user, "total_steps": 3}, tag / "user_content.pt")
    with pytest.raises(TrainError, match="the recorded steps disagree: AdamW's step 2, total_steps 3, the scheduler's "
                                         "last_epoch 2; resume with --weights-only"):
        read_nxd_state(tag, None, gbs=4)


@pytest.mark.parametrize("case", ["zero1_bf16_masters_only_xser", "plain_fp32"])
def test_a_rank_parses_nxds_optimizer_once(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           nxd_optimizers_made: list[Path]) -> None:
    """A rank's restore reads the weights' source (NxD's masters, or the model files) and the optimizer state
    through one parse of NxD's optimizer files (it parsed them twice: for the weights' notes, then the state),
    and opens the model file once (its headers were read by a reader of their own, then again to read it)."""
    import ckptconv.io.nxd_read as nxd_io

    tag = nxd_tag(case, tmp_path)
    shards: list[Path] = []
    real_open = nxd_io.open_shard
    monkeypatch.setattr(nxd_io, "open_shard", lambda path, *a: shards.append(path) or real_open(path, *a))
    run = ParallelLayout(tp=2, pp=1, attention="qkv_linear", fuse_qkv=True)
    source = resolve_resume(str(tag), weights_only=False)
    nxd_optimizers_made.clear()  # resolve_resume looks at the tag before (in prepare), not in the rank's restore
    shards.clear()
    stage = StageReader(source, run, tp_rank=1, pp_rank=0, optimizer=True)
    try:
        weights = stage.weights()
        state = stage.optimizer_state("model.norm.weight")
        stage.finish()
    finally:
        stage.close()
    assert len(nxd_optimizers_made) == 1 and len(shards) == 1, shards
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} | ({"master"} if "masters" in case else set())
    held = reference(case, "params_at_save.nxd")  # fp32 weights, or the masters: what NxD held
    assert torch.equal(weights["model.norm.weight"], held["model.norm.weight"])


def test_the_workers_take_the_launchers_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--nproc's launcher resolves --resume and reads the tag's state once and hands both to its workers (they
    each read every shard's header and parsed NxD's optimizer files again): what it passes survives the trip to a
    process (pickled), and a worker's prepare given it opens no file of the tag yet plans the same run."""
    import os
    import pickle

    import nxdtrain.parallel.dist
    from nxdtrain.cli import main
    from nxdtrain.train import prepare

    tag = nxd_tag("zero1_bf16_masters_only_xser", tmp_path)
    passed: list[tuple[Any, ...]] = []
    monkeypatch.setattr(nxdtrain.parallel.dist, "spawn", lambda fn, args, nprocs, **kw: passed.append(args) or 0)
    argv = ["run", "--resume", str(tag), "--steps", "4", "--data", "synthetic", "--seq-len", "16", "--gbs", "4",
            "--mbs", "1", "--no-checkpoint", "--precision", "fp32", "--nproc", "2", *SCHEDULE]
    assert main(argv) == 0
    config, data_checks, resolved = pickle.loads(pickle.dumps(passed[0]))  # as a worker receives them
    launcher = prepare(config, 2)
    assert resolved.source == launcher.source and resolved.notes == launcher.resolved.notes

    opened: list[str] = []

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and isinstance(args[0], (str, os.PathLike)) and str(args[0]).startswith(str(tag)):
            opened.append(str(args[0]))

    sys.addaudithook(hook)  # stays installed (an audit hook cannot be removed): it only records while `tag` is read
    before = len(opened)
    worker = prepare(config, 2, data_checks, resolved)
    assert opened[before:] == []
    launcher_again = prepare(config, 2)
    assert len(opened) > before  # the hook sees the tag's files when prepare reads them
    assert worker.resume_notes == launcher_again.resume_notes and worker.source == launcher_again.source
    assert worker.resume_state is not None and launcher_again.resume_state is not None
    ours, again = worker.resume_state, launcher_again.resume_state
    assert (ours.step, ours.consumed_samples, ours.options, ours.run) == (
        again.step, again.consumed_samples, again.options, again.run)
    assert ours.step == 2 and ours.consumed_samples == 8  # NxD's step 2 x --gbs 4


def test_hf_config_gives_the_model_of_a_tag_without_one_and_leaves_the_tag_untouched(tmp_path: Path) -> None:
    """NxD's own tags hold no HF config: ``--hf-config PATH`` gives it (the tag is only read), and the run
    continues as from the same tag with the config copied in; a tag that records one refuses a second."""
    tag = nxd_tag("zero1_bf16_masters", tmp_path)
    config = FIXTURES / "zero1_bf16_masters" / "hf" / "config.json"
    with_copy = tmp_path / "with.jsonl"
    done = nxdtrain_run(tag, with_copy, *SCHEDULE, "--precision", "fp32")
    assert done.returncode == 0, done.stderr[-2000:]
    shutil.rmtree(tag / "hf")
    before = {p: p.stat().st_mtime_ns for p in tag.rglob("*")}
    done = nxdtrain_run(tag, tmp_path / "none.jsonl", *SCHEDULE, "--precision", "fp32")
    assert done.returncode != 0 and "so the model is unknown; pass --hf-config PATH/config.json" in done.stderr
    given = tmp_path / "given.jsonl"
    done = nxdtrain_run(tag, given, *SCHEDULE, "--precision", "fp32", "--hf-config", str(config))
    assert done.returncode == 0, done.stderr[-2000:]
    assert {p: p.stat().st_mtime_ns for p in tag.rglob("*")} == before  # nothing written into the tag
    assert given.read_text() and [json.loads(x)["loss"] for x in given.read_text().splitlines()] == \
        [json.loads(x)["loss"] for x in with_copy.read_text().splitlines()]
    (tag / "hf").mkdir()
    shutil.copy(config, tag / "hf" / "config.json")
    done = nxdtrain_run(tag, tmp_path / "both.jsonl", *SCHEDULE, "--precision", "fp32", "--hf-config", str(config))
    assert done.returncode != 0
    assert f"--hf-config {config}: {tag} records its model config ({tag / 'hf' / 'config.json'}); drop" in done.stderr


def test_an_optimizer_flag_that_differs_from_nxds_param_groups_is_refused(tmp_path: Path) -> None:
    tag = nxd_tag("zero1_bf16_masters", tmp_path)  # NxD's groups: weight decay 0.01 (norms 0), betas (0.9, 0.95)
    done = nxdtrain_run(tag, tmp_path / "log.jsonl", *SCHEDULE, "--weight-decay", "0.1", "--beta1", "0.8")
    assert done.returncode != 0 and not (tmp_path / "log.jsonl").exists()
    assert (f"--resume: --weight-decay 0.1 ({tag} records 0.01); --beta1 0.8 ({tag} records 0.9): the tag's AdamW "
            "param groups would be loaded over the flag") in done.stderr
    done = nxdtrain_run(tag, tmp_path / "log.jsonl", *SCHEDULE, "--weight-decay", "0.01")  # the recorded value
    assert done.returncode == 0, done.stderr[-2000:]
