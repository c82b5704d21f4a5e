"""A vocabulary tp does not divide: zero rows pad the embedding and lm_head shards, ckptconv.json records the
padding, to-hf strips it, and shards another tool padded further (NxDT: to 128 x tp) are read with the real vocab."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import ckptconv
from ckptconv.commands.verify import verify
from ckptconv.io.nxd_read import load_shard
from ckptconv.io.nxd_write import save_shard
from tests.conftest import hf_state, warns_no_tokenizer
from tests.test_roundtrip import assert_same_state
from tests.test_verify_reshard import SHARD

QUIET = ckptconv.RunOptions(quiet=True, workers=2)
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture(scope="module")
def vocab1003(tiny_models) -> dict[str, Path]:
    return {"tied": tiny_models("vocab1003-tied", heads=8, kv_heads=2, layers=4, vocab=1003, tied=True),
            "untied": tiny_models("vocab1003", heads=8, kv_heads=2, layers=4, vocab=1003)}


@pytest.mark.parametrize("tied", ["tied", "untied"])
def test_tp4_pp2_pads_with_zero_rows_and_to_hf_strips_them(vocab1003, tmp_path: Path, tied: str):
    src = vocab1003[tied]
    result = ckptconv.to_nxd(src, tmp_path / "nxd", tp=4, pp=2, attention="qkv_linear", fuse_qkv=True,
                             kv_size_multiplier=2, options=QUIET)
    assert any("vocab_size 1003 is padded to 1004 rows" in n for n in result.notes)
    assert json.loads((tmp_path / "nxd" / "ckptconv.json").read_text())["layout"]["padded_vocab"] == 1004
    hf = hf_state(src)
    head = hf[EMBED] if tied == "tied" else hf[LM_HEAD]
    for rank in range(4):
        first, last = (load_shard(tmp_path / "nxd" / "model" / SHARD.format(rank, pp)) for pp in (0, 1))
        assert first[EMBED].shape == last[LM_HEAD].shape == (251, 64)
        real = min(251, 1003 - rank * 251)
        assert torch.equal(first[EMBED][:real], hf[EMBED][rank * 251:rank * 251 + real])
        assert torch.equal(last[LM_HEAD][:real], head[rank * 251:rank * 251 + real])
        assert not first[EMBED][real:].any() and not last[LM_HEAD][real:].any()
    assert verify(src, tmp_path / "nxd")["ok"]
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "hf", options=QUIET)
    assert_same_state(hf_state(tmp_path / "hf"), hf)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 1003


def test_reshard_repads_for_the_new_tp(vocab1003, tmp_path: Path):
    src = vocab1003["untied"]
    ckptconv.to_nxd(src, tmp_path / "tp4", tp=4, attention="qkv_linear", kv_size_multiplier=2, options=QUIET)
    ckptconv.reshard(tmp_path / "tp4", tmp_path / "tp2", tp=2, pp=2, options=QUIET)
    assert json.loads((tmp_path / "tp2" / "ckptconv.json").read_text())["layout"]["padded_vocab"] == 1004
    direct = ckptconv.to_nxd(src, tmp_path / "direct", tp=2, pp=2, attention="qkv_linear", options=QUIET)
    assert direct.finalized
    for rank in range(2):
        for pp in range(2):
            a = load_shard(tmp_path / "tp2" / "model" / SHARD.format(rank, pp))
            b = load_shard(tmp_path / "direct" / "model" / SHARD.format(rank, pp))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def pad_like_nxdt(converted: Path, hf: dict[str, torch.Tensor], out: Path, rows: int, tp: int) -> None:
    """Shards as a tool padding the vocabulary to ``rows`` writes them: each rank's block of the embedding (and
    lm_head) padded with zero rows after the last real one; no ckptconv.json (config.json under hf/)."""
    shutil.copytree(converted, out)
    (out / "ckptconv.json").unlink()
    per = rows // tp
    for path in sorted((out / "model").glob("*.pt")):
        state = load_shard(path)
        rank = int(path.name.split("_tp_rank_")[1][:2])
        for key in (EMBED, LM_HEAD):
            if key in state:
                full = torch.zeros(rows, 64)
                full[:1003] = hf[key] if key in hf else hf[EMBED]
                state[key] = full[rank * per:(rank + 1) * per].clone()
        save_shard(path, state)


def test_shards_padded_by_another_tool_are_read_with_the_real_vocab(vocab1003, tmp_path: Path):
    """NxDT pads to a multiple of 128 x tp: 1024 rows at tp 2 (512 per rank)."""
    src = vocab1003["untied"]
    ckptconv.to_nxd(src, tmp_path / "ours", tp=2, attention="qkv_linear", options=QUIET)
    pad_like_nxdt(tmp_path / "ours", hf_state(src), tmp_path / "nxdt", rows=1024, tp=2)
    info = ckptconv.inspect(tmp_path / "nxdt")
    assert info["model"]["vocab"] == 1003
    assert verify(src, tmp_path / "nxdt")["ok"]
    with warns_no_tokenizer():
        result = ckptconv.to_hf(tmp_path / "nxdt", tmp_path / "hf", options=QUIET)
    assert any("embedding padded to 1024 rows (vocab_size 1003)" in n for n in result.notes)
    assert_same_state(hf_state(tmp_path / "hf"), hf_state(src))
    ckptconv.reshard(tmp_path / "nxdt", tmp_path / "re", tp=2, pp=1, options=QUIET)  # our own padding: 1004
    assert json.loads((tmp_path / "re" / "ckptconv.json").read_text())["layout"]["padded_vocab"] == 1004
    assert verify(src, tmp_path / "re")["ok"]


def test_a_padding_tp_does_not_divide_is_refused():
    from ckptconv.core.layout import ParallelLayout
    from ckptconv.core.model_spec import ModelSpec
    from ckptconv.errors import ConversionError

    spec = ModelSpec(hidden=64, heads=8, kv_heads=2, head_dim=8, intermediate=96, vocab=1003, layers=2, tied=False)
    with pytest.raises(ConversionError, match=r"padded vocabulary of 1006 rows: must be a multiple of --tp 4 and at "
                                              r"least vocab_size \(1003\)"):
        ParallelLayout(tp=4, padded_vocab=1006).check_model(spec)
    with pytest.raises(ConversionError, match="padded vocabulary of 1000 rows"):
        ParallelLayout(tp=4, padded_vocab=1000).check_model(spec)


@pytest.mark.parametrize("tied", ["tied", "untied"])
def test_to_dcp_of_padded_shards_strips_the_padding_and_from_dcp_pads_again(vocab1003, tmp_path: Path, tied: str):
    """TorchTitan's DCP has no tp: it holds the real 1003 rows, whether read from HF or from shards padded to 1004;
    from-dcp to tp 4 pads again (the shards of a direct to-nxd), to HF gives the source back."""
    from ckptconv.io.dcp import distcp_name

    src = vocab1003[tied]
    layout = dict(tp=4, pp=2, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=2)
    ckptconv.to_nxd(src, tmp_path / "nxd", options=QUIET, **layout)
    ckptconv.to_dcp(tmp_path / "nxd", tmp_path / "dcp", options=QUIET)
    ckptconv.to_dcp(src, tmp_path / "dcp-from-hf", options=QUIET)
    assert (tmp_path / "dcp" / distcp_name(0)).read_bytes() == (tmp_path / "dcp-from-hf" / distcp_name(0)).read_bytes()
    ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "back", to="nxd", options=QUIET, **layout)
    assert json.loads((tmp_path / "back" / "ckptconv.json").read_text())["layout"]["padded_vocab"] == 1004
    for rank in range(4):
        for pp in range(2):
            a = load_shard(tmp_path / "back" / "model" / SHARD.format(rank, pp))
            b = load_shard(tmp_path / "nxd" / "model" / SHARD.format(rank, pp))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (rank, pp)
    ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "hf", to="hf", options=QUIET)
    assert_same_state(hf_state(tmp_path / "hf"), hf_state(src))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 1003
