"""Our output against the official converter's golden files: same sha256, byte for byte."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from ckptconv.cli.main import main
from tests.conftest import GOLDEN, fixture_cases, hf_state, require

CASES = fixture_cases(GOLDEN)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_case(golden_dir: Path, name: str) -> dict:
    return json.loads(require(golden_dir / name / "case.json").read_text())


def stage(golden_dir: Path, name: str, tmp_path: Path) -> Path:
    """A working dir like the official run's: inputs linked in, outputs written fresh."""
    for entry in ("merged.pt", "hf", "out"):
        if (golden_dir / name / entry).exists():
            (tmp_path / ("golden_out" if entry == "out" else entry)).symlink_to(golden_dir / name / entry)
    return tmp_path


def run_in(cwd: Path, argv: list[str]) -> int:
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return main(argv)
    finally:
        os.chdir(old)


def native_argv(official: list[str]) -> list[str]:
    """The same conversion in native flags, reading the safetensors directory."""
    pairs = iter(official[1:])  # official[0] is the --convert_* mode flag
    flags = {}
    for token in pairs:
        flags[token] = next(pairs)
    argv = ["to-nxd", "hf", "native", "--tp", flags["--tp_size"], "--pp", flags["--pp_size"]]
    argv += ["--vpp", flags.get("--virtual_pp_size", "1"), "--kv-size-multiplier", flags.get("--kv_size_multiplier", "1")]
    argv += ["--hw-backend", flags.get("--hw_backend", "trn1")]
    for official_flag, native in (("--qkv_linear", "--qkv-linear"), ("--fuse_qkv", "--fuse-qkv"),
                                  ("--coalesce_qkv", "--coalesce-qkv"), ("--save_xser", "--xser")):
        if flags.get(official_flag) == "True":
            argv.append(native)
    return argv


def assert_outputs_match(case: dict, root: Path, prefix: str) -> None:
    shards = [o for o in case["outputs"] if o.startswith("out/")]
    assert shards
    for rel in shards:
        ours = root / prefix / rel.removeprefix("out/")
        assert sha256(ours) == case["sha256"][rel], f"{rel} differs from the official output"
    for rel in case["empty_dirs"]:
        directory = root / prefix / rel.removeprefix("out/")
        assert directory.is_dir() and not any(directory.iterdir()), rel
    written = sorted(p.name for p in (root / prefix / "model").iterdir() if p.is_file())
    assert written == sorted(Path(o).name for o in shards)


@pytest.mark.parametrize("name", [c for c in CASES if "official_error" not in load_case(GOLDEN, c)])
def test_nxd_compat_reproduces_official_shards(golden_dir: Path, tmp_path: Path, name: str):
    case = load_case(golden_dir, name)
    cwd = stage(golden_dir, name, tmp_path)
    assert run_in(cwd, ["nxd-compat", *case["official_args"], "--quiet"]) == 0
    assert_outputs_match(case, cwd, "out")


@pytest.mark.parametrize("name", [c for c in CASES if "official_error" not in load_case(GOLDEN, c)])
def test_native_to_nxd_from_safetensors_reproduces_official_shards(golden_dir: Path, tmp_path: Path, name: str):
    case = load_case(golden_dir, name)
    cwd = stage(golden_dir, name, tmp_path)
    assert run_in(cwd, [*native_argv(case["official_args"]), "--quiet", "--workers", "2"]) == 0
    assert_outputs_match(case, cwd, "native")


@pytest.mark.parametrize("name", [c for c in CASES if "official_to_full_args" in load_case(GOLDEN, c)])
def test_to_full_state_reproduces_official_checkpoint(golden_dir: Path, tmp_path: Path, name: str):
    case = load_case(golden_dir, name)
    cwd = stage(golden_dir, name, tmp_path)
    argv = [a if a != "out/model" else "golden_out/model" for a in case["official_to_full_args"]]
    assert run_in(cwd, ["nxd-compat", *argv, "--quiet"]) == 0
    assert sha256(cwd / "full" / "checkpoint.pt") == case["sha256"]["expected_full.pt"]


@pytest.mark.parametrize("name", [c for c in CASES if "probe_to_full_args" in load_case(GOLDEN, c)])
def test_fused_inverse_splits_by_head_counts(golden_dir: Path, tmp_path: Path, name: str):
    """The official inverse splits weight_qkv in thirds (crash or wrong shapes); ours restores the input."""
    case = load_case(golden_dir, name)
    cwd = stage(golden_dir, name, tmp_path)
    argv = [a if a != "out/model" else "golden_out/model" for a in case["probe_to_full_args"]]
    assert run_in(cwd, ["nxd-compat", *argv, "--quiet"]) == 0
    ours = torch.load(cwd / "probe_full" / "checkpoint.pt", weights_only=True)
    reference = hf_state(golden_dir / name / "hf")
    assert set(ours) == set(reference)
    for key, tensor in reference.items():
        assert torch.equal(ours[key], tensor), key


def test_case_the_official_converter_fails_on_converts_and_round_trips(golden_dir: Path, tmp_path: Path):
    """tp 1 < kv heads: the official trn1 path crashes (torch.cat of nothing); the layout is contiguous."""
    name = "gqa_tp1_pp2_vpp2_trn1"
    case = load_case(golden_dir, name)
    assert "official_error" in case
    cwd = stage(golden_dir, name, tmp_path)
    assert run_in(cwd, ["nxd-compat", *case["official_args"], "--quiet"]) == 0
    reference = hf_state(golden_dir / name / "hf")
    shard = torch.load(cwd / "out" / "model" / "dp_rank_00_tp_rank_00_pp_rank_01.pt", weights_only=True)
    # pp rank 1 holds stages 1 and 3: layers 1 and 3 (4 layers over 4 stages)
    assert torch.equal(shard["model.layers.1.self_attn.qkv_proj.weight_q"], reference["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(shard["model.layers.3.self_attn.qkv_proj.weight_k"], reference["model.layers.3.self_attn.k_proj.weight"])
    assert "model.layers.2.mlp.down_proj.weight" not in shard
    assert run_in(cwd, ["to-hf", "out", "back", "--quiet"]) == 0
    back = hf_state(cwd / "back")
    assert set(back) == set(reference)
    for key in reference:
        assert torch.equal(back[key], reference[key]), key
