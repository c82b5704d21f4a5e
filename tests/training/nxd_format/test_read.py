"""NxD's own training tags (fixtures/nxdt-official/, written by NxD 2.28's save_checkpoint) read as they are.

The references are what NxD itself held (each case's ``reference/``): the masters at the save, and the
weights after step 3 with the recorded gradients. The moments are not recorded directly, so they are
checked by continuing step 3 in plain torch AdamW from what the reader returns and comparing with
NxD's own step 3: a wrong moment, step, parameter name or group moves a weight by about the learning
rate (1e-2), far above the tolerance.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptconv.commands.api import reshard, to_hf
from ckptconv.commands.inspect import inspect
from ckptconv.commands.verify import verify
from ckptconv.engine.options import RunOptions
from ckptconv.errors import ConversionError, UnsafeCheckpointError
from ckptconv.training.nxd_format.ranks import OptimFormat
from ckptconv.training.nxd_format.read import NxdOptimizer, read_optimizer_state
from tests.conftest import fixture_cases, hf_state, warns_no_tokenizer

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "nxdt-official"
CASES = fixture_cases(FIXTURES)
MASTER_CASES = [c for c in CASES if "masters" in c]
QUIET = RunOptions(quiet=True, workers=1)


def manifest(case: str) -> dict[str, Any]:
    return json.loads((FIXTURES / case / "case.json").read_text())


def tag_of(case: str) -> Path:
    m = manifest(case)
    return FIXTURES / case / m["checkpoint_root"] / m["tag"]


def reference(case: str, name: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / case / "reference" / f"{name}.safetensors")


def copy_tag(case: str, tmp: Path) -> Path:
    """A writable copy of a case's tag (with the empty directories git does not keep)."""
    m = manifest(case)
    shutil.copytree(FIXTURES / case / m["checkpoint_root"], tmp / m["checkpoint_root"])
    for rel in m["empty_dirs"]:  # relative to the case folder, like the checkpoint root
        (tmp / rel).mkdir(parents=True, exist_ok=True)
    return tmp / m["checkpoint_root"] / m["tag"]


def test_every_case_is_covered() -> None:
    assert len(CASES) >= 11 and len(MASTER_CASES) == 5, CASES


# --------------------------------------------------------------------------------------------
# The reader against what NxD held


@pytest.mark.parametrize("case", CASES)
def test_reader_knows_the_format_and_the_names(case: str) -> None:
    m = manifest(case)
    with NxdOptimizer.open(tag_of(case)) as optim:
        expected_format = (OptimFormat.ZERO1_DCP if m["flags"]["use_zero1_dcp"]
                           else OptimFormat.ZERO1 if m["flags"]["zero1"] else OptimFormat.ADAMW)
        assert optim.format is expected_format
        assert optim.dp == 1 and optim.has_masters == m["flags"]["use_master_weights_in_ckpt"]
        groups = optim.groups()
        assert [g["params"] for g in groups] == [g["params"] for g in m["param_groups"]]
        assert [g["weight_decay"] for g in groups] == [g["weight_decay"] for g in m["param_groups"]]
        assert sorted(optim.names()) == sorted(m["param_names"])
        assert optim.step() == m["saved_after_step"]


@pytest.mark.parametrize("case", MASTER_CASES)
def test_masters_are_exactly_what_nxd_held(case: str) -> None:
    held = reference(case, "params_at_save.nxd")
    states = list(read_optimizer_state(tag_of(case)))
    assert sorted(p.name for p in states) == sorted(held)
    for p in states:
        assert p.master is not None and p.master.dtype == held[p.name].dtype, p.name
        assert torch.equal(p.master, held[p.name]), p.name


def continue_one_step(case: str, *, tamper: str | None = None) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Step 3 in torch AdamW from the reader's state (masters, or the weights NxD held when the tag has
    none) and the recorded gradients: (largest move of any weight, result, NxD's own step 3)."""
    m = manifest(case)
    held, grads, after = (reference(case, n) for n in ("params_at_save.nxd", "grads_next.nxd", "params_after_next.nxd"))
    lrs = m["steps"][m["next_step"] - 1]["lr"]
    result, moved = {}, 0.0
    with NxdOptimizer.open(tag_of(case)) as optim:
        groups = optim.groups()
        for p in optim.params():
            dtype = p.exp_avg.dtype  # the optimizer dtype (the parameter's without ZeRO-1)
            start = (p.master if p.master is not None else held[p.name]).to(dtype)
            weight = start.clone().requires_grad_(True)
            g = groups[p.group]
            adamw = torch.optim.AdamW([weight], lr=lrs[p.group], betas=tuple(g["betas"]), eps=g["eps"],
                                      weight_decay=g["weight_decay"], foreach=False)
            exp_avg = torch.zeros_like(p.exp_avg) if tamper == "exp_avg" else p.exp_avg
            adamw.state[weight] = {"step": torch.tensor(p.step), "exp_avg": exp_avg.clone(),
                                   "exp_avg_sq": p.exp_avg_sq.clone()}
            weight.grad = grads[p.name].to(dtype)  # exact: the gradients are bf16 values; NxD's clipping scaled by 1
            adamw.step()
            result[p.name] = weight.detach()
            moved = max(moved, (result[p.name].double() - start.double()).abs().max().item())
    return moved, result, after


@pytest.mark.parametrize("case", [c for c in CASES if c != "plain_bf16"])
def test_moments_continue_step_3_as_nxd_did(case: str) -> None:
    """fp32 (fp64) optimizer state: torch on CPU equals NxD on XLA within a few fp32 ulps (measured: at
    most 1.2e-7), while a step moves the weights by up to 1e-2."""
    moved, result, after = continue_one_step(case)
    assert moved > 5e-3
    for name, value in result.items():
        torch.testing.assert_close(value.double(), after[name].double(), rtol=0, atol=2.5e-7, msg=name)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exponent - 7)


def test_bf16_moments_continue_step_3_within_a_few_bf16_ulps() -> None:
    """ZeRO-1 off, bf16 model: AdamW runs in bf16 (moments too), and CPU and XLA round its intermediate
    values differently. Measured in ulps of the largest operand (old or new weight, or the step size
    lr = 1e-2): at most 2.25 (about 2/3 of the elements agree exactly); with the reader's exp_avg
    replaced by zeros, 129. The bound is 4."""
    held = reference("plain_bf16", "params_at_save.nxd")

    def ulps_off(tamper: str | None) -> tuple[float, float]:
        _, result, after = continue_one_step("plain_bf16", tamper=tamper)
        worst, equal, total = 0.0, 0, 0
        for name, value in result.items():
            got, want, start = value.double(), after[name].double(), held[name].double()
            scale = torch.stack([got.abs(), want.abs(), start.abs(), torch.full_like(start, 1e-2)]).amax(0)
            worst = max(worst, ((got - want).abs() / bf16_ulp(scale)).max().item())
            equal, total = equal + int((got == want).sum()), total + want.numel()
        return worst, equal / total

    worst, share = ulps_off(None)
    assert worst <= 4 and share > 0.6, (worst, share)
    assert ulps_off("exp_avg")[0] > 4


# --------------------------------------------------------------------------------------------
# The tag's weights: to-hf, inspect, verify, reshard


def expected_model_weights(case: str, stored: torch.Tensor, name: str) -> torch.Tensor:
    """What NxD's model files hold: the full-precision values rounded to the model's precision
    (bf16, and under XLA_DOWNCAST_BF16 also the fp32 norms), widened to the stored dtype."""
    m, held = manifest(case), reference(case, "params_at_save.hf")[name]
    if "bfloat16" in m["flags"]["model_dtype"]:
        return held.float().bfloat16().to(stored.dtype)
    return held.to(stored.dtype)


def masters_only(case: str) -> bool:
    flags = manifest(case)["flags"]
    return bool(flags["avoid_saving_lower_precision_weights"] and flags["use_xser"])


def export(case: str, out: Path, **kwargs: Any) -> tuple[dict[str, torch.Tensor], str]:
    """``to_hf`` of a case's tag: (the tensors written, the notes as one line)."""
    result = to_hf(tag_of(case), out, config=FIXTURES / case / "hf" / "config.json", options=QUIET, **kwargs)
    return hf_state(out), " ".join(result.notes)


@pytest.mark.parametrize("case", [c for c in CASES if not masters_only(c)])
def test_to_hf_of_the_shards_gives_the_weights_nxd_saved(case: str, tmp_path: Path) -> None:
    with warns_no_tokenizer():
        got, says = export(case, tmp_path / "hf", masters=False, dtype="keep")
    held = reference(case, "params_at_save.hf")
    assert sorted(got) == sorted(held)
    for name, value in got.items():
        want = expected_model_weights(case, value, name)
        assert value.dtype == want.dtype and torch.equal(value, want), name
    assert "master weights" not in says


@pytest.mark.parametrize("case", CASES)
def test_to_hf_takes_the_masters_when_present(case: str, tmp_path: Path) -> None:
    """to-hf's default (as for nxdtrain's masters): NxD's masters where the tag holds them, bit for bit
    with ``--dtype keep``; the shards where it does not."""
    with warns_no_tokenizer():
        got, says = export(case, tmp_path / "hf", dtype="keep")
    held = reference(case, "params_at_save.hf")
    assert sorted(got) == sorted(held)
    for name, value in got.items():
        want = held[name] if case in MASTER_CASES else expected_model_weights(case, value, name)
        assert value.dtype == want.dtype and torch.equal(value, want), name
    if masters_only(case):
        assert "master weights in optim/" in says and "hold no tensors" in says
    elif case in MASTER_CASES:
        assert "master weights in optim/" in says and "--no-masters reads the model files" in says


def test_to_hf_default_dtype_of_a_masters_only_tag() -> None:
    """``--dtype source`` (the default) writes what the model's config.json declares (bf16 here): the
    masters rounded, which is what NxD's model files would have held."""
    case = "zero1_bf16_masters_only_xser"
    with tempfile.TemporaryDirectory() as out:
        with warns_no_tokenizer():
            got, says = export(case, Path(out) / "hf")
    for name, value in got.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, expected_model_weights(case, value, name)), name
    assert "writing bfloat16, the dtype of the source model" in says


@pytest.mark.parametrize("case", [c for c in CASES if c not in MASTER_CASES])
def test_masters_required_without_masters_is_refused(case: str, tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="holds no master weights"):
        export(case, tmp_path / "hf", masters=True)
    assert not (tmp_path / "hf").exists()


def test_no_masters_on_a_masters_only_tag_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="hold no tensors.*drop --no-masters"):
        export("zero1_bf16_masters_only_xser", tmp_path / "hf", masters=False)


def test_inspect_says_where_the_weights_come_from() -> None:
    case = "zero1_bf16_masters_only_xser"
    report = inspect(tag_of(case), config=FIXTURES / case / "hf" / "config.json")
    assert report["weights_from"].startswith("optim/") and report["dtypes"] == {"float32": 15}
    assert report["complete"] and report["checked_files"] == 15  # the 15 master tensor files, read whole
    assert report["optimizer"]["format"] == "zero1" and report["optimizer"]["masters"] is True
    plain = inspect(tag_of("plain_bf16"), config=FIXTURES / "plain_bf16" / "hf" / "config.json")
    assert plain["weights_from"] == "model files" and plain["optimizer"]["format"] == "adamw"


def test_verify_and_reshard_of_a_masters_only_tag(tmp_path: Path) -> None:
    """verify computes with the masters; reshard to tp 2 writes them, and its to-hf gives them back."""
    case = "zero1_bf16_masters_only_xser"
    config = FIXTURES / case / "hf" / "config.json"
    hf = tmp_path / "reference-hf"
    hf.mkdir()
    save_file(reference(case, "params_at_save.hf"), hf / "model.safetensors")
    shutil.copy(config, hf / "config.json")
    report = verify(hf, tag_of(case), config=config)
    assert report["ok"], report["problems"]

    out = reshard(tag_of(case), tmp_path / "tp2", tp=2, pp=1, config=config, options=QUIET)
    assert any("master weights in optim/" in n for n in out.notes)
    with warns_no_tokenizer():
        to_hf(tmp_path / "tp2", tmp_path / "back", dtype="keep", options=QUIET)
    back, held = hf_state(tmp_path / "back"), reference(case, "params_at_save.hf")
    assert all(torch.equal(back[k], held[k]) for k in held)


# --------------------------------------------------------------------------------------------
# ZeRO-1 partition over dp ranks, and refusals


def _dp_split(state: dict[str, Any], dp: int) -> list[dict[str, Any]]:
    """A dp-1 NeuronZero1Optimizer state cut as NxD partitions it (dim 0 zero-padded to a multiple of dp,
    equal chunks; see fixtures/nxdt-official/README.md). No NxD-made dp > 1 files exist to compare with."""
    def chunk(t: torch.Tensor, r: int) -> torch.Tensor:
        per = math.ceil(t.shape[0] / dp)
        padded = torch.cat([t, t.new_zeros(per * dp - t.shape[0], *t.shape[1:])])
        return padded[r * per:(r + 1) * per].clone()

    ranks = []
    for r in range(dp):
        part = {**state, "base_state": {i: {"step": s["step"], "exp_avg": chunk(s["exp_avg"], r),
                                            "exp_avg_sq": chunk(s["exp_avg_sq"], r)}
                                        for i, s in state["base_state"].items()}}
        if "sharded_master_weights" in state:
            part["sharded_master_weights"] = {i: chunk(t, r) for i, t in state["sharded_master_weights"].items()}
        ranks.append(part)
    return ranks


def split_over_dp(case: str, tmp: Path, dp: int) -> Path:
    """A copy of a ZeRO-1 case's tag whose one optimizer file is replaced by ``dp`` ranks' files."""
    tag = copy_tag(case, tmp)
    whole = torch.load(tag / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    for r, part in enumerate(_dp_split(whole, dp)):
        torch.save(part, tag / "optim" / f"dp_rank_{r:02d}_tp_rank_00_pp_rank_00.pt")
    return tag


def test_zero1_chunks_of_three_dp_ranks_are_put_back_together(tmp_path: Path) -> None:
    case = "zero1_bf16_masters"
    tag = split_over_dp(case, tmp_path, 3)
    before = {p.name: p for p in read_optimizer_state(tag_of(case))}
    with NxdOptimizer.open(tag) as optim:
        assert optim.dp == 3
        for p in optim.params():
            ref = before[p.name]
            assert all(torch.equal(getattr(p, k), getattr(ref, k)) for k in ("exp_avg", "exp_avg_sq", "master")), p.name
            assert p.step == ref.step
    with warns_no_tokenizer():
        to_hf(tag, tmp_path / "hf", config=FIXTURES / case / "hf" / "config.json", masters=True, dtype="keep",
              options=QUIET)
    held = reference(case, "params_at_save.hf")
    assert all(torch.equal(v, held[k]) for k, v in hf_state(tmp_path / "hf").items())


def test_one_dp_ranks_chunk_alone_is_refused(tmp_path: Path) -> None:
    """NxDT saves ZeRO-1 state as if replicated: at dp > 1 only dp rank 0's chunks reach the tag."""
    tag = copy_tag("zero1_bf16_masters", tmp_path)
    file = tag / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    torch.save(_dp_split(torch.load(file, weights_only=True), 2)[0], file)
    with pytest.raises(ConversionError, match="wrap_with_zero"):
        NxdOptimizer.open(tag)


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: s.update(extra=1), "unknown key 'extra'"),
    (lambda s: s["state"][3].update(max_exp_avg_sq=s["state"][3]["exp_avg"]), "unknown key 'max_exp_avg_sq'"),
    (lambda s: s["state"].pop(14), "no entry for optimizer index 14"),
    (lambda s: s["param_groups"][1]["params"].append(15), "holds 16 parameters, the model shard 15"),
    (lambda s: s["param_groups"].append({"params": []}), "fit none of the known param-group rules"),
])
def test_unknown_structures_are_refused_naming_the_key(tmp_path: Path, change: Any, message: str) -> None:
    tag = copy_tag("plain_fp32", tmp_path)
    file = tag / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    state = torch.load(file, weights_only=True)
    change(state)
    torch.save(state, file)
    with pytest.raises(ConversionError, match=message) as err:
        NxdOptimizer.open(tag)
    assert str(file) in str(err.value) or "param-group" in message


def test_a_pickle_naming_other_code_is_refused(tmp_path: Path) -> None:
    tag = copy_tag("plain_fp32", tmp_path)
    file = tag / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    state = torch.load(file, weights_only=True)
    state["param_groups"][0]["hook"] = shutil.rmtree  # pickled by reference: would run code if loaded
    torch.save(state, file)
    with pytest.raises(UnsafeCheckpointError, match="shutil"):
        NxdOptimizer.open(tag)


def test_a_damaged_moment_is_caught(tmp_path: Path) -> None:
    tag = copy_tag("plain_fp32", tmp_path)
    file = tag / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    raw = bytearray(file.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    file.write_bytes(bytes(raw))
    with pytest.raises(ConversionError, match="CRC"):
        list(read_optimizer_state(tag))


@pytest.mark.parametrize("case", CASES)
def test_inspect_verify_and_reshard_take_every_case(case: str, tmp_path: Path) -> None:
    """inspect names the optimizer it found; verify checks the tag's weights against an HF export of
    them; reshard to tp 2 writes shards whose export equals the direct one (the shards by default,
    the masters where they are the only weights), and, where NxD saved masters, the resharded training
    tag's masters export as NxD's do."""
    config = FIXTURES / case / "hf" / "config.json"
    report = inspect(tag_of(case), config=config)
    assert report["complete"] and report["optimizer"]["format"] == NxdOptimizer.open(tag_of(case)).format.value
    assert report["weights_from"] == ("optim/ (NxD's master weights)" if masters_only(case) else "model files")
    with warns_no_tokenizer():
        direct, _ = export(case, tmp_path / "hf", masters=None if masters_only(case) else False, dtype="keep")
    assert verify(tmp_path / "hf", tag_of(case), config=config)["ok"]
    reshard(tag_of(case), tmp_path / "tp2", tp=2, pp=1, config=config, options=QUIET)
    with warns_no_tokenizer():
        to_hf(tmp_path / "tp2", tmp_path / "back", dtype="keep", masters=None if masters_only(case) else False,
              options=QUIET)
    back = hf_state(tmp_path / "back")
    assert sorted(direct) == sorted(back) and all(torch.equal(direct[k], back[k]) for k in direct)
    with NxdOptimizer.open(tag_of(case)) as optim:
        saved_masters = optim.has_masters
    if saved_masters and not masters_only(case):
        with warns_no_tokenizer():
            nxds, _ = export(case, tmp_path / "hf-masters", masters=True, dtype="keep")
        with warns_no_tokenizer():
            to_hf(tmp_path / "tp2", tmp_path / "back-masters", dtype="keep", masters=True, options=QUIET)
        ours = hf_state(tmp_path / "back-masters")
        assert sorted(nxds) == sorted(ours) and all(torch.equal(nxds[k], ours[k]) for k in nxds)


def test_cli_masters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ckptconv.cli.main import main

    case = "zero1_bf16_masters_xser"
    args = [str(tag_of(case)), str(tmp_path / "hf"), "--config", str(FIXTURES / case / "hf" / "config.json")]
    assert main(["to-hf", *args, "--masters", "--dtype", "keep", "--quiet"]) == 0
    held = reference(case, "params_at_save.hf")
    assert all(torch.equal(v, held[k]) for k, v in hf_state(tmp_path / "hf").items())
    capsys.readouterr()
    assert main(["inspect", str(tag_of(case)), "--config", args[-1], "--masters", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weights_from"].startswith("optim/")


def test_a_step_saved_as_a_number_reads_the_same(tmp_path: Path) -> None:
    """torch before 1.12 saved AdamW's step as a Python number."""
    tag = copy_tag("plain_fp32", tmp_path)
    file = tag / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    state = torch.load(file, weights_only=True)
    for entry in state["state"].values():
        entry["step"] = float(entry["step"])
    torch.save(state, file)
    before = {p.name: p for p in read_optimizer_state(tag_of("plain_fp32"))}
    for p in read_optimizer_state(tag):
        assert p.step == before[p.name].step == 2.0 and torch.equal(p.exp_avg_sq, before[p.name].exp_avg_sq)


def test_row_slices_across_dp_chunks(tmp_path: Path) -> None:
    """A slice of rows that spans dp ranks' chunks (and the last rank's padding) is the slice of the whole."""
    case = "zero1_bf16_masters"
    tag = split_over_dp(case, tmp_path, 3)
    full = {p.name: p for p in read_optimizer_state(tag_of(case))}
    name = "model.embed_tokens.weight"  # 64 rows: chunks of 22, 22, 20 (+ 2 pad rows)
    with NxdOptimizer.open(tag) as optim:
        for what in ("master", "exp_avg", "exp_avg_sq"):
            for start, stop in ((0, 64), (20, 45), (43, 64), (44, 44)):
                assert torch.equal(optim.rows(0, 0, name, what, start, stop), getattr(full[name], what)[start:stop])


def test_a_tag_missing_some_model_tensors_is_refused(tmp_path: Path) -> None:
    """Only all of them absent is NxD's masters-only save; some absent is a damaged tag."""
    tag = copy_tag("zero1_bf16_masters_xser", tmp_path)
    (tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors" / "tensor_3.pt").unlink()
    with pytest.raises(ConversionError, match="1 of 15 model tensors were not saved"):
        to_hf(tag, tmp_path / "hf", config=FIXTURES / "zero1_bf16_masters_xser" / "hf" / "config.json", options=QUIET)


def test_declared_reads_a_files_headers_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """NxdCheckpoint.declared: the dtypes and shapes the masters-only tag's .info.pt records (bf16, the shapes
    of NxD's parameters, though no tensor was saved), read once per file however often it is asked."""
    import ckptconv.io.nxd_read as nxd_io

    case = "zero1_bf16_masters_only_xser"
    opened: list[Path] = []
    real = nxd_io.open_shard
    monkeypatch.setattr(nxd_io, "open_shard", lambda path, *a: opened.append(path) or real(path, *a))
    ckpt = nxd_io.NxdCheckpoint(copy_tag(case, tmp_path))
    file = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"
    first = ckpt.declared(file)
    first.clear()  # a caller's change reaches no later caller
    declared = ckpt.declared(file)
    held = reference(case, "params_at_save.nxd")
    assert declared == {k: (torch.bfloat16, tuple(v.shape)) for k, v in held.items()}
    assert len(opened) == 1
    ckpt.close()


@pytest.mark.parametrize("case", ["plain_fp32", "zero1_bf16_masters", "zero1_bf16_masters_only_xser", "zero1_bf16_dcp"])
def test_inspect_parses_nxds_optimizer_once(case: str, nxd_optimizers_made: list[Path]) -> None:
    """The weights' notes (ckptconv.sources.masters) and the optimizer summary share one opening of NxD's optimizer,
    whether the weights come from its masters or not; the summary is the same as a reader of its own gives."""
    report = inspect(tag_of(case), config=FIXTURES / case / "hf" / "config.json")
    assert len(nxd_optimizers_made) == 1
    with NxdOptimizer.open(tag_of(case)) as optim:
        assert report["optimizer"]["format"] == optim.format.value
        assert report["optimizer"]["masters"] == optim.has_masters and report["optimizer"]["step"] == optim.step()


def test_a_kept_optimizer_lives_until_its_checkpoint_closes(tmp_path: Path) -> None:
    """NxD's optimizer kept by its checkpoint (what nxd_masters(keep=True) does) stays open when the weights switch
    to its masters (the switch closed everything the checkpoint held, the kept optimizer too, whose files then
    reopened unseen: nxd_masters had to keep it after the switch); once the checkpoint closes it, a read fails
    loudly instead of reopening its files. A second weight source or kept optimizer is refused."""
    from ckptconv.core.plan import Source
    from ckptconv.io.nxd_read import NxdCheckpoint
    from ckptconv.sources.masters import MasterWeights

    case = "zero1_bf16_masters_only_xser"
    ckpt = NxdCheckpoint(copy_tag(case, tmp_path), io="read")
    optim = NxdOptimizer(ckpt, io="read")
    ckpt.keep_nxd_optimizer(optim)
    ckpt.read_weights_from(MasterWeights(optim))
    held = reference(case, "params_at_save.nxd")
    name = "model.norm.weight"
    file = next(f for f in ckpt.files if name in ckpt.keys(f))
    assert torch.equal(optim.rows(0, 0, name, "master", 0, 2), held[name][:2])  # open (a closed one would raise)
    assert torch.equal(ckpt.read_rows(Source(file, name), 0, held[name].shape[0]), held[name])
    with pytest.raises(RuntimeError, match="the weights are read from another source already"):
        ckpt.read_weights_from(MasterWeights(optim))
    with NxdOptimizer(ckpt, io="read") as other, pytest.raises(RuntimeError, match="keeps another NxD optimizer"):
        ckpt.keep_nxd_optimizer(other)
    ckpt.close()
    with pytest.raises(RuntimeError, match=r"optim: read after close\(\)"):
        optim.rows(0, 0, name, "exp_avg", 0, 2)
    with pytest.raises(RuntimeError, match=r"read after close\(\)"):
        ckpt.read_rows(Source(file, name), 0, 1)  # the weights come from the closed optimizer's masters
