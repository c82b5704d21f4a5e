"""A rank reads the optimizer files it needs, not the world's (reads per rank must not grow with the world).

A 70B-shaped tag with tiny tensors (64 query and 8 K/V heads; benchmarks/reads.py builds it) at tp 4 x pp 2,
saved in nxdtrain's format 2 and rewritten in NxD's format over dp 2 with ZeRO-1. Which files a rank opens is
recorded with an audit hook on ``open`` and compared by name with what it needs: a rank of the tag's own layout
reads its own shard and, for the replicated norms, the first copy (tp rank 0 of its stage); a reshard part, the
(tp, pp) ranks of the files it writes (the same two per shard). What each rank reads is still checked, and the
parts together write what one process writes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from benchmarks.reads import build_tags, opened_under, resume_reads
from ckptconv.commands.api import RunOptions, reshard
from ckptconv.core.layout import parse_rank_file
from ckptconv.training.nxd_format.read import NxdOptimizer
from tests.nxdtrain.checkpoint.test_reshard_optimizer import tree_bytes

TP, PP, DP = 4, 2, 2
PROBE = "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt"  # nxdtrain's format or NxD's? (is_training_tag peeks at it)


@pytest.fixture(scope="module")
def tags(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_tags(tmp_path_factory.mktemp("reads"), tp=TP, pp=PP, dp=DP, layers=2)


def optim_files(ranks: set[tuple[int, int]], dps: int = DP) -> set[str]:
    return {f"optim/dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_{p:02d}.pt" for t, p in ranks for d in range(dps)}


def model_file(tp: int, pp: int) -> str:
    return f"model/dp_rank_00_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


def ranks_of(opened: set[str], under: str) -> set[tuple[int, int]]:
    found = {parse_rank_file(Path(p).name) for p in opened if p.startswith(under + "/")}
    return {(r[1], r[2]) for r in found if r is not None}


@pytest.mark.parametrize("rank", [(3, 1), (2, 0), (0, 1)])
def test_a_resume_rank_opens_its_own_files(tags: tuple[Path, Path], rank: tuple[int, int]) -> None:
    """A training rank restoring its weights and optimizer state from NxD's tag opens its own (tp, pp) rank's
    model file and optimizer files (every dp rank's: ZeRO-1 chunks) and those of tp rank 0 of its stage (the
    norms' first copy), plus the format probe: 4 or 2 of the 16 optimizer files, not all of them."""
    _, nxd = tags
    opened = set(resume_reads(nxd, tp_rank=rank[0], pp_rank=rank[1]))
    needed = {rank, (0, rank[1])}
    assert {p for p in opened if p.startswith("optim/")} == optim_files(needed) | {PROBE}
    assert ranks_of(opened, "model") == needed
    assert opened - {p for p in opened if p.startswith(("optim/", "model/"))} == {"ckptconv.json"}


def test_a_damaged_file_a_rank_reads_is_still_refused(tags: tuple[Path, Path], tmp_path: Path) -> None:
    """Reading lazily keeps the checks: a rank's own optimizer file with a flipped byte fails its CRC."""
    import shutil

    _, nxd = tags
    copy = tmp_path / "nxd"
    shutil.copytree(nxd, copy)
    victim = copy / "optim" / "dp_rank_01_tp_rank_03_pp_rank_01.pt"
    data = bytearray(victim.read_bytes())
    with NxdOptimizer.open(copy, lazy=True) as optim:  # a row of dp rank 1's chunk of a matrix's exp_avg_sq
        name = next(n for n in optim.names(3, 1) if len(optim.slot_info(3, 1, n)[1]) == 2)
        half = -(-optim.slot_info(3, 1, name)[1][0] // DP)
        chunk = optim.rows(3, 1, name, "exp_avg_sq", half, half + 1)
    needle = chunk.numpy().tobytes()
    at = bytes(data).rfind(needle)
    assert at > 0
    data[at] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(Exception, match="dp_rank_01_tp_rank_03_pp_rank_01"):
        resume_reads(copy, tp_rank=3, pp_rank=1)
    resume_reads(copy, tp_rank=2, pp_rank=0)  # a rank that does not read it is not refused for it


@pytest.mark.parametrize("which", ["nxd", "format2"])
def test_each_reshard_part_opens_the_ranks_of_its_files(tags: tuple[Path, Path], tmp_path: Path, which: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``reshard --optimizer-format nxd --part k/16`` (what every rank of nxdtrain's NxD-format save runs): part k
    opens the optimizer files of the (tp, pp) ranks of the files it writes, with tp rank 0 of their stage (the
    norms' first copy; a part checking the norms' replicas: every tp rank of that stage) and rank (0, 0) (which
    says what the optimizer is); the parts together write what one process writes, and the part that finishes
    last reads every rank's written files back (the names of every optimizer index, not only its own files').
    Of the model files it opens tp rank 0's of every stage (the plan's dtypes) and those of the ranks whose
    optimizer state it reads (the same sources), not the world's 8."""
    import ckptconv.training.nxd_format.write

    read_back: list[tuple[int, int]] = []
    real_check = ckptconv.training.nxd_format.write.check_written

    def recording(out: Path, plan: object) -> None:
        read_back.extend((s.tp, s.pp) for s in plan.names)  # type: ignore[attr-defined]
        real_check(out, plan)  # type: ignore[arg-type]

    monkeypatch.setattr("ckptconv.commands.api.check_written", recording)
    ours, nxd = tags
    tag = nxd if which == "nxd" else ours
    world = TP * PP * DP
    whole = tmp_path / "whole"
    reshard(tag, whole, tp=TP, pp=PP, dp=DP, zero1=True, optimizer_format="nxd", options=RunOptions(quiet=True))
    parts = tmp_path / "parts"
    read_back.clear()  # the whole run's
    total, model_total, earlier = 0, 0, set()
    for k in range(world):
        with opened_under(tag) as opened:
            result = reshard(tag, parts, tp=TP, pp=PP, dp=DP, zero1=True, optimizer_format="nxd",
                             options=RunOptions(quiet=True, part=(k, world), workers=1))
        written = set(result.files) - earlier  # the last part's result lists every file (it finalized)
        earlier |= written
        own = ranks_of(written, "optim") | ranks_of(written, "model")
        stages = {p for _, p in own}
        read = ranks_of(set(opened), "optim")
        assert own | {(0, p) for p in stages} <= read, (k, written, read)
        assert read <= {(t, p) for p in stages for t in range(TP)} | {(0, 0)}, (k, written, read)
        assert len(read) <= len(own) + 2 + (TP - 1), (k, written, read)  # not the world's 8 ranks
        model = {p for p in opened if p.startswith("model/")}
        assert model == {model_file(t, p) for t, p in read | {(0, p) for p in range(PP)}}, (k, written, model)
        total += len({p for p in opened if p.startswith("optim/")})
        model_total += len(model)
    dps = DP if which == "nxd" else 1  # format 2 at this layout: one file per shard
    assert total < world * TP * PP * dps / 2  # before: every part opened every one of them
    assert model_total < world * TP * PP / 2  # before: every part opened every model file's header
    assert sorted(read_back) == [(t, p) for t in range(TP) for p in range(PP)]  # by the last part alone
    assert tree_bytes(parts) == tree_bytes(whole)
    with NxdOptimizer.open(parts) as back, NxdOptimizer.open(whole) as one:
        for a, b in zip(back.params(), one.params(), strict=True):
            assert a.name == b.name and torch.equal(a.exp_avg, b.exp_avg) and torch.equal(a.master, b.master)


def test_a_rank_that_disagrees_with_the_first_is_refused_when_read(tags: tuple[Path, Path], tmp_path: Path) -> None:
    """The first rank parsed says what the optimizer is (ZeRO-1 with masters here); a rank parsed later whose files
    hold no masters is refused when its state is first read, naming its file; ranks never read are not parsed."""
    import shutil

    from ckptconv.errors import ConversionError
    from ckptconv.io.nxd_read import NxdCheckpoint

    _, nxd = tags
    copy = tmp_path / "nxd"
    shutil.copytree(nxd, copy)
    for dp in range(DP):  # rank (3, 1) saved without use_master_weights_in_ckpt
        path = copy / "optim" / f"dp_rank_{dp:02d}_tp_rank_03_pp_rank_01.pt"
        state = torch.load(path, weights_only=True)
        del state["sharded_master_weights"]
        torch.save(state, path)
    with NxdOptimizer(NxdCheckpoint(copy, check=False), check=False) as optim:  # its record no longer matches
        assert optim.has_masters and optim.parsed_ranks() == [(0, 0)]
        optim.rows(2, 1, optim.names(2, 1)[0], "master", 0, 1)
        with pytest.raises(ConversionError, match=r"dp_rank_00_tp_rank_03_pp_rank_01\.pt: zero1 without masters; "
                                                  r"tp rank 0 pp rank 0 holds zero1 with masters"):
            optim.names(3, 1)
        assert optim.parsed_ranks() == [(0, 0), (2, 1)]
    with pytest.raises(ConversionError, match="different optimizer formats"), NxdOptimizer.open(copy, check=False):
        pass


@pytest.mark.parametrize(("which", "fmt"), [("format2", "nxdtrain"), ("nxd", "nxdtrain"), ("format2", "nxd")])
def test_parts_at_another_layout_without_zero1_write_what_one_process_writes(tags: tuple[Path, Path], tmp_path: Path,
                                                                              which: str, fmt: str) -> None:
    """Split by unit before planning, 3 parts of tp 4 x pp 2 -> tp 2 x pp 1 without ZeRO-1 (one optimizer file per
    shard) write the bytes one process writes, in either optimizer format and from either source format."""
    ours, nxd = tags
    tag = nxd if which == "nxd" else ours
    kwargs = {"tp": 2, "pp": 1, "dp": 2, "zero1": False, "optimizer_format": fmt,
              **({"drop_masters": True} if fmt == "nxd" else {})}
    reshard(tag, tmp_path / "whole", options=RunOptions(quiet=True), **kwargs)
    for k in range(3):
        reshard(tag, tmp_path / "parts", options=RunOptions(quiet=True, part=(k, 3)), **kwargs)
    assert tree_bytes(tmp_path / "parts") == tree_bytes(tmp_path / "whole")


def test_a_model_file_that_disagrees_with_its_stage_is_refused_by_whoever_reads_it(tags: tuple[Path, Path],
                                                                                   tmp_path: Path) -> None:
    """A part takes the plan's dtypes from tp rank 0 of each stage: a model file of another tp rank holding a norm
    in another dtype is refused, naming the file, by the one-process reshard and by verify (both check every
    header) and by exactly the parts that open that file (they read it); the other parts no longer check it."""
    import shutil

    from ckptconv.commands.verify import verify
    from ckptconv.errors import ConversionError
    from ckptconv.io.nxd_read import NxdCheckpoint

    ours, _ = tags
    copy = tmp_path / "format2"
    shutil.copytree(ours, copy)
    victim = model_file(3, 1)
    state = torch.load(copy / victim, weights_only=True)
    norm = next(k for k in state if k.endswith("post_attention_layernorm.weight"))
    stage_dtype = str(state[norm].dtype).removeprefix("torch.")
    assert stage_dtype != "float64"
    state[norm] = state[norm].double()
    torch.save(state, copy / victim)
    with NxdCheckpoint(copy, check=False) as ckpt:  # the assumption itself, without ckptconv.json's dtype
        ckpt.dtypes(stages_only=True)  # one file per stage: the victim is not read
        with pytest.raises(ConversionError, match=rf"{Path(victim).name}: {norm!r} is float64, "
                                                  rf"{model_file(0, 1)} holds it as {stage_dtype}: "):
            ckpt.dtypes()
        ckpt.check_stages([model_file(2, 1), model_file(3, 0)])
    unchecked = RunOptions(quiet=True, check=False)  # its recorded digest no longer matches: dtypes must refuse it
    message = rf"{Path(victim).name}: {norm!r} is float64"
    with pytest.raises(ConversionError, match=message):
        reshard(copy, tmp_path / "whole", tp=TP, pp=PP, dp=DP, zero1=True, optimizer_format="nxd", options=unchecked)
    with pytest.raises(ConversionError, match=message):
        verify(ours.parent / "hf", copy, check=False)
    world, refused, opening = TP * PP * DP, [], []
    for k in range(world):
        with opened_under(copy) as opened:
            try:
                reshard(copy, tmp_path / f"part{k}", tp=TP, pp=PP, dp=DP, zero1=True, optimizer_format="nxd",
                        options=RunOptions(quiet=True, check=False, part=(k, world), workers=1))
            except ConversionError as exc:
                assert re.search(message, str(exc)), (k, exc)
                refused.append(k)
        if victim in opened:
            opening.append(k)
    assert refused == opening and 0 < len(refused) < world
