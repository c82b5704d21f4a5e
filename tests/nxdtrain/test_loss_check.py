"""A wrong load is caught before it costs compute (issue 20, item 4): the first batch's loss of a resumed or
converted start, against ln(vocab) and against the loss the resumed tag recorded (nxdtrain.loss_check)."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from nxdtrain.cli import PRELOAD
from nxdtrain.config import TrainConfig
from nxdtrain.dist import spawn
from nxdtrain.loss_check import ABOVE_GUESSING, ABOVE_RECORDED, verdict
from nxdtrain.train import run_worker
from tests.nxdtrain.harness import WORLD_TIMEOUT, convert, run_world, train_options
from tests.nxdtrain.wrong_loads import VOCAB, pattern_rows, trained_llama, write_rows

LAYOUT = dict(tp=4, attention="qkv_linear", kv_size_multiplier=2)  # 8 heads, 2 KV heads: each KV head twice


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama trained until its loss is far below ln(vocab) (a random one sits at ln V, right or wrong),
    and rows of the pattern it learnt."""
    root = tmp_path_factory.mktemp("loss-check")
    hf, loss = trained_llama(root / "hf", steps=400, heads=8, kv_heads=2, layers=3)
    assert loss < math.log(VOCAB) - 2
    return hf, write_rows(root / "rows.jsonl", pattern_rows(64, 16, seed=5))


def first_trained_shards(tag, converted, out):
    """``out`` (a copy of ``tag``) with the model shards of ``converted`` and its ckptconv.json records updated, so
    that the checked reads pass: what a conversion with the wrong K/V order writes, under the tag's layout."""
    from ckptconv.digest import DEFAULT, record_files

    meta = json.loads((out / "ckptconv.json").read_text())
    shards = sorted((converted / "model").iterdir())
    for shard in shards:
        shutil.copyfile(shard, out / "model" / shard.name)
    records = record_files([out / "model" / s.name for s in shards], out, DEFAULT)
    meta["files"].update({rel: rec.to_json() for rel, rec in records.items()})
    (out / "ckptconv.json").write_text(json.dumps(meta))


def options(data, **extra):
    return train_options(data=str(data), gbs=8, tp=4, decay_steps=2, **extra)


def test_a_resume_read_with_the_wrong_trn2_kv_order_stops_before_step_1(trained, tmp_path, capsys):
    """A tag whose shards are in the official converter's trn2 K/V order (kvm 2) while its ckptconv.json says the
    runtime order: each query head meets the wrong K/V head. Every shape fits; only the loss says so."""
    hf, data = trained
    src = convert(hf, tmp_path / "runtime", hw_backend="trn2", **LAYOUT)
    ck = tmp_path / "ck"
    first = run_world(4, resume=str(src), checkpoint_dir=str(ck), log_jsonl=str(tmp_path / "a.jsonl"),
                      **options(data, steps=1))
    wrong = tmp_path / "wrong"  # the same tag with its model shards converted in the official order
    shutil.copytree(ck, wrong)
    official = convert(hf, tmp_path / "official", hw_backend="trn2", trn2_kv_layout="official", **LAYOUT)
    first_trained_shards(ck / "step_1", official, wrong / "step_1")
    config = TrainConfig.from_flat({**options(data, steps=2), "resume": str(wrong), "checkpoint_dir": str(wrong),
                                    "log_jsonl": str(tmp_path / "wrong.jsonl")})
    capsys.readouterr()
    assert spawn(run_worker, (config,), 4, timeout_s=WORLD_TIMEOUT, preload=PRELOAD) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"nxdtrain: error: --resume {wrong}: the first batch loss "), err
    assert (f"is far above the loss {first[0]['loss']:.3f} recorded in the tag (+ {ABOVE_RECORDED:g}); the weights "
            "were most likely read with the wrong layout: check the conversion's --qkv-linear/--fuse-qkv, "
            "--kv-size-multiplier, the trn1/trn2 head order (--hw-backend) and a tied lm_head (tie_word_embeddings); "
            "or pass --allow-high-loss to train anyway\n") in err
    assert not (tmp_path / "wrong.jsonl").exists() and not (wrong / "step_2").exists()  # no step was taken
    # The tag read as written passes the check and trains on.
    resumed = run_world(4, resume=str(ck), checkpoint_dir=str(ck), log_jsonl=str(tmp_path / "b.jsonl"),
                        **options(data, steps=2))
    assert [r["step"] for r in resumed] == [2]
    # --allow-high-loss takes the wrong one anyway, at the loss the check saw.
    allowed = run_world(4, resume=str(wrong), checkpoint_dir=str(wrong), log_jsonl=str(tmp_path / "c.jsonl"),
                        **options(data, steps=2, allow_high_loss=True))
    assert allowed[0]["loss"] > first[0]["loss"] + ABOVE_RECORDED


def test_a_random_init_start_is_not_stopped(nxd_model, trained, tmp_path, capsys):
    """A random tiny model sits at ln(vocab): a converted start from one trains (the check says what it saw)."""
    _, data = trained
    src = nxd_model("gqa2", **LAYOUT)
    log = run_world(4, resume=str(src), no_checkpoint=True, log_jsonl=str(tmp_path / "a.jsonl"),
                    **options(data, steps=1))
    assert abs(log[0]["loss"] - math.log(128)) < 0.2
    assert verdict(log[0]["loss"], vocab=128, recorded=None) is None


def test_the_margins():
    guess = math.log(32000)
    assert verdict(guess + 0.9 * ABOVE_GUESSING, vocab=32000, recorded=None) is None
    assert verdict(guess + 1.1 * ABOVE_GUESSING, vocab=32000, recorded=None).endswith("worse than guessing")
    assert verdict(13.4, vocab=128256, recorded=None) is not None  # AWS's 70B sample: 13.4 against ln V = 11.76
    assert verdict(float("nan"), vocab=32000, recorded=None) is not None
    assert verdict(2.0 + 0.9 * ABOVE_RECORDED, vocab=32000, recorded=2.0) is None
    assert "recorded in the tag" in verdict(2.0 + 1.1 * ABOVE_RECORDED, vocab=32000, recorded=2.0)
