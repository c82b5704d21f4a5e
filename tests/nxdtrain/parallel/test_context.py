"""Context parallelism (ring attention over zigzag chunks) trains the same model as cp 1 (fp32).

For each (tp, pp, dp, cp) of issue 19 the same run is made at cp 1 and at cp > 1 (GQA, every other
setting equal): the per-step losses and the weights after 3 AdamW steps agree within 1e-6, and
SGD runs match a transformers training loop (tests/nxdtrain/test_parity.py's reference). The
AdamW runs use ``--eps 1e-6`` and ``--lr 1e-4`` (see ADAMW below and the README's "Context
parallelism" section for why the default eps 1e-8 makes a 1e-6 weight bound meaningless).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdtrain.train import export
from tests.conftest import hf_state, warns_no_tokenizer
from tests.nxdtrain.harness import run_world, train_options
from tests.nxdtrain.test_parity import assert_matches_reference

TOL = 1e-6
# AdamW's first update of an element is about lr·g/(|g| + eps): for |g| near eps it moves by up to
# lr·δ/eps when g changes by δ. Summing a gradient over other chunk boundaries changes g by fp32
# rounding (δ ~ 1e-10 here), which at eps 1e-8, lr 1e-3 is ~1e-5 on the few elements whose gradient
# is ~1e-8: a difference that says nothing about cp. With eps 1e-6, lr 1e-4 that bound is 1e-8,
# while every update (~lr = 1e-4 per step) stays 100x above TOL, so a wrong gradient still fails.
ADAMW = dict(optimizer="adamw", lr=1e-4, min_lr=1e-5, eps=1e-6)

CASES = {
    # name: (tp, pp, dp, cp, extra options)
    "cp2": (1, 1, 1, 2, {}),
    "tp2-cp2-sp-full": (2, 1, 1, 2, dict(sequence_parallel=True, activation_checkpointing="full")),
    "tp2-cp2": (2, 1, 1, 2, {}),
    "pp2-cp2-selective": (1, 2, 1, 2, dict(activation_checkpointing="selective")),
    "dp2-cp2-zero1": (1, 1, 2, 2, dict(zero1=True)),
    "cp4": (1, 1, 1, 4, {}),
}


def _run(tmp: Path, src: Path, *, tp: int, pp: int, dp: int, cp: int, **options: Any) -> tuple[list[dict], dict]:
    log = run_world(tp * pp * dp * cp, resume=str(src), tp=tp, pp=pp, context_parallel=cp,
                    checkpoint_dir=str(tmp / "ckpt"), log_jsonl=str(tmp / "log.jsonl"), **options)
    with warns_no_tokenizer():
        export(tmp / "ckpt", tmp / "hf")
    return log, hf_state(tmp / "hf")


def _source(nxd_model: Any, tp: int, pp: int) -> Path:
    return nxd_model("gqa", tp=tp, pp=pp, attention="qkv_linear", kv_size_multiplier=2 if tp == 2 else 1)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[str, float]:
    return max(((k, float((a[k] - b[k]).abs().max())) for k in b), key=lambda kv: kv[1])


@pytest.mark.parametrize("name", list(CASES))
def test_cp_equals_cp1_adamw(tmp_path, hf_model, nxd_model, name):
    tp, pp, dp, cp, extra = CASES[name]
    options = train_options(mbs=2 // dp, **ADAMW, **extra)
    src = _source(nxd_model, tp, pp)
    base_log, base = _run(tmp_path / "cp1", src, tp=tp, pp=pp, dp=dp, cp=1, **options)
    log, got = _run(tmp_path / f"cp{cp}", src, tp=tp, pp=pp, dp=dp, cp=cp, **options)
    losses = [(a["loss"], b["loss"]) for a, b in zip(base_log, log, strict=True)]
    assert len(losses) == 3 and max(abs(a - b) for a, b in losses) <= TOL, losses
    key, worst = _max_diff(got, base)
    assert worst <= TOL, f"{key}: cp {cp} weights differ from cp 1 by {worst}"
    # The bound means something: training moved the weights far more than it.
    assert _max_diff(base, hf_state(hf_model("gqa")))[1] > 100 * TOL


SGD_CASES = {"cp2": (1, 1, 1, 2, {}), "tp2-cp2-sp": (2, 1, 1, 2, dict(sequence_parallel=True)),
             "pp2-cp2": (1, 2, 1, 2, {}), "dp2-cp2": (1, 1, 2, 2, {}),
             "cp4-full": (1, 1, 1, 4, dict(activation_checkpointing="full"))}


@pytest.mark.parametrize("name", list(SGD_CASES))
def test_cp_matches_transformers_sgd(tmp_path, nxd_model, reference, name):
    tp, pp, dp, cp, extra = SGD_CASES[name]
    options = train_options(optimizer="sgd", lr=0.05, mbs=2 // dp)
    log, _ = _run(tmp_path, _source(nxd_model, tp, pp), tp=tp, pp=pp, dp=dp, cp=cp, **options, **extra)
    assert_matches_reference(log, tmp_path / "hf", reference("gqa", **options), "sgd")


# --------------------------------------------------------------------------------------------
# Resume across cp, evaluation, the checkpoint files


def test_resume_cp2_cp1_cp2_continues_the_curve(tmp_path, nxd_model):
    """2 steps at cp 2, 2 at cp 1, 2 at cp 2 (AdamW state carried) equal 6 uninterrupted steps at cp 1."""
    options = train_options(mbs=2, steps=6, decay_steps=6, **ADAMW)  # one schedule for every piece
    src = _source(nxd_model, 1, 1)
    whole = run_world(1, resume=str(src), checkpoint_dir=str(tmp_path / "whole"),
                      log_jsonl=str(tmp_path / "whole.jsonl"), **options)
    ckpt, log = tmp_path / "ckpt", tmp_path / "pieces.jsonl"
    start = str(src)
    for steps, cp in ((2, 2), (4, 1), (6, 2)):
        pieces = run_world(cp, resume=start, context_parallel=cp, checkpoint_dir=str(ckpt), log_jsonl=str(log),
                           **{**options, "steps": steps})
        start = str(ckpt)
    assert [r["step"] for r in pieces] == list(range(1, 7))
    worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(whole, pieces, strict=True))
    assert worst <= TOL, ([r["loss"] for r in whole], [r["loss"] for r in pieces])
    # The same files as a cp-1 run: one model shard, one optimizer file (no cp index anywhere).
    assert sorted(p.name for p in (ckpt / "step_6/model").iterdir()) == ["dp_rank_00_tp_rank_00_pp_rank_00.pt"]
    assert sorted(p.name for p in (ckpt / "step_6/optim").iterdir()) == ["dp_rank_00_tp_rank_00_pp_rank_00.pt"]
    with warns_no_tokenizer():
        export(ckpt, tmp_path / "hf")
    with warns_no_tokenizer():
        export(tmp_path / "whole", tmp_path / "hf-whole")
    assert _max_diff(hf_state(tmp_path / "hf"), hf_state(tmp_path / "hf-whole"))[1] <= TOL


def test_zero1_shards_over_dp_x_cp(tmp_path, nxd_model):
    """ZeRO-1 at dp 1 x cp 2 writes one optimizer shard per dp x cp rank; dp 2 x cp 1 resumes from it."""
    options = train_options(mbs=1, steps=4, decay_steps=4, zero1=True, **ADAMW)
    src = _source(nxd_model, 1, 1)
    ckpt = tmp_path / "ckpt"
    run_world(2, resume=str(src), context_parallel=2, checkpoint_dir=str(ckpt), log_jsonl=str(tmp_path / "a.jsonl"),
              **{**options, "steps": 2})
    assert sorted(p.name for p in (ckpt / "step_2/optim").iterdir()) == [
        f"dp_rank_0{d}_tp_rank_00_pp_rank_00.pt" for d in range(2)]
    log = run_world(2, resume=str(ckpt), checkpoint_dir=str(ckpt), log_jsonl=str(tmp_path / "a.jsonl"), **options)
    whole = run_world(2, resume=str(src), checkpoint_dir=str(tmp_path / "whole"),
                      log_jsonl=str(tmp_path / "whole.jsonl"), **options)
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(whole, log, strict=True)) <= TOL


def test_evaluation_with_cp(tmp_path, nxd_model):
    """The evaluation loss at cp 2 is the cp-1 one (both runs evaluate the same held-out rows)."""
    held_out = tmp_path / "eval.jsonl"
    rows = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(3)).tolist()
    held_out.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    options = train_options(mbs=2, steps=2, eval_data=str(held_out), eval_every=1, **ADAMW)
    src = _source(nxd_model, 1, 1)
    logs = [run_world(cp, resume=str(src), context_parallel=cp, no_checkpoint=True,
                      log_jsonl=str(tmp_path / f"cp{cp}.jsonl"), **options) for cp in (1, 2)]
    pairs = [(a["eval_loss"], b["eval_loss"]) for a, b in zip(*logs, strict=True)]
    assert len(pairs) == 2 and all(a is not None for a, _ in pairs)
    assert max(abs(a - b) for a, b in pairs) <= TOL, pairs


# --------------------------------------------------------------------------------------------
# Refused before any process starts (one line each)


def _config(**options: Any) -> Any:
    from nxdtrain.config.options import TrainConfig

    return TrainConfig.from_flat({"no_checkpoint": True, **train_options(), **options})


@pytest.mark.parametrize("options,world,message", [
    (dict(context_parallel=4, seq_len=20), 4,
     "--seq-len 20 must be a multiple of 2 x --context-parallel 4 = 8 (each cp rank holds 2 equal chunks of a row)"),
    (dict(context_parallel=2, seq_len=20, tp=2, sequence_parallel=True), 4,
     "--seq-len 20 must be a multiple of 2 x --context-parallel 2 x --tp 2 (sequence parallel) = 8"),
    (dict(context_parallel=2), 3, "world size 3 (--nproc or the launcher's) is not a multiple of the shards' tp 1 x "
                                  "the shards' pp 1 x --context-parallel 2"),  # tp, pp not given: the shards'

], ids=["seq-len", "seq-len-sp", "world"])
def test_refused_before_starting(nxd_model, options, world, message):
    from nxdtrain.errors import TrainError
    from nxdtrain.train import prepare

    tp = options.get("tp", 1)
    with pytest.raises(TrainError) as err:
        prepare(_config(resume=str(_source(nxd_model, tp, 1)), **options), world)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_no_ring_attention_with_cp_is_refused():
    from nxdtrain.errors import TrainError

    with pytest.raises(TrainError, match=r"^--context-parallel 2 needs ring attention \(model.fusions.ring_attention"):
        _config(resume="x", context_parallel=2, ring_attention=False)
    assert _config(resume="x", ring_attention=False).parallel.context_parallel == 1


def test_xla_refuses_cp_naming_what_is_missing():
    """Reached without torch_xla: the config refuses --device xla with cp > 1 when it is built."""
    from nxdtrain.errors import TrainError

    with pytest.raises(TrainError) as err:
        _config(resume="x", device="xla", context_parallel=2, optimizer="adamw")
    assert "point-to-point send/recv" in str(err.value) and "torch-xla 2.9" in str(err.value)


def test_yaml_context_parallel_size_and_ring_attention(tmp_path):
    from nxdtrain.cli import build_parser, load_config
    from nxdtrain.errors import TrainError

    path = tmp_path / "run.yaml"
    path.write_text("distributed_strategy: {context_parallel_size: 2}\nmodel: {fusions: {ring_attention: true}}\n")
    cfg = load_config(build_parser().parse_args(["run", "--config", str(path), "--resume", "x", "--data", "synthetic", "--no-checkpoint"]))
    assert (cfg.parallel.context_parallel, cfg.parallel.ring_attention) == (2, True)
    args = ["run", "--config", str(path), "--resume", "x", "--data", "synthetic", "--no-checkpoint", "--context-parallel", "4"]
    assert load_config(build_parser().parse_args(args)).parallel.context_parallel == 4  # the flag wins
    path.write_text("distributed_strategy: {context_parallel_size: 2}\nmodel: {fusions: {ring_attention: false}}\n")
    with pytest.raises(TrainError, match="needs ring attention"):
        load_config(build_parser().parse_args(["run", "--config", str(path), "--resume", "x", "--data", "synthetic", "--no-checkpoint"]))
