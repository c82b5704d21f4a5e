"""--shard-params / --hybrid-shard (torch's FSDP2): training equals transformers on the same global batch and the
same run without sharding; tags stay whole per-tp-rank shards that resume at another sharding, dp, or ZeRO-1.

4-process worlds take tens of seconds on a 2-core machine: tp2 x dp2 (AdamW) and the memory count run in the
default lane, the rest is marked slow.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdtrain.train import export
from tests.conftest import hf_state, warns_no_tokenizer
from tests.nxdtrain.harness import run_world, train_options
from tests.nxdtrain.test_parity import assert_matches_reference, bf16_masters

LAYOUT = dict(attention="qkv_linear", kv_size_multiplier=2)  # gqa at tp 2: two ranks hold each K/V head


def lr(optimizer: str) -> float:
    return 0.05 if optimizer == "sgd" else 1e-3


def train(tmp: Path, src: Path, nproc: int, **options: Any) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """A run of ``nproc`` processes from ``src`` saving into ``tmp/ckpt``; its log and its last tag exported."""
    log = run_world(nproc, resume=str(src), checkpoint_dir=str(tmp / "ckpt"), log_jsonl=str(tmp / "log.jsonl"),
                    **options)
    with warns_no_tokenizer():
        export(tmp / "ckpt", tmp / "hf")
    return log, hf_state(tmp / "hf")


CASES = {
    # name: (model, tp, dp, conversion layout, sharding and other options, optimizer)
    "tp2-dp2-adamw": ("gqa", 2, 2, {}, {"shard_params": True}, "adamw"),
    # fused weight_qkv: the replicated K/V rows (summed over the replica group, counted once in the norm) lie in
    # dp rank 1's part only, dp rank 0 holds Q rows alone
    "tp2-dp2-sgd-fused-sp-full-recompute": ("gqa", 2, 2, {"fuse_qkv": True}, {
        "shard_params": True, "sequence_parallel": True, "activation_checkpointing": "full"}, "sgd"),
    "tp1-dp2-adamw-selective": ("gqa", 1, 2, {}, {"shard_params": True, "activation_checkpointing": "selective",
                                                  "recompute_modules": "CoreAttention,LlamaMLP"}, "adamw"),
    "tp1-dp2-sgd": ("gqa", 1, 2, {}, {"shard_params": True}, "sgd"),
    "tied-tp2-dp2-adamw": ("tied", 2, 2, {"fuse_qkv": True}, {"shard_params": True}, "adamw"),
    "tp1-dp4-hybrid2-adamw": ("gqa", 1, 4, {}, {"hybrid_shard": 2}, "adamw"),
    "tp1-dp4-hybrid2-sgd": ("gqa", 1, 4, {}, {"hybrid_shard": 2}, "sgd"),
}
DEFAULT_LANE = {"tp2-dp2-adamw"}
SHARDING = ("shard_params", "hybrid_shard")


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT_LANE else pytest.mark.slow)
                                  for n in CASES])
def test_sharded_matches_transformers_and_unsharded(tmp_path, nxd_model, reference, name):
    model, tp, dp, layout, extra, optimizer = CASES[name]
    options = train_options(optimizer=optimizer, lr=lr(optimizer), tp=tp, mbs=1)
    kvm = {"kv_size_multiplier": 2} if model == "gqa" and tp == 2 else {}
    src = nxd_model(model, tp=tp, pp=1, attention="qkv_linear", **kvm, **layout)
    sharded_log, sharded = train(tmp_path / "sharded", src, tp * dp, **options, **extra)
    assert_matches_reference(sharded_log, tmp_path / "sharded/hf", reference(model, **options), optimizer)
    unsharded = {k: v for k, v in extra.items() if k not in SHARDING}
    plain_log, plain = train(tmp_path / "plain", src, tp * dp, **options, **unsharded)
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(sharded_log, plain_log, strict=True)) <= 1e-6
    worst = max((sharded[k] - plain[k]).abs().max().item() for k in plain)
    assert worst <= (1e-6 if optimizer == "sgd" else 1e-5), worst
    assert_same_files(tmp_path / "sharded/ckpt/step_3", tmp_path / "plain/ckpt/step_3")


def assert_same_files(tag: Path, other: Path) -> None:
    """The same files, each with the same keys, dtypes and shapes and the same plain values (the optimizer files'
    format, names, ZeRO-1 fields, param groups): what ckptconv and NxD's loader read does not depend on sharding."""
    files = sorted(p.relative_to(tag).as_posix() for p in tag.rglob("*.pt"))
    assert files == sorted(p.relative_to(other).as_posix() for p in other.rglob("*.pt")) and files
    for name in files:
        a, b = (torch.load(root / name, weights_only=True) for root in (tag, other))
        assert a.keys() == b.keys(), name
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert (a[key].dtype, a[key].shape, a[key].stride()) == (b[key].dtype, b[key].shape, b[key].stride())
            elif key == "options":  # user_content.pt: the options, which record the sharding
                differ = {k for k in a[key] if a[key][k] != b[key][k]}
                assert differ <= {*SHARDING, "checkpoint_dir", "log_jsonl"}, differ  # and the paths
            elif key == "loss":  # user_content.pt: the last loss, equal as the logs are
                assert a[key] == pytest.approx(b[key], abs=1e-6)
            elif key not in ("rng", "run"):  # user_content.pt: this run's RNG states and id
                assert a[key] == b[key], (name, key)


# --------------------------------------------------------------------------------------------
# Resume: a sharded tag is an ordinary tag


def losses(log: list[dict]) -> list[float]:
    return [row["loss"] for row in log]


def resume_from(tmp: Path, tag_root: Path, nproc: int, name: str, **options: Any) -> list[dict]:
    return run_world(nproc, resume=str(tag_root), checkpoint_dir=str(tmp / name), log_jsonl=str(tmp / f"{name}.jsonl"),
                     **options)


RESUMES = {
    # name: (sharding of the 2-step run, (nproc, sharding) of each resume)
    "sharded-to-sharded-and-unsharded": ({"shard_params": True}, [(2, {"shard_params": True}), (2, {})]),
    "sharded-to-dp4-tp2-and-zero1": ({"shard_params": True}, [(4, {"shard_params": True}), (2, {"zero1": True}),
                                                              (4, {"hybrid_shard": 2}),
                                                              (4, {"shard_params": True, "tp": 2})]),
    "zero1-to-sharded": ({"zero1": True}, [(2, {"shard_params": True}), (4, {"shard_params": True})]),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if i == 0 else pytest.mark.slow)
                                  for i, n in enumerate(RESUMES)])
def test_resume_continues_the_losses(tmp_path, nxd_model, name):
    """3 steps == 2 steps + a resume at step 3, at the same sharding, without it, at another dp, with ZeRO-1."""
    saved_with, resumes = RESUMES[name]
    src = nxd_model("gqa", tp=1, pp=1, attention="qkv_linear")
    options = train_options(optimizer="adamw", mbs=1, decay_steps=3)
    straight = run_world(2, resume=str(src), checkpoint_dir=str(tmp_path / "a"), log_jsonl=str(tmp_path / "a.jsonl"),
                         **options)
    first = run_world(2, resume=str(src), checkpoint_dir=str(tmp_path / "b"), log_jsonl=str(tmp_path / "b.jsonl"),
                      **{**options, "steps": 2}, **saved_with)
    assert max(abs(a - b) for a, b in zip(losses(first), losses(straight), strict=False)) <= 1e-6
    for k, (nproc, sharding) in enumerate(resumes):
        resumed = resume_from(tmp_path, tmp_path / "b/step_2", nproc, f"r{k}", **options, **sharding)
        assert [r["step"] for r in resumed] == [3], sharding
        assert abs(resumed[0]["loss"] - straight[2]["loss"]) <= 1e-6, (sharding, resumed, straight)
        assert abs(resumed[0]["grad_norm"] - straight[2]["grad_norm"]) <= 1e-5, sharding


# --------------------------------------------------------------------------------------------
# Memory: the model states each rank holds


def measuring_worker(options: dict[str, Any], out: Path) -> None:
    """One rank: a Trainer (as nxdtrain.train.train drives it) takes one step and writes its state bytes."""
    import json
    import os

    import torch.distributed as dist

    from nxdtrain.config.options import TrainConfig
    from nxdtrain.parallel.dist import detect_env, init_world
    from nxdtrain.train import Trainer, prepare

    config = TrainConfig.from_flat(options)
    env = detect_env()
    plan = prepare(config, env.world_size)
    device = init_world(env, config.dist_timeout, plan.device)
    try:
        trainer = Trainer(plan, device)
        trainer.train_step(1)
        (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(trainer.state_bytes))
    finally:
        dist.destroy_process_group()


def state_bytes_at(tmp: Path, src: Path, nproc: int, **options: Any) -> list[dict[str, int]]:
    import json

    from nxdtrain.cli import PRELOAD
    from nxdtrain.config.options import TrainConfig
    from nxdtrain.parallel.dist import spawn
    from tests.nxdtrain.harness import WORLD_TIMEOUT

    tmp.mkdir()
    config = train_options(resume=str(src), no_checkpoint=True, mbs=1, optimizer="adamw", **options)
    TrainConfig.from_flat(config)  # a bad option fails here, not in 4 processes
    assert spawn(measuring_worker, (config, tmp), nproc, timeout_s=WORLD_TIMEOUT, preload=PRELOAD) == 0
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_model_states_per_rank_at_dp4(tmp_path, nxd_model):
    """Parameters + gradients + AdamW state per rank at dp 4: fully sharded <= 0.45 x ZeRO-1 (fp32: 16/4 vs
    4 + 4 + 8/4 bytes per parameter = 0.4), counted on each rank's local tensors after one step."""
    src = nxd_model("gqa", tp=1, pp=1, attention="qkv_linear")
    zero1 = state_bytes_at(tmp_path / "zero1", src, 4, zero1=True)
    sharded = state_bytes_at(tmp_path / "sharded", src, 4, shard_params=True)
    # ZeRO-1: every rank holds whole parameters and gradients; sharded: the four ranks' parts add up to them once.
    whole = zero1[0]["params"]
    assert all(r["params"] == r["grads"] == whole for r in zero1)
    assert sum(r["params"] for r in sharded) == sum(r["grads"] for r in sharded) == whole
    # AdamW's moments once over the four ranks either way (plus a 4-byte step count per parameter tensor and rank)
    assert sum(r["optimizer"] for r in sharded) == pytest.approx(sum(r["optimizer"] for r in zero1), rel=0.01)
    worst = max(sum(r.values()) for r in sharded) / max(sum(r.values()) for r in zero1)
    assert worst <= 0.45, worst



# --------------------------------------------------------------------------------------------
# Refused before any process starts, and the options' plumbing


@pytest.mark.parametrize("flags,message", [
    (dict(shard_params=True, zero1=True), "--shard-params with --zero1: the optimizer state is sharded already"),
    (dict(hybrid_shard=2, pp=2), "--hybrid-shard 2 with --pp 2: FSDP2 is not wired into nxdtrain's pipeline"),
    (dict(shard_params=True, context_parallel=2), "--shard-params with --context-parallel 2: nxdtrain's FSDP mesh"),
    (dict(shard_params=True, hybrid_shard=2), "--shard-params and --hybrid-shard 2 exclude each other"),
    (dict(hybrid_shard=1), "--hybrid-shard must be an integer >= 2 (ranks per sharding group), got 1"),
    (dict(shard_params=True, device="xla"), "--shard-params with --device xla: torch's FSDP2 (fully_shard) keeps "
                                            "parameters as DTensors"),
    (dict(offload_activations=True, device="xla"), "--offload-activations with --device xla: save_on_cpu copies"),
])
def test_refused_in_config(flags, message):
    from nxdtrain.config.options import TrainConfig
    from nxdtrain.errors import TrainError

    with pytest.raises(TrainError, match="^" + re.escape(message)):
        TrainConfig.from_flat(train_options(resume="unused", no_checkpoint=True, **flags))


def test_hybrid_degree_must_divide_dp(nxd_model):
    from nxdtrain.config.options import TrainConfig
    from nxdtrain.errors import TrainError
    from nxdtrain.train import prepare

    src = nxd_model("gqa", tp=1, pp=1, attention="qkv_linear")
    config = TrainConfig.from_flat(train_options(resume=str(src), no_checkpoint=True, hybrid_shard=3))
    with pytest.raises(TrainError, match=r"^--hybrid-shard 3 must divide the data-parallel size 4 \(world / "):
        prepare(config, world_size=4)
    assert prepare(dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, hybrid_shard=4)),
                   world_size=4).dp == 4  # N = dp: fully sharded


def test_smp_keys_in_nxdt_yaml(tmp_path):
    from nxdtrain.config.yaml_config import read_yaml
    from nxdtrain.errors import TrainError

    path = tmp_path / "run.yaml"
    path.write_text("distributed_strategy:\n  hybrid_shard_degree: 2\n  sm_activation_offloading: true\n")
    assert read_yaml(path).values == {"hybrid_shard": 2, "offload_activations": True}
    path.write_text("distributed_strategy:\n  hybrid_shard_degree: 1\n")
    assert read_yaml(path).values == {}
    path.write_text("distributed_strategy:\n  hybrid_shard_degree: 0\n")
    with pytest.raises(TrainError, match="hybrid_shard_degree 0: SMP's 'the training script's own FSDP setup'"):
        read_yaml(path)


def test_offloading_on_cpu_has_no_effect_and_says_so():
    from types import SimpleNamespace

    from nxdtrain.parallel.fsdp_run import memory_notes
    from nxdtrain.parallel.offload import offloading

    config = SimpleNamespace(parallel=SimpleNamespace(offload_activations=True))
    assert memory_notes(None, config, 2, torch.device("cpu")) == [
        "--offload-activations: no effect on cpu (the activations are in host memory already)"]
    assert memory_notes(None, config, 2, torch.device("cuda")) == []
    assert isinstance(offloading(True, torch.device("cuda")), torch.autograd.graph.save_on_cpu)
    with offloading(True, torch.device("cpu")):  # no hooks: a saved activation stays the tensor itself
        x = torch.ones(3, requires_grad=True)
        y = x * x
    assert y.grad_fn._saved_self is x  # type: ignore[union-attr]


@pytest.mark.slow
def test_bf16_sharded_equals_bf16_unsharded(tmp_path, nxd_model):
    """bf16 through FSDP's MixedPrecisionPolicy (fp32 sharded masters, bf16 compute, fp32 gradient reduction) trains
    as nxdtrain's own bf16 (bf16 parameters, fp32 masters); the tag holds bf16 weights and their fp32 masters."""
    from ckptconv.training.nxdtrain_format.state import MASTER, state_key

    src = nxd_model("gqa", tp=2, pp=1, **LAYOUT)
    options = train_options(optimizer="adamw", tp=2, mbs=1, precision="bf16")
    sharded = run_world(4, resume=str(src), checkpoint_dir=str(tmp_path / "s"), log_jsonl=str(tmp_path / "s.jsonl"),
                        shard_params=True, **options)
    plain = run_world(4, resume=str(src), checkpoint_dir=str(tmp_path / "p"), log_jsonl=str(tmp_path / "p.jsonl"),
                      **options)
    assert max(abs(a - b) for a, b in zip(losses(sharded), losses(plain), strict=True)) < 1e-2
    masters, optim = bf16_masters(tmp_path / "s/step_3", "dp_rank_00_tp_rank_01_pp_rank_00.pt")
    plain_optim = torch.load(tmp_path / "p/step_3/optim/dp_rank_00_tp_rank_01_pp_rank_00.pt", weights_only=True)
    assert set(optim) == set(plain_optim)  # the same state, in the same format
    worst = max((masters[k] - plain_optim[state_key(k, MASTER)]).abs().max().item() for k in masters)
    assert worst < 1e-3, worst


def test_auto_device_resolving_to_xla_is_refused(nxd_model, monkeypatch):
    """--device auto on a Neuron host (PJRT_DEVICE=NEURON) resolves to xla in prepare: refused there, before the
    world starts."""
    from nxdtrain.config.options import TrainConfig
    from nxdtrain.errors import TrainError
    from nxdtrain.train import prepare

    src = nxd_model("gqa", tp=1, pp=1, attention="qkv_linear")
    monkeypatch.setattr("nxdtrain.train.resolve_kind", lambda kind: "xla")
    config = TrainConfig.from_flat(train_options(resume=str(src), no_checkpoint=True, device="auto", hybrid_shard=2))
    with pytest.raises(TrainError, match=r"^--device auto chose xla \(a PJRT accelerator\): --hybrid-shard 2 with "
                                         r"--device xla: torch's FSDP2"):
        prepare(config, world_size=4)


@pytest.mark.slow
def test_bf16_sharded_tag_resumes_with_its_masters(tmp_path, nxd_model):
    """A bf16 sharded tag of step 2 (bf16 weights, fp32 masters) continues at step 3 as the uninterrupted run,
    sharded and unsharded: the masters, not the bf16 weights, are what the resumed run steps."""
    src = nxd_model("gqa", tp=1, pp=1, attention="qkv_linear")
    options = train_options(optimizer="adamw", mbs=1, decay_steps=3, precision="bf16")
    straight = run_world(2, resume=str(src), checkpoint_dir=str(tmp_path / "a"), log_jsonl=str(tmp_path / "a.jsonl"),
                         shard_params=True, **options)
    run_world(2, resume=str(src), checkpoint_dir=str(tmp_path / "b"), log_jsonl=str(tmp_path / "b.jsonl"),
              shard_params=True, **{**options, "steps": 2})
    for k, sharding in enumerate(({"shard_params": True}, {})):
        resumed = resume_from(tmp_path, tmp_path / "b/step_2", 2, f"r{k}", **options, **sharding)
        assert abs(resumed[0]["loss"] - straight[2]["loss"]) <= 1e-6, (sharding, resumed, straight)
