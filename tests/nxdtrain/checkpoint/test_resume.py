"""Checkpoints: 4 steps == 2 steps + resume + 2 steps (bitwise), retention, the done marker, resume errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckptconv.cli.main import main as ckptconv_main
from nxdtrain.checkpoint.resume import resolve_resume
from nxdtrain.config.options import TrainConfig
from nxdtrain.errors import TrainError
from nxdtrain.train import prepare
from tests.nxdtrain.harness import run_world, train_options

RESUME_CASES = {
    # tp 2 x pp 2, fp32, 1F1B, xser split model shards
    "tp2-pp2-fp32-xser": dict(tp=2, pp=2, precision="fp32", xser=True),
    # tp 2 x dp 2, bf16 with fp32 masters, optimizer state sharded over dp (ZeRO-1)
    "tp2-dp2-bf16-zero1": dict(tp=2, pp=1, precision="bf16", zero1=True),
}


def tree_bytes(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_continues_bitwise(tmp_path, nxd_model, case):
    """Losses, model shards and optimizer state after 2 + 2 steps equal those after 4 uninterrupted steps."""
    extra = RESUME_CASES[case]
    src = nxd_model("gqa", tp=2, pp=extra["pp"], attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=2)
    options = train_options(optimizer="adamw", steps=4, decay_steps=4, warmup=2, gbs=8, mbs=2, data="synthetic",
                            **{k: v for k, v in extra.items() if k != "precision"}, precision=extra["precision"])
    straight = run_world(4, resume=str(src), checkpoint_dir=str(tmp_path / "a"), log_jsonl=str(tmp_path / "a.jsonl"),
                         **options)
    first = run_world(4, resume=str(src), checkpoint_dir=str(tmp_path / "b"), log_jsonl=str(tmp_path / "b.jsonl"),
                      **{**options, "steps": 2})
    resumed = run_world(4, resume=str(tmp_path / "b"), checkpoint_dir=str(tmp_path / "b"),
                        log_jsonl=str(tmp_path / "b2.jsonl"), **options)
    assert [r["step"] for r in first + resumed] == [1, 2, 3, 4]
    if extra.get("zero1"):  # partitions saved over dp 2 load at dp 1 too: resharded on load, said before any step
        plan = prepare(TrainConfig.from_flat({**options, "resume": str(tmp_path / "b"),
                                              "checkpoint_dir": str(tmp_path / "c")}), world_size=2)
        assert plan.resume_notes[0] == ("resharding on load (weights and optimizer state, each rank reads its slices "
                                        "of the tag): tp 2 pp 1 kvm 2 qkv_linear fused, ZeRO-1 over 2 dp ranks -> "
                                        "tp 2 pp 1 kvm 2 qkv_linear fused, ZeRO-1 over 1 dp rank")
        assert plan.resume_notes[1].startswith("not carried exactly: RNG states (saved by a world of 4, this run has 2 ranks")
    for key in ("loss", "lr", "grad_norm", "consumed_samples"):
        assert [r[key] for r in first + resumed] == [r[key] for r in straight], key
    for part in ("model", "optim"):
        assert tree_bytes(tmp_path / "a/step_4" / part) == tree_bytes(tmp_path / "b/step_4" / part), part
    # The tags are complete NxD checkpoints for ckptconv too.
    assert ckptconv_main(["inspect", str(tmp_path / "b/step_4"), "--json"]) == 0


def test_retention_and_done_marker(tmp_path, nxd_model, capsys):
    """--keep 2 leaves the newest two tags; a tag without 'done' is never resumed."""
    src = nxd_model("mha", tp=1, pp=2, attention="separate")
    options = train_options(optimizer="sgd", steps=4, checkpoint_freq=1, keep=2, pp=2, gbs=2)
    root = tmp_path / "ckpt"
    straight = run_world(2, resume=str(src), checkpoint_dir=str(root), log_jsonl=str(tmp_path / "a.jsonl"), **options)
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4"]
    meta = json.loads((root / "step_4/ckptconv.json").read_text())
    assert meta["extra"]["nxdtrain"] == {"step": 4, "consumed_samples": 8, "run": meta["extra"]["nxdtrain"]["run"]}
    assert len(meta["extra"]["nxdtrain"]["run"]) == 16  # the run's id, the same in every tag of the run
    assert {"model/dp_rank_00_tp_rank_00_pp_rank_01.pt", "optim/dp_rank_00_tp_rank_00_pp_rank_01.pt",
            "user_content.pt", "scheduler.pt", "hf/config.json"} <= set(meta["files"])

    (root / "step_4/done").unlink()  # as if the save of step 4 had been cut short
    source = resolve_resume(str(root), weights_only=False)
    assert source.root == root / "step_3" and source.full
    assert source.case == f"full state from newest completed tag step_3 of {root}"
    with pytest.raises(TrainError, match="tag has no 'done' marker"):
        resolve_resume(str(root / "step_4"), weights_only=False)
    # Resuming the root redoes step 4 from step 3, to the same loss.
    redo = run_world(2, resume=str(root), checkpoint_dir=str(root), log_jsonl=str(tmp_path / "b.jsonl"), **options)
    assert [(r["step"], r["loss"]) for r in redo] == [(4, straight[-1]["loss"])]
    assert (root / "step_4/done").is_file()
    # A fresh run may not write into this directory: a later --resume of it would skip the fresh run's tags.
    fresh = TrainConfig.from_flat({**options, "resume": str(src), "checkpoint_dir": str(root)})
    with pytest.raises(TrainError, match=r"ckpt: holds step_4, past this run's start \(step 0\); use an empty"):
        prepare(fresh, world_size=2)


def test_resume_cases_and_errors(tmp_path, nxd_model):
    src = nxd_model("gqa", tp=2, pp=1, attention="qkv_linear", kv_size_multiplier=2)
    converted = resolve_resume(str(src), weights_only=False)
    assert not converted.full
    assert converted.case == f"weights only from {src} (no optimizer state (a converted checkpoint)): step 0, fresh optimizer"
    with pytest.raises(TrainError, match=r"^--resume /no/such/dir: no such directory$"):
        resolve_resume("/no/such/dir", weights_only=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TrainError, match="^--resume .*: no NxD shards found"):
        resolve_resume(str(empty), weights_only=False)
    # A tag copied without its markers but with optimizer state is an interrupted save.
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    (broken / "optim").mkdir()
    with pytest.raises(TrainError, match="has optim/ but no 'done' marker"):
        resolve_resume(str(broken), weights_only=False)


def test_layout_not_given_is_the_tags(tmp_path, nxd_model):
    """A tp-2 tag resumed without --tp keeps tp 2 (as ckptconv's verbs keep the source's layout): nothing resharded,
    nothing said, dp = world / the tag's tp; --tp 1 reshards and says so once (an older nxdtrain took tp 1 silently)."""
    src = nxd_model("gqa", tp=2, pp=1, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=2)
    run_world(2, resume=str(src), checkpoint_dir=str(tmp_path / "run"), log_jsonl=str(tmp_path / "a.jsonl"),
              **train_options(tp=2, steps=1, decay_steps=3))
    tag = tmp_path / "run" / "step_1"
    shards = resolve_resume(str(tag), weights_only=False).layout
    assert (shards.tp, shards.kvm, shards.fuse_qkv) == (2, 2, True)  # what the tag records (ckptconv.json)
    options = train_options(resume=str(tag), checkpoint_dir=str(tmp_path / "next"), decay_steps=3)
    kept = prepare(TrainConfig.from_flat(options), world_size=4)
    assert (kept.layout, kept.dp, kept.config.parallel.tp, kept.config.parallel.pp) == (shards, 2, 2, 1)
    assert not [note for note in kept.resume_notes if "resharding" in note], kept.resume_notes
    asked = prepare(TrainConfig.from_flat({**options, "tp": 1}), world_size=4)
    assert asked.dp == 4
    assert [note for note in asked.resume_notes if "resharding" in note] == [
        "resharding on load (weights and optimizer state, each rank reads its slices of the tag): tp 2 pp 1 kvm 2 "
        "qkv_linear fused, no ZeRO-1 -> tp 1 pp 1 kvm 1 qkv_linear fused, no ZeRO-1"]


def test_refusals_name_the_shards_values_the_user_did_not_give(tmp_path, nxd_model):
    """A check that needs the run's pp names the shards' pp when --pp was not given, the flag when it was."""
    src = nxd_model("gqa", tp=1, pp=2, attention="separate")
    options = train_options(resume=str(src), no_checkpoint=True, shard_params=True)
    with pytest.raises(TrainError, match=r"^--shard-params with the shards' pp 2: FSDP2 is not wired"):
        prepare(TrainConfig.from_flat(options), world_size=2)
    with pytest.raises(TrainError, match=r"^--shard-params with --pp 2: FSDP2 is not wired"):
        TrainConfig.from_flat({**options, "pp": 2})
    assert prepare(TrainConfig.from_flat({**options, "pp": 1}), world_size=2).layout.pp == 1
    tp2 = nxd_model("gqa", tp=2, pp=1, attention="qkv_linear", kv_size_multiplier=2)
    alone = train_options(resume=str(tp2), no_checkpoint=True)
    with pytest.raises(TrainError, match=r"^world size 1 \(--nproc or the launcher's\) is not a multiple of the "
                                         r"shards' tp 2 x the shards' pp 1$"):
        prepare(TrainConfig.from_flat(alone), world_size=1)
    with pytest.raises(TrainError, match=r"is not a multiple of --tp 2 x the shards' pp 1$"):
        prepare(TrainConfig.from_flat({**alone, "tp": 2}), world_size=1)


@pytest.mark.parametrize("flags,run", [
    (dict(tp=1), "tp 1 pp 1 kvm 1 qkv_linear"),
    (dict(tp=2, fuse_qkv=True), "tp 2 pp 1 kvm 2 qkv_linear fused"),
])
def test_other_layout_is_resharded_on_load(tmp_path, nxd_model, flags, run):
    """Shards of another layout are read through the reshard plan, said in one line before any step."""
    src = nxd_model("gqa", tp=2, pp=1, attention="qkv_linear", kv_size_multiplier=2)
    config = TrainConfig.from_flat(train_options(resume=str(src), checkpoint_dir=str(tmp_path / "c"), **flags))
    plan = prepare(config, world_size=2)
    assert plan.resume_notes == (f"resharding on load (weights, each rank reads its slices of the tag): "
                                 f"tp 2 pp 1 kvm 2 qkv_linear -> {run}",)
    bad = TrainConfig.from_flat(train_options(resume=str(src), checkpoint_dir=str(tmp_path / "c"), tp=2,
                                              kv_replicator=1))
    with pytest.raises(TrainError, match=rf"^--resume {src}: this run's layout: --kv-size-multiplier 1 is invalid "
                                         r"for tp 2 with 1 KV heads: the valid value is 2 \(tp / kv heads\)$"):
        prepare(bad, world_size=2)
