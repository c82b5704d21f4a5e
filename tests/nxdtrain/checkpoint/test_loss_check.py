"""A wrong load is caught before it costs compute (issue 20, item 4): the first batch's loss of a resumed or
converted start, against ln(vocab) and against the loss the resumed tag recorded (nxdtrain.checkpoint.loss_check)."""

from __future__ import annotations

import math
import re
import shutil

import pytest

from nxdtrain.checkpoint.loss_check import ABOVE_GUESSING, ABOVE_RECORDED, verdict
from nxdtrain.cli import PRELOAD
from nxdtrain.config.options import TrainConfig
from nxdtrain.parallel.dist import spawn
from nxdtrain.train import run_worker
from tests.nxdtrain.harness import WORLD_TIMEOUT, convert, run_world, train_options
from tests.nxdtrain.wrong_loads import VOCAB, pair_kv_wrongly, pattern_rows, trained_llama, write_rows

LAYOUT = dict(tp=4, attention="qkv_linear", kv_size_multiplier=2)  # 8 heads, 2 KV heads: each KV head twice


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama trained until its loss is far below ln(vocab) (a random one sits at ln V, right or wrong),
    and rows of the pattern it learnt."""
    root = tmp_path_factory.mktemp("loss-check")
    hf, loss = trained_llama(root / "hf", steps=400, heads=8, kv_heads=2, layers=3)
    assert loss < math.log(VOCAB) - 2
    return hf, write_rows(root / "rows.jsonl", pattern_rows(64, 16, seed=5))


def options(data, **extra):
    return train_options(data=str(data), gbs=8, tp=4, decay_steps=2, **extra)


def stopped(source, data, tmp_path, capsys, steps):
    """Start from ``source`` in 4 processes; the one-line error (the run must stop before its first step)."""
    log = tmp_path / f"stopped-{source.name}.jsonl"
    config = TrainConfig.from_flat({**options(data, steps=steps), "resume": str(source), "no_checkpoint": True,
                                    "log_jsonl": str(log)})
    capsys.readouterr()
    assert spawn(run_worker, (config,), 4, timeout_s=WORLD_TIMEOUT, preload=PRELOAD) == 1
    assert not log.exists()  # no step was taken
    return capsys.readouterr().err


def test_shards_with_query_heads_paired_to_the_wrong_kv_heads_stop_before_step_1(trained, tmp_path, capsys):
    """K/V heads on the wrong tp ranks (the trn1/trn2 head-order mistake, with replicas that still agree): every
    shape and every replica check passes; only the loss says so, for a converted start and a resumed tag alike."""
    hf, data = trained
    src = convert(hf, tmp_path / "converted", **LAYOUT)
    ck = tmp_path / "ck"
    first = run_world(4, resume=str(src), checkpoint_dir=str(ck), log_jsonl=str(tmp_path / "a.jsonl"),
                      **options(data, steps=1))
    assert first[0]["loss"] < math.log(VOCAB) - 2
    causes = ("; the weights were most likely read with the wrong layout: check the conversion's --qkv-linear/"
              "--fuse-qkv, --kv-size-multiplier, the trn1/trn2 head order (--hw-backend) and a tied lm_head "
              "(tie_word_embeddings); or pass --allow-high-loss to train anyway\n")
    wrong_src = shutil.copytree(src, tmp_path / "wrong-converted")
    pair_kv_wrongly(wrong_src)
    err = stopped(wrong_src, data, tmp_path, capsys, steps=1)
    assert re.fullmatch(rf"nxdtrain: error: --resume {re.escape(str(wrong_src))}: the first batch loss (\d+\.\d+) is "
                        rf"above ln\(vocab 128\) = 4\.852 \+ 1, worse than guessing{re.escape(causes)}", err), err
    wrong_tag = shutil.copytree(ck / "step_1", tmp_path / "wrong-ck" / "step_1")
    pair_kv_wrongly(wrong_tag)
    err = stopped(wrong_tag, data, tmp_path, capsys, steps=2)
    assert err.startswith(f"nxdtrain: error: --resume {wrong_tag}: the first batch loss ") and causes in err, err
    # The tag read as written passes the check and trains on; --allow-high-loss takes the wrong one anyway.
    resumed = run_world(4, resume=str(ck), checkpoint_dir=str(ck), log_jsonl=str(tmp_path / "b.jsonl"),
                        **options(data, steps=2))
    assert [r["step"] for r in resumed] == [2]
    allowed = run_world(4, resume=str(wrong_src), no_checkpoint=True, log_jsonl=str(tmp_path / "c.jsonl"),
                        **options(data, steps=1, allow_high_loss=True))
    assert allowed[0]["loss"] > math.log(VOCAB) + ABOVE_GUESSING


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
