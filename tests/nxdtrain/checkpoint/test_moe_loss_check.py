"""The wrong-load loss check on a mixture of experts (issue 30, item 4; nxdtrain.checkpoint.loss_check): an ep 2 tag
whose two ep ranks' experts are swapped has every shape, name and digest right, and stops before step 1 of its
resume on the loss it recorded; the tag as written resumes.

A tiny Mixtral first learns next-token = a fixed permutation of the vocabulary with only its MLPs and head trained
(attention and embeddings stay random), so its experts carry what it knows: measured, the swap raises the loss from
about 0.05 to about 4 nats (a fully trained tiny model routes around its experts: a swap moved it by 0.4 to 1.0 nat,
inside the check's 1-nat margin)."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from nxdtrain.checkpoint.loss_check import ABOVE_RECORDED, CAUSES, EXPERT_CAUSES
from nxdtrain.cli import PRELOAD
from nxdtrain.config.options import TrainConfig
from nxdtrain.parallel.dist import spawn
from nxdtrain.train import run_worker
from tests.nxdtrain.harness import WORLD_TIMEOUT, convert, run_world, train_options
from tests.nxdtrain.moe_reference import COMMON, FAMILIES
from tests.nxdtrain.wrong_loads import VOCAB, record_rewritten, write_rows

EXPERT_SUFFIXES = (".mlp.expert_mlps.mlp_op.gate_up_proj.weight", ".mlp.expert_mlps.mlp_op.down_proj.weight")
PERMUTATION = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))


def permutation_rows(count: int, seq_len: int, *, seed: int) -> torch.Tensor:
    """Rows ``x, P[x], P[P[x]], ...`` from a random start: each next token a function of the current one."""
    rows = [torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))]
    for _ in range(seq_len - 1):
        rows.append(PERMUTATION[rows[-1]])
    return torch.stack(rows, dim=1)


def trained_mixtral(path: Path, steps: int = 200) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(**{**COMMON, "vocab_size": VOCAB}, **FAMILIES["mixtral"])
    model = transformers.MixtralForCausalLM(config)
    optimizer = torch.optim.AdamW([p for n, p in model.named_parameters() if ".mlp." in n or "lm_head" in n], lr=1e-2)
    for step in range(steps):
        ids = permutation_rows(16, 16, seed=1000 + step)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(path)
    return path


def swap_ep_ranks(tag: Path) -> None:
    """ep rank 0's experts into ep rank 1's files and back (the router and everything else stay)."""
    paths = [tag / "model" / f"dp_rank_00_ep_rank_{e:02d}_tp_rank_00_pp_rank_00.pt" for e in range(2)]
    shards = [torch.load(p, weights_only=True) for p in paths]
    keys = [k for k in shards[1] if k.endswith(EXPERT_SUFFIXES)]
    assert len(keys) == 2 * COMMON["num_hidden_layers"]
    for key in keys:
        shards[0][key], shards[1][key] = shards[1][key], shards[0][key]
    for shard, path in zip(shards, paths, strict=True):
        torch.save(shard, path)
    record_rewritten(tag, paths)


@pytest.mark.slow
def test_an_ep2_tag_with_its_ep_ranks_experts_swapped_stops_before_step_1(tmp_path, capsys):
    src = convert(trained_mixtral(tmp_path / "hf"), tmp_path / "nxd")
    data = write_rows(tmp_path / "rows.jsonl", permutation_rows(64, 16, seed=5).tolist())
    options = train_options(data=str(data), optimizer="adamw", lr=1e-4, gbs=4, decay_steps=2, ep=2)
    ck = tmp_path / "ck"
    first = run_world(2, resume=str(src), checkpoint_dir=str(ck), log_jsonl=str(tmp_path / "a.jsonl"),
                      **{**options, "steps": 1})
    assert first[0]["loss"] < math.log(VOCAB) - 4
    wrong = shutil.copytree(ck / "step_1", tmp_path / "wrong" / "step_1")
    swap_ep_ranks(wrong)
    log = tmp_path / "stopped.jsonl"
    config = TrainConfig.from_flat({**options, "steps": 2, "resume": str(wrong), "no_checkpoint": True,
                                    "log_jsonl": str(log)})
    capsys.readouterr()
    assert spawn(run_worker, (config,), 2, timeout_s=WORLD_TIMEOUT, preload=PRELOAD) == 1
    assert not log.exists()  # no step was taken
    err = capsys.readouterr().err
    m = re.fullmatch(rf"nxdtrain: error: --resume {re.escape(str(wrong))}: the first batch loss (\d+\.\d+) is far "
                     rf"above the loss (\d+\.\d+) recorded in the tag \(\+ 1\); {re.escape(CAUSES)}, "
                     rf"{re.escape(EXPERT_CAUSES)}; or pass --allow-high-loss to train anyway\n", err)
    assert m, err
    assert float(m[1]) > float(m[2]) + ABOVE_RECORDED
    # the tag as written passes the check and trains on
    resumed = run_world(2, resume=str(ck), checkpoint_dir=str(ck), log_jsonl=str(tmp_path / "b.jsonl"),
                        **{**options, "steps": 2})
    assert [r["step"] for r in resumed] == [2]
