"""The command line: pinned flag sets, one-line errors naming the problem, exit codes 0/1/2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptconv.cli.compat import parse_bool
from ckptconv.cli.main import build_parser, main, parse_size

RUN_FLAGS = {"--workers", "--max-memory", "--io", "--write-io", "--quiet", "--json", "--overwrite", "--part", "--hash"}
LAYOUT_FLAGS = {"--tp", "--ep", "--pp", "--vpp", "--kv-size-multiplier", "--kv-replicator", "--qkv-linear", "--no-qkv-linear",
                "--fuse-qkv", "--no-fuse-qkv", "--coalesce-qkv", "--no-coalesce-qkv", "--hw-backend", "--trn2-kv-layout"}


def flags(command: str) -> set[str]:
    """A subcommand's flags besides --help and --debug (which every subcommand has)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]  # type: ignore[attr-defined]
    found = {s for a in sub._actions for s in a.option_strings}
    assert "--debug" in found
    return found - {"-h", "--help", "--debug"}


def test_flag_sets_are_pinned():
    """Scripts depend on these names: a rename must be deliberate and show up here."""
    assert flags("to-nxd") == RUN_FLAGS | LAYOUT_FLAGS | {"--xser", "--config", "--dtype", "--verify",
                                                               "--revision", "--tokenizer"}
    assert flags("verify") == LAYOUT_FLAGS | {"--layers", "--tol", "--seed", "--files", "--config", "--json", "--quiet",
                                               "--revision", "--no-check", "--override-recorded-layout",
                                               "--masters", "--no-masters"}
    assert flags("to-hf") == RUN_FLAGS | LAYOUT_FLAGS | {"--config", "--max-shard-size", "--dtype", "--kv-replicas",
                                                           "--push-to-hub", "--private", "--no-check",
                                                           "--override-recorded-layout", "--tokenizer",
                                                           "--masters", "--no-masters", "--hf-experts"}
    assert flags("reshard") == RUN_FLAGS | LAYOUT_FLAGS | {"--xser", "--config", "--dtype", "--kv-replicas", "--no-check",
                                                             "--source-hw-backend", "--source-trn2-kv-layout",
                                                             "--override-recorded-layout", "--masters", "--no-masters",
                                                             "--dp", "--zero1", "--no-zero1", "--weights-only",
                                                             "--optimizer-format", "--nxd-param-groups", "--drop-masters",
                                                             "--nxd-trainer"}
    assert flags("to-dcp") == RUN_FLAGS | LAYOUT_FLAGS | {"--revision", "--config", "--dtype", "--max-file-size",
                                                            "--kv-replicas", "--no-check", "--override-recorded-layout",
                                                            "--weights-only", "--masters", "--no-masters", "--schedule", "--lr",
                                                            "--min-lr", "--warmup", "--decay-steps", "--drop-mtp",
                                                            "--tokenizer"}
    assert flags("from-dcp") == RUN_FLAGS | LAYOUT_FLAGS | {"--to", "--config", "--xser", "--dtype",
                                                              "--max-shard-size", "--no-check", "--weights-only",
                                                              "--consumed-samples", "--drop-expert-bias", "--every",
                                                              "--watch"}
    assert flags("inspect") == {"--config", "--json", "--revision", "--no-check", "--masters", "--no-masters"}
    assert flags("finalize") == {"--json"}
    assert flags("nxd-compat") == RUN_FLAGS | {
        "--convert_from_full_state", "--convert_to_full_state", "--input_dir", "--output_dir", "--config",
        "--tp_size", "--ep_size", "--pp_size", "--virtual_pp_size", "--kv_size_multiplier", "--qkv_linear", "--fuse_qkv",
        "--coalesce_qkv", "--hw_backend", "--trn2_kv_layout", "--save_xser", "--load_xser", "--n_layers",
        "--model_style", "--hf_model_name", "--no-check", "--override-recorded-layout",
    }


def test_official_booleans_are_read_as_written():
    assert [parse_bool(w) for w in ("True", "False", "1", "0", "yes", "no", "FALSE")] == [
        True, False, True, False, True, False, False
    ]
    args = build_parser().parse_args(["nxd-compat", "--convert_from_full_state", "--input_dir", "x", "--output_dir", "y",
                                      "--config", "c", "--qkv_linear", "False", "--fuse_qkv"])
    assert args.qkv_linear is False and args.fuse_qkv is True


def test_sizes():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("2G") == 2 * 10**9
    assert parse_size("1000") == 1000


def test_missing_source_is_one_line_error_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["to-nxd", str(tmp_path / "nope"), str(tmp_path / "out"), "--tp", "1", "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"ckptconv: error: {tmp_path / 'nope'}: no such file or directory"


def test_invalid_kvm_names_flag_and_valid_value(tiny_models, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    src = tiny_models("gqa", heads=8, kv_heads=2, head_dim=8, layers=6)
    code = main(["to-nxd", str(src), str(tmp_path / "out"), "--tp", "8", "--qkv-linear", "--kv-size-multiplier", "2"])
    assert code == 1
    err = capsys.readouterr().err
    assert "--kv-size-multiplier 2 is invalid for tp 8 with 2 KV heads: the valid value is 4" in err
    assert not (tmp_path / "out").exists()  # validated before writing anything


def test_usage_error_exits_2(tmp_path: Path):
    with pytest.raises(SystemExit) as exc:
        main(["to-nxd", "a", "b", "--tp", "two"])
    assert exc.value.code == 2


def test_refuses_to_mix_conversions_without_overwrite(tiny_models, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    src = tiny_models("gqa", heads=8, kv_heads=2, head_dim=8, layers=6)
    out = tmp_path / "out"
    assert main(["to-nxd", str(src), str(out), "--tp", "2", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["to-nxd", str(src), str(out), "--tp", "2", "--quiet", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["up_to_date"] is True
    assert main(["to-nxd", str(src), str(out), "--tp", "1", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ckptconv: error: {out}: not empty; holds another conversion (nxd, fingerprint ")
    # the flag is named only with what it deletes (ckptconv's own earlier conversion; never a foreign file)
    assert err.endswith("; choose another OUT, or pass --overwrite to delete that conversion's files and write this "
                        "one instead\n")
    assert main(["to-nxd", str(src), str(out), "--tp", "1", "--quiet", "--overwrite"]) == 0
    assert len(list((out / "model").glob("*.pt"))) == 1


def test_console_script_and_json_output(tiny_models, tmp_path: Path):
    src = tiny_models("gqa", heads=8, kv_heads=2, head_dim=8, layers=6)
    done = subprocess.run([sys.executable, "-m", "ckptconv.cli", "to-nxd", str(src), str(tmp_path / "o"), "--tp", "2",
                           "--pp", "2", "--json"], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    assert result["files"] == 4 + 2  # 4 shards, and hf/config.json + hf/generation_config.json kept beside them
    info = subprocess.run([sys.executable, "-m", "ckptconv.cli", "inspect", str(tmp_path / "o"), "--json"],
                          capture_output=True, text=True, check=True)
    described = json.loads(info.stdout)
    assert described["kind"] == "nxd" and described["layout"]["tp"] == 2 and described["complete"] is True


def test_package_verbs_stay_callable_after_the_cli_is_imported(tmp_path):
    """``ckptconv.inspect`` is the function even once the CLI (which imports its module) is loaded:
    a submodule of the same name would shadow the package's lazy attribute."""
    import ckptconv
    import ckptconv.cli.main  # noqa: F401
    from ckptconv.commands.inspect import inspect

    assert ckptconv.inspect is inspect and callable(ckptconv.inspect)
    assert ckptconv.to_nxd is ckptconv.commands.api.to_nxd and ckptconv.to_hf is ckptconv.commands.api.to_hf
