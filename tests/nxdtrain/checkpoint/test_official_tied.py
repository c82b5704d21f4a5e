"""``--resume`` from a tied model's shards as the official converter writes them (no lm_head.weight).

The output projection is then the embedding. With pp > 1 the last stage's own file has no copy of
it: each tp rank reads its vocabulary rows from the pp rank 0 shard of the same tp rank. Training
from those shards equals training from ours (which carry the copy), and the run's checkpoints keep
our form.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ckptconv.io.nxd_read import load_shard
from nxdtrain.checkpoint.resume import resolve_resume
from tests.nxdtrain.harness import run_world, train_options
from tests.official_style import official_tied_shards

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def official_copy(ours: Path, out: Path) -> Path:
    """The official converter's shards of ``ours``, plus the model's config.json where nxdtrain looks for it."""
    official_tied_shards(ours, out)
    (out / "hf").mkdir()
    shutil.copy(ours / "hf" / "config.json", out / "hf" / "config.json")
    return out


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_load_state_takes_the_embedding_as_lm_head(tmp_path, nxd_model, tp, pp):
    ours = nxd_model("tied", tp=tp, pp=pp, attention="qkv_linear", fuse_qkv=True)
    official = official_copy(ours, tmp_path / "official")
    source = resolve_resume(str(official), weights_only=False)
    assert not source.full and source.spec.tied
    for t in range(tp):
        assert LM_HEAD not in load_shard(official / f"model/dp_rank_00_tp_rank_0{t}_pp_rank_0{pp - 1}.pt")
        for p in range(pp):
            got, want = source.load_state(t, p), load_shard(ours / f"model/dp_rank_00_tp_rank_0{t}_pp_rank_0{p}.pt")
            assert sorted(got) == sorted(want), (t, p)
            assert all(torch.equal(got[k], want[k]) for k in want), (t, p)
        # tp rank t's own vocabulary rows (64 of 128), from its first-stage file
        first = load_shard(official / f"model/dp_rank_00_tp_rank_0{t}_pp_rank_00.pt")
        assert torch.equal(source.load_state(t, pp - 1)[LM_HEAD], first[EMBED])


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)], ids=["pp1", "pp2"])
def test_training_from_official_tied_shards_equals_training_from_ours(tmp_path, nxd_model, tp, pp):
    ours = nxd_model("tied", tp=tp, pp=pp, attention="qkv_linear", fuse_qkv=True)
    official = official_copy(ours, tmp_path / "official")
    options = train_options(optimizer="sgd", lr=0.05, mbs=2, steps=2)
    logs = {}
    for name, src in (("ours", ours), ("official", official)):
        logs[name] = run_world(tp * pp, resume=str(src), tp=tp, pp=pp, checkpoint_dir=str(tmp_path / name / "ckpt"),
                               log_jsonl=str(tmp_path / name / "log.jsonl"), **options)
    assert logs["official"][0]["step"] == 1
    assert logs["official"][0]["loss"] == logs["ours"][0]["loss"]
    assert [r["loss"] for r in logs["official"]] == [r["loss"] for r in logs["ours"]]
    # The run's own checkpoints keep our choice: lm_head.weight, a copy of the (trained) embedding.
    for t in range(tp):
        tag = tmp_path / "official/ckpt/step_2/model"
        first = load_shard(tag / f"dp_rank_00_tp_rank_0{t}_pp_rank_00.pt")
        last = load_shard(tag / f"dp_rank_00_tp_rank_0{t}_pp_rank_0{pp - 1}.pt")
        theirs = load_shard(tmp_path / f"ours/ckpt/step_2/model/dp_rank_00_tp_rank_0{t}_pp_rank_0{pp - 1}.pt")
        assert list(last) == list(theirs)
        assert torch.equal(last[LM_HEAD], first[EMBED])
        assert all(torch.equal(last[k], theirs[k]) for k in theirs)
