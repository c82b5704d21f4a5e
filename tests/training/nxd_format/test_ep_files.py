"""NxD's own expert-parallel ZeRO-1 optimizer files (issue 29, item 3): ``reshard --optimizer-format nxd`` at ep > 1
writes ``NeuronEPZero1Optimizer.state_dict()`` per dp rank, and such files are read back per ep rank.

The structure the tests expect is written out here from neuronx-distributed's source (release 2.29,
``optimizer/zero_redundancy_optimizer.py``: ``NeuronEPZero1Optimizer.state_dict`` merges the non-expert and the expert
``NeuronZero1Optimizer`` states; ``parallel_layers/parallel_state.py``: the expert rank mesh ``[pp, dp_exp, ep, tp]``),
not from ckptconv's writer: keys ``ep_param_id_offset`` (1: the wrappers' own ``state`` is empty),
``ep_param_group_offset`` (the non-expert group count), ``ep_base_state_offset``/``ep_shape_info_offset`` (the
non-expert index count), ``param_groups`` (non-expert groups then expert groups, each numbered from 0, empty groups
kept), ``state`` {}, ``base_state``/``shape_info`` (expert indices shifted), no masters. dp rank ``d`` holds chunk
``d`` of the non-expert state (dim 0 over all dp) and chunk ``d // ep`` of ep rank ``d % ep``'s expert slabs.
Expectations come from the HF weights (tests/moe_tags.py: every component a function of its weight).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

import ckptconv
from ckptconv.errors import ConversionError
from ckptconv.io.digest import record_files
from ckptconv.io.metadata import read_metadata, write_metadata
from ckptconv.io.nxd_read import load_shard
from ckptconv.training import NxdOptimizer
from tests.moe_tags import ADAMW, E, all_state, expected_expert, expert_in_tag, state_of, write_tag

QUIET = ckptconv.RunOptions(quiet=True, workers=1)
UNCHECKED = ckptconv.RunOptions(quiet=True, workers=1, check=False)  # hand-written optim/ has no digests
LAYERS = {"mixtral": (0, 1), "qwen3_moe": (0, 2)}
NXD_KEYS = ["ep_param_id_offset", "ep_param_group_offset", "ep_base_state_offset", "ep_shape_info_offset",
            "param_groups", "state", "base_state", "shape_info"]  # NeuronEPZero1Optimizer.state_dict()'s order
MOMENTS = ("exp_avg", "exp_avg_sq")


def _nxd_schedule(tag: Path) -> Path:
    """The tag's schedule as NxD's CosineAnnealing (the one NxD's scheduler state can hold), digests updated."""
    torch.save({"step": 7, "schedule": "CosineAnnealing", "lr": 1e-3, "min_lr": 1e-4, "warmup": 2, "decay_steps": 20},
               tag / "scheduler.pt")
    meta = read_metadata(tag)
    assert meta is not None
    meta.files.update({rel: rec.to_json() for rel, rec in record_files([tag / "scheduler.pt"], tag, "blake3").items()})
    write_metadata(tag, meta)
    return tag


def _is_expert(key: str) -> bool:
    return "expert_mlps" in key


def _no_decay(key: str) -> bool:  # NxD's Llama example's rule (bias-norm), the writer's default
    return "bias" in key or "norm" in key


def _grouped(names: list[str]) -> list[list[str]]:
    return [[n for n in names if not _no_decay(n)], [n for n in names if _no_decay(n)]]


def _shards(tag: Path, ep: int, tp: int) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    return {(e, t): load_shard(tag / "model" / f"dp_rank_00_ep_rank_{e:02d}_tp_rank_{t:02d}_pp_rank_00.pt")
            for e in range(ep) for t in range(tp)}


def _chunk(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    rows = math.ceil(full.shape[0] / world)
    return torch.cat([full, full.new_zeros((rows * world - full.shape[0], *full.shape[1:]))])[rank * rows:][:rows]


def _adamw(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    return {c: v for c, v in state_of(weight).items() if c in ("step", *MOMENTS)}  # no masters in NxD's EP files


def _expected_file(shards: dict[tuple[int, int], dict[str, torch.Tensor]], tp_rank: int, dp_rank: int, dp: int,
                   ep: int) -> tuple[list[list[str]], list[list[str]], dict[int, dict[str, torch.Tensor]]]:
    """(non-expert groups, expert groups, base_state) NxD's EP ZeRO-1 save of dp rank ``dp_rank`` holds."""
    first = shards[(0, tp_rank)]
    dense = _grouped([k for k in first if not _is_expert(k) and not k.endswith("inv_freq")])
    mine = shards[(dp_rank % ep, tp_rank)]
    experts = _grouped([k for k in first if _is_expert(k)])
    base: dict[int, dict[str, torch.Tensor]] = {}
    for i, name in enumerate(n for g in dense for n in g):
        base[i] = {c: _chunk(v, dp_rank, dp) if v.dim() else v for c, v in _adamw(first[name]).items()}
    offset = len(base)
    for j, name in enumerate(n for g in experts for n in g):
        base[offset + j] = {c: _chunk(v, dp_rank // ep, dp // ep) if v.dim() else v
                            for c, v in _adamw(mine[name]).items()}
    return dense, experts, base


def _check_nxd_files(nxd: Path, *, ep: int, tp: int, dp: int) -> None:
    """Every file of an NxD EP tag holds what NxD's EP ZeRO-1 save of its dp rank holds (this module's docstring)."""
    shards = _shards(nxd, ep, tp)
    for t in range(tp):
        for d in range(dp):
            saved = torch.load(nxd / "optim" / f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt", weights_only=True)
            dense, experts, base = _expected_file(shards, t, d, dp, ep)
            assert list(saved) == NXD_KEYS
            count = sum(map(len, dense))
            assert (saved["ep_param_id_offset"], saved["ep_param_group_offset"], saved["ep_base_state_offset"],
                    saved["ep_shape_info_offset"], saved["state"]) == (1, 2, count, count, {})
            assert [g["params"] for g in saved["param_groups"]] == [
                list(range(len(dense[0]))), list(range(len(dense[0]), count)), list(range(len(experts[0]))), []]
            assert [g["weight_decay"] for g in saved["param_groups"]] == [0.1, 0.0, 0.1, 0.0]
            assert saved["base_state"].keys() == base.keys()
            for i, want in base.items():
                for c in ("step", *MOMENTS):
                    got = saved["base_state"][i][c]
                    assert got.shape == want[c].shape and torch.equal(got, want[c]), (t, d, i, c)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_ep1_to_nxds_ep2_files_and_back_carries_every_experts_moments(moe_hf, tmp_path: Path, family: str):
    """An MoE tag at ep 1 -> NxD's EP ZeRO-1 files at ep 2 x tp 2 (dp 4: 2 expert-data-parallel ranks per ep rank)
    -> nxdtrain's format 2 at ep 1: the NxD files hold NxD's structure with each dp rank's chunks, and every expert's
    moments come back exactly (the masters cannot: NxD's EP files hold none, --drop-masters says so)."""
    src = _nxd_schedule(write_tag(moe_hf(family), tmp_path / "ep1", dp=2, zero1=True))
    nxd = tmp_path / "nxd"
    ckptconv.reshard(src, nxd, ep=2, tp=2, dp=4, optimizer_format="nxd", drop_masters=True, options=QUIET)
    _check_nxd_files(nxd, ep=2, tp=2, dp=4)
    back = tmp_path / "back"
    ckptconv.reshard(nxd, back, ep=1, tp=1, dp=2, zero1=True, options=QUIET)
    for layer in LAYERS[family]:
        for expert in range(E):
            for component in MOMENTS:
                got = expert_in_tag(back, layer, expert, component)
                want = expected_expert(moe_hf(family), family, layer, expert, component)
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (layer, expert, component)
    before, after = all_state(src), all_state(back)
    moments = {k for k in before if not k[1].endswith(".master")}
    assert set(after) == moments and all(torch.equal(before[k], after[k]) for k in moments)


def _hand_built(hf_dir: Path, out: Path) -> Path:
    """An ep 2 tag (tp 1, dp 4, 2 experts per ep rank, 2 expert-data-parallel ranks) whose optim/ is written here by
    torch.save in NxD's EP ZeRO-1 structure (this module's docstring), param groups in NxD's key order."""
    ckptconv.to_nxd(hf_dir, out, ep=2, options=QUIET)
    shards = _shards(out, 2, 1)
    (out / "optim").mkdir()
    hyper = {k: (list(v) if k == "betas" else v) for k, v in ADAMW.items()}
    for d in range(4):
        dense, experts, base = _expected_file(shards, 0, d, 4, 2)
        groups = []
        for part in (dense, experts):
            start = 0
            for g, names in enumerate(part):
                groups.append({"weight_decay": 0.1 if g == 0 else 0.0, **hyper, "initial_lr": 1e-3,
                               "params": list(range(start, start + len(names)))})
                start += len(names)
        count = sum(map(len, dense))
        names = [n for g in dense for n in g] + [n for g in experts for n in g]
        shape_of = {**shards[(0, 0)], **shards[(d % 2, 0)]}
        torch.save({"ep_param_id_offset": 1, "ep_param_group_offset": 2, "ep_base_state_offset": count,
                    "ep_shape_info_offset": count, "param_groups": groups, "state": {}, "base_state": base,
                    "shape_info": {i: list(shape_of[n].shape) for i, n in enumerate(names)}},
                   out / "optim" / f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt")
    torch.save({"total_steps": 7, "batch_idx": 6, "epoch": 0, "cli_args": {}}, out / "user_content.pt")
    return out


def test_a_hand_built_nxd_ep_file_is_read_per_ep_rank(moe_hf, tmp_path: Path):
    """NxD's structure built by hand: every parameter's state read whole per ep rank (an ep rank's experts from its
    own dp ranks' chunks), and resharded into format 2 at ep 1 every expert's moments are the HF expert's."""
    tag = _hand_built(moe_hf("mixtral"), tmp_path / "nxd")
    shards = _shards(tag, 2, 1)
    with NxdOptimizer.open(tag, check=False) as optim:
        assert optim.ep == 2 and optim.dp == 4 and not optim.has_masters
        seen = 0
        for p in optim.params():
            want = state_of(shards[(p.ep_rank, 0)][p.name])
            assert p.step == 7 and torch.equal(p.exp_avg, want["exp_avg"]), (p.name, p.ep_rank)
            assert torch.equal(p.exp_avg_sq, want["exp_avg_sq"]), (p.name, p.ep_rank)
            seen += 1
        assert seen == sum(len(s) for s in shards.values()) - sum(k.endswith("inv_freq") for k in shards[(0, 0)])
    ckptconv.reshard(tag, tmp_path / "back", ep=1, dp=1, zero1=False, options=UNCHECKED)
    for layer in LAYERS["mixtral"]:
        for expert in range(E):
            for component in MOMENTS:
                got = expert_in_tag(tmp_path / "back", layer, expert, component)
                want = expected_expert(moe_hf("mixtral"), "mixtral", layer, expert, component)
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (layer, expert, component)


def test_refusals(moe_hf, tmp_path: Path):
    """What NxD's EP files cannot hold or ckptconv does not write, refused in one line before a byte is written;
    NxD files that do not fit NeuronEPZero1Optimizer's merge, refused naming the file and key."""
    src = _nxd_schedule(write_tag(moe_hf("mixtral"), tmp_path / "src", dp=2, zero1=True))
    with pytest.raises(ConversionError, match=r"NxD's expert-parallel ZeRO-1 files hold no master weights .* "
                                              r"pass --drop-masters"):
        ckptconv.reshard(src, tmp_path / "a", ep=2, dp=2, optimizer_format="nxd", options=QUIET)
    with pytest.raises(ConversionError, match=r"--optimizer-format nxd at ep 2 without ZeRO-1: NxD's per-ep-rank "
                                              r"AdamW files .* are not written; pass --zero1"):
        ckptconv.reshard(src, tmp_path / "b", ep=2, zero1=False, optimizer_format="nxd", drop_masters=True,
                         options=QUIET)
    assert not any((tmp_path / d).exists() for d in "ab")
    tag = _hand_built(moe_hf("mixtral"), tmp_path / "nxd")
    path = tag / "optim" / "dp_rank_01_tp_rank_00_pp_rank_00.pt"
    saved = torch.load(path, weights_only=True)
    for change, message in [({"ep_base_state_offset": 3}, r"ep_base_state_offset is 3, NxD's merge of \d+ non-expert "
                                                           r"parameters gives \d+"),
                            ({"ep_shape_info_offset": None}, r"no 'ep_shape_info_offset'; the shards are "
                                                             r"expert-parallel")]:
        broken = tmp_path / f"broken-{next(iter(change))}"
        shutil.copytree(tag, broken)
        edited = {k: v for k, v in {**saved, **change}.items() if v is not None}
        torch.save(edited, broken / "optim" / path.name)
        with pytest.raises(ConversionError, match=r"dp_rank_01_tp_rank_00_pp_rank_00.pt: " + message):
            ckptconv.reshard(broken, tmp_path / "d", ep=1, options=UNCHECKED)
    assert not (tmp_path / "d").exists()


def test_nxd_files_of_an_moe_tag_at_ep1_chunk_whole_experts(moe_hf, tmp_path: Path):
    """At ep 1 (NeuronZero1Optimizer's files) a stacked expert tensor is chunked by whole experts as well (torch-xla's
    dim-0 chunk): every index of both dp ranks' files holds its rows of its parameter's moments; NxD's EP tag written
    from it at ep 2, then rewritten at ep 1, gives the same files' moments."""
    src = _nxd_schedule(write_tag(moe_hf("mixtral"), tmp_path / "ep1", dp=2, zero1=True))
    ckptconv.reshard(src, tmp_path / "nxd", dp=2, optimizer_format="nxd", drop_masters=True, options=QUIET)
    ckptconv.reshard(src, tmp_path / "ep2", ep=2, dp=2, optimizer_format="nxd", drop_masters=True, options=QUIET)
    ckptconv.reshard(tmp_path / "ep2", tmp_path / "again", ep=1, dp=2, optimizer_format="nxd", options=QUIET)
    shard = load_shard(tmp_path / "nxd" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    names = [n for g in _grouped([k for k in shard if not k.endswith("inv_freq")]) for n in g]
    stacked = 0
    for d in range(2):
        saved, again = (torch.load(tag / "optim" / f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt", weights_only=True)
                        for tag in (tmp_path / "nxd", tmp_path / "again"))
        for i, name in enumerate(names):
            want = _adamw(shard[name])
            stacked += want["exp_avg"].dim() == 3 and d == 0
            for c in MOMENTS:
                assert torch.equal(saved["base_state"][i][c], _chunk(want[c], d, 2)), (d, name, c)
                assert torch.equal(again["base_state"][i][c], saved["base_state"][i][c]), (d, name, c)
    assert stacked == 4  # gate_up and down of both layers


def test_padding_experts_are_zero(moe_hf, tmp_path: Path):
    """dp 6 at ep 2: 2 experts per ep rank over 3 expert-data-parallel ranks, so torch-xla pads each slab to 3 experts
    and the third rank (dp ranks 4, 5) holds one zero expert; back at ep 1 nothing of the padding remains."""
    src = _nxd_schedule(write_tag(moe_hf("mixtral"), tmp_path / "ep1", dp=2, zero1=True))
    ckptconv.reshard(src, tmp_path / "nxd", ep=2, dp=6, optimizer_format="nxd", drop_masters=True, options=QUIET)
    _check_nxd_files(tmp_path / "nxd", ep=2, tp=1, dp=6)
    last = torch.load(tmp_path / "nxd" / "optim" / "dp_rank_05_tp_rank_00_pp_rank_00.pt", weights_only=True)
    padded = [v for i, v in last["base_state"].items() if len(last["shape_info"][i]) == 3]
    assert len(padded) == 4 and all(not v[c].any() and v[c].shape[0] == 1 for v in padded for c in MOMENTS)
    ckptconv.reshard(tmp_path / "nxd", tmp_path / "back", ep=1, dp=2, zero1=True, options=QUIET)
    before, after = all_state(src), all_state(tmp_path / "back")
    assert all(torch.equal(before[k], after[k]) for k in after) and len(after) == len(before) * 3 // 4


def test_xser_split_ep_files_read_back(moe_hf, tmp_path: Path):
    """With xser-split shards the EP files are xser-split too (as NxD's use_xser save), and read back exactly."""
    src = _nxd_schedule(write_tag(moe_hf("mixtral"), tmp_path / "ep1", dp=2, zero1=True))
    ckptconv.reshard(src, tmp_path / "nxd", ep=2, dp=4, flavour="xser-split", optimizer_format="nxd",
                     drop_masters=True, options=QUIET)
    assert (tmp_path / "nxd" / "optim" / "dp_rank_03_tp_rank_00_pp_rank_00.pt.info.pt").is_file()
    ckptconv.reshard(tmp_path / "nxd", tmp_path / "back", ep=1, dp=2, zero1=True, flavour="plain", options=QUIET)
    before, after = all_state(src), all_state(tmp_path / "back")
    assert {k for k in before if not k[1].endswith(".master")} == set(after)
    assert all(torch.equal(before[k], after[k]) for k in after)


def test_param_group_fields_nxd_lacks_are_left_out_and_named_at_ep2_as_at_ep1(moe_hf, tmp_path: Path):
    """A source param-group field NxD 2.28's AdamW has not is left out of NxD's files at ep > 1 as at ep 1, and both
    say so (the expert-parallel writer once dropped the note)."""
    src = _nxd_schedule(write_tag(moe_hf("mixtral"), tmp_path / "ep1", dp=2, zero1=True))
    for path in (src / "optim").iterdir():
        state = torch.load(path, weights_only=True)
        state["param_groups"] = [{**g, "nesterov": False} for g in state["param_groups"]]
        torch.save(state, path)
    notes = {}
    for ep in (1, 2):
        out = tmp_path / f"nxd-ep{ep}"
        result = ckptconv.reshard(src, out, ep=ep, tp=1, dp=2, zero1=True, optimizer_format="nxd", drop_masters=True,
                                  options=UNCHECKED)
        notes[ep] = [n for n in result.notes if n.startswith("param-group fields")]
        for path in (out / "optim").iterdir():
            groups = torch.load(path, weights_only=True)["param_groups"]
            assert groups and all("nesterov" not in g and "lr" in g for g in groups), path
    assert notes[1] == notes[2] == ["param-group fields NxD 2.28's AdamW has not, not written: nesterov"]


def test_drop_masters_with_no_masters_to_drop_is_said_at_ep2_as_at_ep1(moe_hf, tmp_path: Path):
    """``--drop-masters`` on a source that saved no masters (NxD's own EP tag) writes the same files as without it,
    and says so at ep 2 as at ep 1 (the expert-parallel writer once said nothing: its notes were a copy of the ep-1
    writer's that drifted)."""
    src = _nxd_schedule(write_tag(moe_hf("mixtral"), tmp_path / "ep1", dp=2, zero1=True))
    ckptconv.reshard(src, tmp_path / "nxd-ep2", ep=2, dp=2, optimizer_format="nxd", drop_masters=True, options=QUIET)
    said = {}
    for ep in (1, 2):
        result = ckptconv.reshard(tmp_path / "nxd-ep2", tmp_path / f"again-ep{ep}", ep=ep, dp=2, zero1=True,
                                  optimizer_format="nxd", drop_masters=True, options=QUIET)
        said[ep] = [n for n in result.notes if n.startswith("--drop-masters")]
    assert said == {1: ["--drop-masters: nothing dropped (NxD's ZeRO-1 files keep the masters and fp32 moments)"],
                    2: ["--drop-masters: nothing dropped (the source saved no master weights)"]}
