"""--sequence-parallel and --activation-checkpointing change memory, not results (fp32, GQA kvm 2, fused qkv).

Per (tp, pp, dp): a plain run and three with the options (SP alone, selective alone, SP + full), 3 AdamW
steps each, tags kept at every step. Losses and final weights equal the plain run's within 1e-6, and
a tag written with the options off resumes with them on (and the reverse) to the same step-3 weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nxdtrain.config.options import TrainConfig
from nxdtrain.errors import TrainError
from nxdtrain.train import prepare
from tests.nxdtrain.harness import run_world, train_options

TOL = 1e-6
VARIANTS = {
    "plain": {},
    "sp": dict(sequence_parallel=True),
    "selective": dict(activation_checkpointing="selective"),
    "sp-full": dict(sequence_parallel=True, activation_checkpointing="full"),
}
TOPOLOGIES = [
    pytest.param((2, 2, 1), id="tp2-pp2-dp1"),
    pytest.param((2, 1, 1), id="tp2-pp1-dp1", marks=pytest.mark.slow),
    pytest.param((2, 1, 2), id="tp2-pp1-dp2", marks=pytest.mark.slow),
]


def shard_weights(tag: Path) -> dict[str, torch.Tensor]:
    """Every model shard's tensors in a tag, keyed by file and name."""
    out = {}
    for path in sorted((tag / "model").glob("*.pt")):
        out.update({f"{path.name}:{k}": v for k, v in torch.load(path, weights_only=True).items()})
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b) and a
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def train(tmp_path: Path, name: str, src: Path, tp: int, pp: int, dp: int, **extra) -> tuple[list[float], Path]:
    run = tmp_path / name
    options = train_options(optimizer="adamw", mbs=2 // dp, checkpoint_freq=1, keep=3)
    log = run_world(tp * pp * dp, resume=str(src), tp=tp, pp=pp, checkpoint_dir=str(run / "ckpt"),
                    log_jsonl=str(run / "log.jsonl"), **{**options, **extra})
    return [row["loss"] for row in log], run / "ckpt"


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_options_do_not_change_training(tmp_path, nxd_model, topology):
    tp, pp, dp = topology
    src = nxd_model("gqa", tp=tp, pp=pp, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=2)
    runs = {name: train(tmp_path, name, src, tp, pp, dp, **extra) for name, extra in VARIANTS.items()}
    plain_losses, plain_ckpt = runs["plain"]
    plain_weights = shard_weights(plain_ckpt / "step_3")
    assert len(plain_losses) == 3
    for name, (losses, ckpt) in runs.items():
        assert max(abs(a - b) for a, b in zip(losses, plain_losses, strict=True)) <= TOL, (name, losses, plain_losses)
        assert max_diff(shard_weights(ckpt / "step_3"), plain_weights) <= TOL, name
    # The checkpoint does not depend on the options: resume step 2 across them being switched on, and off.
    for source, extra in (("plain", VARIANTS["sp-full"]), ("sp-full", {})):
        name = f"resume-{source}"
        losses, ckpt = train(tmp_path, name, runs[source][1] / "step_2", tp, pp, dp, **extra)
        assert len(losses) == 1 and abs(losses[0] - plain_losses[2]) <= TOL, (name, losses)
        assert max_diff(shard_weights(ckpt / "step_3"), plain_weights) <= TOL, name


def test_sequence_parallel_needs_seq_len_divisible_by_tp(nxd_model):
    src = nxd_model("gqa", tp=2, pp=1, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=2)
    config = TrainConfig.from_flat(train_options(resume=str(src), tp=2, seq_len=15, sequence_parallel=True))
    with pytest.raises(TrainError) as err:
        prepare(config, 2)
    assert str(err.value) == "--sequence-parallel needs --seq-len divisible by --tp 2, got 15"


@pytest.mark.parametrize("model,layout,topology", [
    pytest.param("mha", dict(attention="separate"), (2, 1, 1), id="separate-tp2"),
    pytest.param("mha", dict(attention="coalesced"), (2, 2, 1), id="coalesced-tp2-pp2", marks=pytest.mark.slow),
    pytest.param("gqa2", dict(attention="qkv_linear"), (2, 1, 2), id="qkv-unfused-tp2-dp2", marks=pytest.mark.slow),
])
def test_other_attention_modes(tmp_path, nxd_model, model, layout, topology):
    """Sequence parallel with selective recompute equals the plain run for the other q/k/v layouts too."""
    tp, pp, dp = topology
    src = nxd_model(model, tp=tp, pp=pp, **layout)
    plain_losses, plain_ckpt = train(tmp_path, "plain", src, tp, pp, dp)
    losses, ckpt = train(tmp_path, "sp", src, tp, pp, dp, sequence_parallel=True, activation_checkpointing="selective")
    assert max(abs(a - b) for a, b in zip(losses, plain_losses, strict=True)) <= TOL, (losses, plain_losses)
    assert max_diff(shard_weights(ckpt / "step_3"), shard_weights(plain_ckpt / "step_3")) <= TOL


def count_stage_forwards(config: TrainConfig, out: Path) -> None:
    """A rank that trains and writes how often its stage's forward ran."""
    import os

    from nxdtrain import model
    from nxdtrain.train import run_worker

    calls = []
    original = model.LlamaStage.forward

    def counting(self: model.LlamaStage, x: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return original(self, x)

    model.LlamaStage.forward = counting  # type: ignore[method-assign]
    run_worker(config)
    (out / f"rank{os.environ['RANK']}").write_text(str(len(calls)))


def test_pipeline_stages_get_their_shapes(tmp_path, nxd_model):
    """pp 2 with SP: 2 steps of 2 microbatches run each stage's forward 4 times (no shape-inference forward)."""
    from nxdtrain.cli import PRELOAD
    from nxdtrain.parallel.dist import spawn
    from tests.nxdtrain.harness import WORLD_TIMEOUT

    src = nxd_model("gqa", tp=2, pp=2, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=2)
    config = TrainConfig.from_flat(train_options(resume=str(src), tp=2, pp=2, steps=2, mbs=2, sequence_parallel=True,
                                                 no_checkpoint=True))
    assert spawn(count_stage_forwards, (config, tmp_path), 4, timeout_s=WORLD_TIMEOUT, preload=PRELOAD) == 0
    assert [(tmp_path / f"rank{r}").read_text() for r in range(4)] == ["4"] * 4
