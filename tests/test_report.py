"""Human-readable results: nothing is cut when stdout is not a terminal (Slurm logs, pipes), nor on one."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

from ckptconv.cli.report import key_values, render

LONG = "/fsx/" + "/".join(f"very-long-directory-name-{i}" for i in range(6)) + "/llama-3-70b-nxd"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _lines(text: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line and not line.startswith("  "))


def test_a_result_off_a_terminal_is_key_value_lines_with_every_value_whole():
    layout = {"tp": 32, "pp": 8, "vpp": 1, "kvm": 4, "attention": "qkv_linear", "fuse_qkv": True, "hw": "trn2",
              "trn2_kv_layout": "runtime"}
    data = {"out": LONG, "files": 263, "bytes_written": 141_107_232_768, "layout": layout,
            "notes": ["the first note, which is longer than a line of eighty columns would allow for it", "second"]}
    out = io.StringIO()
    render(data, file=out)
    text = out.getvalue()
    assert _lines(text) == {
        "out": LONG, "files": "263", "bytes_written": "131.4 GiB (141,107,232,768 bytes)",
        "layout": "tp=32, pp=8, vpp=1, kvm=4, attention=qkv_linear, fuse_qkv=True, hw=trn2, trn2_kv_layout=runtime",
        "notes": data["notes"][0],
    }
    assert "  second" in text.splitlines() and "…" not in text
    assert all(line == line.rstrip() for line in text.splitlines())  # no padding to a width


def test_on_a_terminal_long_values_wrap_instead_of_being_cut():
    out = Terminal()
    key_values([("out", LONG), ("files", "263")], file=out)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())  # the bold labels' escape codes
    assert "…" not in text
    assert "".join(text.split()).count("very-long-directory-name") == 6  # every piece, folded over lines
    assert "".join(text.split()).replace("out", "", 1).replace("files263", "") == LONG


def test_verify_report_off_a_terminal_names_each_component():
    check = {"max_abs": 1.5e-7, "rel": 2.5e-8, "ranks": []}
    data = {"ok": False, "tol": 1e-4, "problems": ["x"], "layers": {"0": {"attention": check,
                                                                           "mlp": {**check, "ranks": [1, 3]}}},
            "embedding": check, "lm_head": check}
    out = io.StringIO()
    render(data, file=out)
    assert out.getvalue().splitlines() == [
        "verify (tolerance 0.0001, relative to the largest reference value)",
        "layer 0 attention: max abs error 1.5e-07, relative 2.5e-08",  # no rank at fault: nothing said, no "ranks -"
        "layer 0 mlp: max abs error 1.5e-07, relative 2.5e-08, differs on rank(s) 1, 3",
        "embedding: max abs error 1.5e-07, relative 2.5e-08",
        "lm_head: max abs error 1.5e-07, relative 2.5e-08",
        "FAILED: 1 problem(s)",
    ]


def test_cli_output_in_a_pipe_keeps_every_value_of_the_json(tiny_models, tmp_path):
    """What a Slurm log gets: the text form holds every top-level value --json holds, whole."""
    src = tiny_models("gqa", heads=8, kv_heads=2, head_dim=8, layers=6)
    out = tmp_path / ("a-directory-name-long-enough-to-pass-eighty-columns-" * 2) / "nxd"
    cli = [sys.executable, "-m", "ckptconv.cli"]
    subprocess.run([*cli, "to-nxd", str(src), str(out), "--tp", "2", "--pp", "2", "--qkv-linear", "--fuse-qkv",
                    "--quiet"], check=True, capture_output=True)
    text = subprocess.run([*cli, "inspect", str(out)], capture_output=True, text=True, check=True).stdout
    data = json.loads(subprocess.run([*cli, "inspect", str(out), "--json"], capture_output=True, text=True,
                                     check=True).stdout)
    shown = _lines(text)
    assert set(shown) == set(data)
    for key, value in data.items():
        if isinstance(value, dict):
            assert shown[key] == ", ".join(f"{k}={v}" for k, v in value.items()), key
        elif isinstance(value, list):
            assert (value == [] and shown[key] == "-") or shown[key] == str(value[0]), key
        elif key not in ("bytes", "bytes_written"):
            assert shown[key] == str(value), key
    assert len(shown["path"]) > 100 and shown["path"] == data["path"]
