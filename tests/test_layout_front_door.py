"""The layout spelled once (LayoutOverrides -> every command's flags, one apply_layout), and the front door:
what a command says when SRC is the wrong kind, a layout is missing, or a flag is spelled the official way."""

from __future__ import annotations

import argparse
import dataclasses
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptconv
from ckptconv.cli.layout_args import WITHOUT_SOURCE_LAYOUT
from ckptconv.cli.main import build_parser, main
from ckptconv.core.layout import ParallelLayout
from ckptconv.core.layout_flags import FROM_SOURCE, LAYOUT_FIELDS, LayoutHints, LayoutOverrides, apply_layout
from ckptconv.errors import ConversionError

QUIET = ckptconv.RunOptions(quiet=True, workers=2)
HF_SRC = ("an HF model directory, a hub id org/name, or one state-dict file (.safetensors, .pt, .bin) "
          "with --config")


@pytest.fixture(scope="module")
def gqa(tiny_models) -> Path:
    return tiny_models("front-gqa", heads=8, kv_heads=2, head_dim=8, layers=6)


def recorded_layout(root: Path) -> dict:
    return json.loads((root / "ckptconv.json").read_text())["layout"]


def hf_state(root: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(root.glob("*.safetensors")):
        state.update(load_file(file))
    return state


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# -- flags not given keep the source's values; the kv multiplier is what tp needs --------------------------------


def test_reshard_pp_keeps_the_source_tp_and_qkv_flags(gqa: Path, tmp_path: Path):
    src = tmp_path / "tp2"
    assert main(["to-nxd", str(gqa), str(src), "--tp", "2", "--qkv-linear", "--fuse-qkv", "--quiet"]) == 0
    assert main(["reshard", str(src), str(tmp_path / "pp2"), "--pp", "2", "--quiet"]) == 0
    assert recorded_layout(tmp_path / "pp2") == {**recorded_layout(src), "pp": 2}
    assert recorded_layout(tmp_path / "pp2") == {"tp": 2, "pp": 2, "vpp": 1, "kvm": 1, "attention": "qkv_linear",
                                                 "fuse_qkv": True, "hw": "trn1", "trn2_kv_layout": "runtime"}
    assert sorted(p.name for p in (tmp_path / "pp2" / "model").iterdir()) == [
        f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}.pt" for t in range(2) for p in range(2)]
    assert main(["to-hf", str(tmp_path / "pp2"), str(tmp_path / "hf"), "--quiet"]) == 0
    original, back = hf_state(gqa), hf_state(tmp_path / "hf")
    assert sorted(back) == sorted(original)
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


def test_to_nxd_and_from_dcp_default_the_kv_multiplier_to_what_tp_needs(gqa: Path, tmp_path: Path):
    assert main(["to-nxd", str(gqa), str(tmp_path / "nxd"), "--tp", "4", "--qkv-linear", "--quiet"]) == 0
    assert recorded_layout(tmp_path / "nxd")["kvm"] == 2
    assert main(["to-dcp", str(gqa), str(tmp_path / "dcp"), "--quiet"]) == 0
    assert main(["from-dcp", str(tmp_path / "dcp"), str(tmp_path / "back"), "--to", "nxd", "--tp", "4",
                 "--qkv-linear", "--config", str(gqa / "config.json"), "--quiet"]) == 0
    assert recorded_layout(tmp_path / "back")["kvm"] == 2
    for rank in range(4):  # the same shards as to-nxd writes
        name = f"model/dp_rank_00_tp_rank_{rank:02d}_pp_rank_00.pt"
        mine, theirs = torch.load(tmp_path / "back" / name), torch.load(tmp_path / "nxd" / name)
        assert sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_nxd_compat_defaults_the_kv_multiplier_to_what_tp_needs(gqa: Path, tmp_path: Path):
    assert main(["nxd-compat", "--convert_from_full_state", "--input_dir", str(gqa / "model.safetensors"),
                 "--output_dir", str(tmp_path / "out"), "--config", str(gqa / "config.json"), "--tp_size", "4",
                 "--qkv_linear", "True", "--quiet"]) == 0
    assert recorded_layout(tmp_path / "out")["kvm"] == 2


def test_from_dcp_keeps_the_layout_a_dcp_of_nxd_shards_records(gqa: Path, tmp_path: Path):
    assert main(["to-nxd", str(gqa), str(tmp_path / "nxd"), "--tp", "2", "--qkv-linear", "--quiet"]) == 0
    assert main(["to-dcp", str(tmp_path / "nxd"), str(tmp_path / "dcp"), "--quiet"]) == 0
    assert main(["from-dcp", str(tmp_path / "dcp"), str(tmp_path / "back"), "--to", "nxd", "--pp", "2",
                 "--quiet"]) == 0
    assert recorded_layout(tmp_path / "back") == {**recorded_layout(tmp_path / "nxd"), "pp": 2}


# -- an error names a value as the user's only where the user typed it ---------------------------------------------


def test_to_nxd_names_a_default_as_the_default(gqa: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["to-nxd", str(gqa), str(tmp_path / "out"), "--pp", "8"]) == 1
    assert error_line(capsys) == ("ckptconv: error: --pp 8 x the default --vpp 1 = 8 stages, but the model has only "
                                  "6 layers")
    assert main(["to-nxd", str(gqa), str(tmp_path / "out"), "--tp", "1", "--kv-size-multiplier", "2"]) == 1
    assert error_line(capsys) == ("ckptconv: error: --kv-size-multiplier 2 needs --qkv-linear (K/V replication "
                                  "exists only on the qkv_linear path), but attention is the default attention "
                                  "separate")


def test_reshard_names_the_sources_values_as_the_sources(gqa: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]):
    src = tmp_path / "tp4"
    assert main(["to-nxd", str(gqa), str(src), "--tp", "4", "--qkv-linear", "--quiet"]) == 0
    assert main(["reshard", str(src), str(tmp_path / "out"), "--no-qkv-linear"]) == 1
    assert error_line(capsys) == (
        "ckptconv: error: the source's tp 4 must divide num_key_value_heads (2) for separate q/k/v; use "
        "--qkv-linear --kv-size-multiplier 2 for tp > kv heads")
    assert main(["reshard", str(src), str(tmp_path / "out2"), "--vpp", "8"]) == 1
    assert error_line(capsys) == ("ckptconv: error: the source's pp 1 x --vpp 8 = 8 stages, but the model has only "
                                  "6 layers")


def test_from_dcp_and_nxd_compat_name_defaults_as_defaults(gqa: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]):
    assert main(["to-dcp", str(gqa), str(tmp_path / "dcp"), "--quiet"]) == 0
    assert main(["from-dcp", str(tmp_path / "dcp"), str(tmp_path / "out"), "--to", "nxd", "--pp", "8",
                 "--config", str(gqa / "config.json"), "--quiet"]) == 1
    assert error_line(capsys) == ("ckptconv: error: --pp 8 x the default --vpp 1 = 8 stages, but the model has only "
                                  "6 layers")
    assert main(["nxd-compat", "--convert_from_full_state", "--input_dir", str(gqa / "model.safetensors"),
                 "--output_dir", str(tmp_path / "c"), "--config", str(gqa / "config.json"), "--pp_size", "8",
                 "--quiet"]) == 1
    assert error_line(capsys) == ("ckptconv: error: --pp_size 8 x the default --virtual_pp_size 1 = 8 stages, but "
                                  "the model has only 6 layers")


def test_apply_layout_names_each_value_by_its_origin():
    resolved = apply_layout(ParallelLayout(tp=2, pp=2), LayoutOverrides(vpp=3), kv_heads=2)
    assert resolved.layout == ParallelLayout(tp=2, pp=2, vpp=3)
    assert [resolved.name(k) for k in ("tp", "vpp", "kvm", "trn2_kv_layout")] == [
        "the source's tp 2", "--vpp 3", "the kv multiplier 1 that tp 2 needs", "the default --trn2-kv-layout runtime"]
    fresh = apply_layout(ParallelLayout(), LayoutOverrides(tp=4, attention="qkv_linear"), base_is="default",
                         kv_heads=2)
    assert (fresh.layout.kvm, fresh.name("pp"), fresh.name("attention")) == (2, "the default --pp 1", "--qkv-linear")
    with pytest.raises(ConversionError, match=r"^--tp_size 2 contradicts rec.json, which records tp 4 "):
        apply_layout(ParallelLayout(tp=4), LayoutOverrides(tp=2, style="compat"), recorded_at="rec.json")


def test_apply_layout_training_rules():
    """A training run's target (nxdtrain): the kv multiplier stays the shards' at their tp and attention (here one
    that tp does not need: 4 where 2 would do), vpp is 1, the trn2 K/V order and, at their tp, the vocabulary padding
    are the shards'; a converter's target recomputes them."""
    shards = ParallelLayout(tp=2, pp=2, vpp=2, kvm=4, attention="qkv_linear", hw="trn2", trn2_kv_layout="official",
                            padded_vocab=256)
    kept = apply_layout(shards, LayoutOverrides(), kv_heads=1, training=True)
    assert kept.layout == dataclasses.replace(shards, vpp=1) and kept.given() == []
    assert kept.name("tp") == "the source's tp 2"
    converter = apply_layout(shards, LayoutOverrides(), kv_heads=1)
    assert (converter.layout.kvm, converter.layout.vpp, converter.layout.trn2_kv_layout.value,
            converter.layout.padded_vocab) == (2, 2, "runtime", None)
    resharded = apply_layout(shards, LayoutOverrides(tp=4), kv_heads=1, training=True)
    assert (resharded.layout.kvm, resharded.layout.padded_vocab, resharded.name("tp")) == (4, None, "--tp 4")
    separate = apply_layout(shards, LayoutOverrides(attention="separate"), kv_heads=2, training=True)
    assert (separate.layout.kvm, separate.layout.fuse_qkv, separate.name("kvm")) == (
        1, False, "the kv multiplier 1 that tp 2 needs")
    given = apply_layout(shards, LayoutOverrides(kvm=2, vpp=2), kv_heads=1, training=True)
    assert (given.layout.kvm, given.layout.vpp) == (2, 2)


def test_layout_hints_keep_working_as_a_dict():
    hints = LayoutHints({"hw": "trn2", "tp": None}, override=True, style="compat")
    assert isinstance(hints, LayoutOverrides) and hints.override
    assert dict(hints) == hints.given() == {"hw": ckptconv.core.layout.Hardware.TRN2}
    assert (hints.flag("hw"), hints.get("tp"), hints["hw"].value) == ("--hw_backend", None, "trn2")
    with pytest.raises(TypeError):
        hints["tp"] = 2  # type: ignore[index]
    with pytest.raises(ConversionError, match=r"^--tp must be an integer >= 1, got 0$"):
        LayoutOverrides(tp=0)


# -- the front door ----------------------------------------------------------------------------------------------------


def test_to_nxd_without_a_layout_is_a_usage_error(gqa: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exc:
        main(["to-nxd", str(gqa), str(tmp_path / "out")])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "ckptconv to-nxd: error: to-nxd needs the layout to write: give --tp and --pp (--tp 1 --pp 1 for one "
        "unsharded file)")
    assert not (tmp_path / "out").exists()


def test_config_json_as_src_is_one_line_naming_it(gqa: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    config = gqa / "config.json"
    (length,) = struct.unpack("<Q", config.read_bytes()[:8])
    available = min(config.stat().st_size - 8, 100_000_000)
    assert main(["to-nxd", str(config), str(tmp_path / "out"), "--tp", "1"]) == 1
    assert error_line(capsys) == (f"ckptconv: error: SRC {config}: not a safetensors file (header length {length} "
                                  f"exceeds {available} available bytes); SRC must be {HF_SRC}")


def test_the_wrong_kind_of_src_points_to_the_right_command(gqa: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]):
    assert main(["to-hf", str(gqa), str(tmp_path / "hf")]) == 1
    assert error_line(capsys) == (f"ckptconv: error: SRC {gqa} is an HF checkpoint already; to-hf converts NxD "
                                  "shards to HF; did you mean ckptconv to-nxd?")
    assert main(["reshard", str(gqa), str(tmp_path / "r"), "--tp", "2"]) == 1
    assert "did you mean ckptconv to-nxd?" in error_line(capsys)
    nxd = tmp_path / "nxd"
    assert main(["to-nxd", str(gqa), str(nxd), "--tp", "2", "--quiet"]) == 0
    assert main(["to-nxd", str(nxd), str(tmp_path / "again"), "--tp", "2"]) == 1
    assert error_line(capsys) == (f"ckptconv: error: SRC {nxd} holds NxD shards already; to-nxd converts an HF model "
                                  "to NxD; did you mean ckptconv to-hf (to HF) or ckptconv reshard (to another "
                                  "layout)?")


@pytest.mark.parametrize("typed,meant", [("--tp-size", "--tp"), ("--tp_size", "--tp"), ("--pp_size", "--pp"),
                                         ("--kv_size_multiplier", "--kv-size-multiplier"),
                                         ("--hw_backend", "--hw-backend"), ("--virtual_pp_size", "--vpp"),
                                         ("--tensor-parallel", "--tp"), ("--tensor-model-parallel-size", "--tp"),
                                         ("--pipeline_parallel_size", "--pp"), ("--expert-parallel", "--ep")])
def test_an_official_spelling_says_did_you_mean(typed: str, meant: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exc:
        main(["to-nxd", "src", "out", typed, "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        f"ckptconv to-nxd: error: unrecognized arguments: {typed} 2; {typed}: did you mean {meant}?")
    assert err.startswith("usage: ckptconv to-nxd [-h]")  # the command's usage, not the top level's


def test_a_value_glued_to_a_flag_says_did_you_mean(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        main(["reshard", "src", "out", "--tp2", "--pp", "1"])
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "ckptconv reshard: error: unrecognized arguments: --tp2; --tp2: did you mean --tp 2?"
    assert err.startswith("usage: ckptconv reshard [-h]")
    with pytest.raises(SystemExit):
        main(["inspect", "src", "--bogus"])  # no layout spelling: no hint, still the command's usage
    err = capsys.readouterr().err
    assert err.startswith("usage: ckptconv inspect [-h]")
    assert err.splitlines()[-1] == "ckptconv inspect: error: unrecognized arguments: --bogus"


def test_reshard_to_the_same_layout_is_refused(gqa: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    src = tmp_path / "tp2"
    assert main(["to-nxd", str(gqa), str(src), "--tp", "2", "--quiet"]) == 0
    assert main(["reshard", str(src), str(tmp_path / "same")]) == 1
    assert error_line(capsys) == (
        f"ckptconv: error: reshard to the same layout (tp 2 x pp 1, vpp 1, separate, as {src} has): give "
        "--tp/--pp/--vpp/--qkv-linear/... for the new layout (or --xser, --dtype, --optimizer-format, --dp, --zero1 "
        "to change something else)")
    assert not (tmp_path / "same").exists()
    # something else changes: allowed, the layout kept
    assert main(["reshard", str(src), str(tmp_path / "split"), "--xser", "split", "--quiet"]) == 0
    assert recorded_layout(tmp_path / "split") == recorded_layout(src)


# -- the flags are generated from the override object ------------------------------------------------------------


def _subparser(command: str) -> argparse.ArgumentParser:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


@pytest.mark.parametrize("command", ["to-nxd", "to-hf", "reshard", "to-dcp", "from-dcp", "verify"])
def test_every_layout_field_is_a_flag_with_its_help(command: str):
    helps = {s: a.help for a in _subparser(command)._actions for s in a.option_strings}
    for name, spec in LAYOUT_FIELDS.items():
        if command == "to-nxd":  # an HF source has no layout: a degree not given is 1 (to-nxd needs --tp or --pp)
            spec = dataclasses.replace(spec, help=spec.help.replace(FROM_SOURCE, WITHOUT_SOURCE_LAYOUT.get(
                name, "(not given: 1)")))
        for flag, text in ([(s.native, s.help) for s in spec.switches] or [(spec.native, spec.help)]):
            assert helps.get(flag) == text, (command, flag)
        for alias in spec.aliases:
            assert helps.get(alias) == spec.help
    if command == "reshard":
        for spec in LAYOUT_FIELDS.values():
            if spec.source is not None:
                assert helps[spec.source] == spec.source_help


def test_nxd_compat_flags_are_the_fields_official_names():
    helps = {s: a.help for a in _subparser("nxd-compat")._actions for s in a.option_strings}
    for spec in LAYOUT_FIELDS.values():
        for flag, text in ([(s.compat, s.help) for s in spec.switches] or [(spec.compat, spec.help)]):
            assert helps[flag] is not None and helps[flag].startswith(text), flag
