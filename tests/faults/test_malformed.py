"""A corpus of malformed inputs: each gives exactly one line ``ckptconv: error: <where>: <what>``,
exit status 1, no traceback, and nothing in OUT that looks complete.

Runs in-process through ``ckptconv.cli.main.main`` (the same handler a shell gets; one case also runs as
a real process). Damaged shards (a flipped byte, swapped rank files) are caught by the checked
reads (ckptconv.io.checked).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptconv.cli.main import main
from tests.faults.helpers import looks_complete, one_line_error, run

INDEX = "model.safetensors.index.json"


def _index(src: Path) -> dict:
    return json.loads((src / INDEX).read_text())


def _set_index(src: Path, **changes) -> None:  # type: ignore[no-untyped-def]
    data = _index(src)
    data.update(changes)
    (src / INDEX).write_text(json.dumps(data))


def _first_shard(src: Path) -> Path:
    return src / sorted(set(_index(src)["weight_map"].values()))[0]


def _config(src: Path, **changes) -> None:  # type: ignore[no-untyped-def]
    path = src / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _nxd_shard(src: Path, tp: int = 0) -> Path:
    return src / "model" / f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_00.pt"


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _zip_record_offset(path: Path, suffix: str) -> int:
    """Offset of the first data byte of the zip record whose name ends with ``suffix``."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    header = path.read_bytes()[info.header_offset:info.header_offset + 30]
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _meta(src: Path, value) -> None:  # type: ignore[no-untyped-def]
    (src / "ckptconv.json").write_text(json.dumps(value))


# Each case: (id, kind 'hf' or 'nxd', break the copy of SRC, text the error line must contain)
Case = tuple[str, str, Callable[[Path], None], str]
CASES: list[Case] = [
    # safetensors files
    ("st-truncated-header", "hf", lambda s: _first_shard(s).write_bytes(b"\x05\x00\x00"), "model-00001-of-00004.safetensors"),
    ("st-huge-header-length", "hf", lambda s: _first_shard(s).write_bytes(struct.pack("<Q", 2**60) + b"{}"),
     "model-00001-of-00004.safetensors"),
    ("st-bit-flipped-header", "hf", lambda s: _flip(_first_shard(s), 9), "model-00001-of-00004.safetensors"),
    ("st-truncated-data", "hf", lambda s: _first_shard(s).write_bytes(_first_shard(s).read_bytes()[:-1000]),
     "model-00001-of-00004.safetensors: truncated (an incomplete download?): the file is "),
    ("st-unknown-dtype", "hf", lambda s: _first_shard(s).write_bytes(
        _first_shard(s).read_bytes().replace(b'"F32"', b'"X32"', 1)), "model-00001-of-00004.safetensors"),
    # index files
    ("index-not-json", "hf", lambda s: (s / INDEX).write_text("{nope"), INDEX),
    ("index-weight-map-list", "hf", lambda s: _set_index(s, weight_map=["model-00001-of-00004.safetensors"]), INDEX),
    ("index-entry-not-a-string", "hf",
     lambda s: _set_index(s, weight_map={**_index(s)["weight_map"], "lm_head.weight": 4}), "'lm_head.weight'"),
    ("index-entry-parent-dir", "hf",
     lambda s: _set_index(s, weight_map={**_index(s)["weight_map"], "lm_head.weight": "../../x/model.safetensors"}),
     "must be a file name inside"),
    ("index-entry-absolute", "hf",
     lambda s: _set_index(s, weight_map={**_index(s)["weight_map"], "lm_head.weight": "/etc/passwd"}),
     "must be a file name inside"),
    ("index-names-wrong-file", "hf",
     lambda s: _set_index(s, weight_map={**_index(s)["weight_map"], "lm_head.weight": "model-00001-of-00004.safetensors"}),
     "says 'lm_head.weight' is in model-00001-of-00004.safetensors, but that file does not hold it"),
    ("index-names-missing-file", "hf",
     lambda s: _set_index(s, weight_map={**_index(s)["weight_map"], "lm_head.weight": "gone.safetensors"}),
     "'gone.safetensors', which does not exist"),
    # config.json
    ("config-not-json", "hf", lambda s: (s / "config.json").write_text("{"), "config.json: not valid JSON"),
    ("config-a-list", "hf", lambda s: (s / "config.json").write_text("[1, 2]"), "expected a JSON object"),
    ("config-absurd-layers", "hf", lambda s: _config(s, num_hidden_layers=1_000_000_000),
     "num_hidden_layers is 1000000000 but the weights hold 2 layers"),
    ("config-layers-a-string", "hf", lambda s: _config(s, num_hidden_layers="2"),
     "num_hidden_layers must be a positive integer, got '2'"),
    ("config-wrong-heads", "hf", lambda s: _config(s, num_attention_heads=4, num_key_value_heads=4, head_dim=8),
     "q_proj"),
    ("config-wrong-vocab", "hf", lambda s: _config(s, vocab_size=256), "embed_tokens"),
    # legacy pickles
    ("legacy-pickle-with-code", "hf", lambda s: _legacy_pickle(s), "pytorch_model.bin: refusing to unpickle"),
    # NxD shards and their ckptconv.json
    ("nxd-metadata-a-list", "nxd", lambda s: _meta(s, [1]), "ckptconv.json: not a ckptconv metadata file"),
    ("nxd-metadata-files-wrong-type", "nxd",
     lambda s: _meta(s, {**json.loads((s / "ckptconv.json").read_text()), "layout": "tp2"}), "'layout' must be"),
    ("nxd-metadata-absurd-layers", "nxd", lambda s: _meta(s, _with_layers(s, 10**9)),
     "num_hidden_layers is 1000000000 but the weights hold 2 layers"),
    ("nxd-shard-truncated", "nxd", lambda s: _nxd_shard(s).write_bytes(_nxd_shard(s).read_bytes()[:5000]),
     "dp_rank_00_tp_rank_00_pp_rank_00.pt"),
    ("nxd-shard-pickle-bit-flipped", "nxd", lambda s: _flip(_nxd_shard(s), _zip_record_offset(_nxd_shard(s), "data.pkl") + 2),
     "dp_rank_00_tp_rank_00_pp_rank_00.pt"),
    # Checked reads see a missing or rewritten shard first (against ckptconv.json); with --no-check
    # the layout and dtype checks behind them still refuse it.
    ("nxd-shard-missing", "nxd", lambda s: _nxd_shard(s, 1).unlink(),
     "dp_rank_00_tp_rank_01_pp_rank_00.pt: missing; "),
    ("nxd-shard-missing-unchecked", "nxd --no-check", lambda s: _nxd_shard(s, 1).unlink(),
     "holds tp 1 x pp 1 shards, but the layout says tp 2"),
    ("nxd-shard-wrong-dtype", "nxd", lambda s: _to_half(_nxd_shard(s, 1)), "bytes, ckptconv.json records "),
    ("nxd-shard-wrong-dtype-unchecked", "nxd --no-check", lambda s: _to_half(_nxd_shard(s, 1)),
     "dp_rank_00_tp_rank_01_pp_rank_00.pt: 'model.embed_tokens.weight' is float16, "),
    # Layout flags against what ckptconv.json records, and layouts the shards cannot tell apart (#21)
    ("nxd-flag-contradicts-record", "nxd --hw-backend trn2", lambda s: None,
     "--hw-backend trn2 contradicts"),
    ("nxd-tp-flag-contradicts-record", "nxd --tp 1", lambda s: None, "--tp 1 contradicts"),
    ("nxd-unrecorded-tiled-replicas", "nxd", lambda s: _tiled_unrecorded(s),
     "pass --hw-backend trn1, or --hw-backend trn2 --trn2-kv-layout official"),
    ("nxd-unrecorded-tiled-replicas-as-trn2", "nxd --hw-backend trn2", lambda s: _tiled_unrecorded(s),
     "layout flags are wrong, not the weights"),
    pytest.param("nxd-shard-data-bit-flipped", "nxd",
                 lambda s: _flip(_nxd_shard(s), _zip_record_offset(_nxd_shard(s), "data/0") + 7),
                 "dp_rank_00_tp_rank_00_pp_rank_00.pt"),
    pytest.param("nxd-swapped-ranks", "nxd", lambda s: _swap(_nxd_shard(s, 0), _nxd_shard(s, 1)),
                 "dp_rank_00_tp_rank_0"),
]


def _legacy_pickle(src: Path) -> None:
    """A pre-zip torch pickle whose unpickling would run a shell command."""
    import torch

    class Payload:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, ("touch /tmp/ckptconv-pwned",))

    for p in list(src.glob("model*.safetensors*")):
        p.unlink()
    torch.save({"model.embed_tokens.weight": Payload()}, src / "pytorch_model.bin", _use_new_zipfile_serialization=False)


def _to_half(shard: Path) -> None:
    """Rewrite one rank's shard in float16 (the others, and ckptconv.json, say float32)."""
    from ckptconv.io.nxd_read import load_shard
    from ckptconv.io.nxd_write import save_shard

    save_shard(shard, {k: v.half() for k, v in load_shard(shard).items()})


def _with_layers(src: Path, layers: int) -> dict:
    meta = json.loads((src / "ckptconv.json").read_text())
    meta["hf_config"]["num_hidden_layers"] = layers
    return meta


def _tiled_unrecorded(src: Path) -> None:
    """SRC resharded to tp 4 with kv_size_multiplier 2 (trn1: tiled K/V replicas), then without
    ckptconv.json: what the official converter writes for trn1 and for trn2 alike."""
    from ckptconv.commands.api import RunOptions, reshard

    tiled = src.parent / "tiled"
    reshard(src, tiled, tp=4, pp=1, attention="qkv_linear", kv_size_multiplier=2,
            options=RunOptions(quiet=True, workers=2))
    shutil.rmtree(src)
    (tiled / "ckptconv.json").unlink()
    tiled.rename(src)


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_suffix(".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


@pytest.mark.parametrize(("name", "kind", "breaks", "expected"), CASES)
def test_malformed_input_is_one_line_error(name: str, kind: str, breaks: Callable[[Path], None], expected: str,
                                          hf_copy: Path, nxd_copy: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]):
    src = hf_copy if kind == "hf" else nxd_copy
    breaks(src)
    out = tmp_path / "out"
    argv = ["to-nxd", str(src), str(out), "--tp", "2"] if kind == "hf" else ["to-hf", str(src), str(out)]
    argv += kind.split()[1:]  # "nxd --no-check": the checks behind the checked reads
    assert main([*argv, "--quiet", "--workers", "2"]) == 1
    line = one_line_error(capsys.readouterr().err)
    assert expected in line, line
    assert not looks_complete(out)
    assert not Path("/tmp/ckptconv-pwned").exists()


def test_dangling_out_symlink(hf_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "nowhere")
    assert main(["to-nxd", str(hf_copy), str(out), "--tp", "1", "--quiet"]) == 1
    assert one_line_error(capsys.readouterr().err) == (
        f"ckptconv: error: {out}: is a dangling symbolic link (to {tmp_path / 'nowhere'}); "
        "remove it or create its target first")


def test_out_is_a_file(hf_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "out"
    out.write_text("mine")
    assert main(["to-nxd", str(hf_copy), str(out), "--tp", "1", "--quiet"]) == 1
    assert one_line_error(capsys.readouterr().err) == f"ckptconv: error: {out}: exists and is not a directory"
    assert out.read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_out(hf_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o555)
    try:
        assert main(["to-nxd", str(hf_copy), str(out), "--tp", "1", "--quiet"]) == 1
    finally:
        out.chmod(0o755)
    assert "permission denied" in one_line_error(capsys.readouterr().err)
    assert not looks_complete(out)


def test_os_errors_are_one_line():
    """EROFS/EACCES/ENOSPC as the handler words them (a read-only mount needs privileges a test lacks)."""
    import errno

    from ckptconv.cli.errors import describe

    assert describe(OSError(errno.EROFS, "Read-only file system", "/ro/out/model")) == (
        "/ro/out/model: read-only file system", "os")
    assert describe(PermissionError(errno.EACCES, "Permission denied", "/x")) == ("/x: permission denied", "os")
    message, kind = describe(OSError(errno.ENOSPC, "No space left on device", "/full/f"))
    assert (message, kind) == ("/full/f: no space left on device while writing; free space (or raise the limit) "
                               "and rerun to resume", "disk-full")


def test_json_error_object_and_debug_traceback(hf_copy: Path, tmp_path: Path):
    """A real process: --json prints an error object on stdout; --debug (or CKPTCONV_DEBUG=1) the traceback."""
    _config(hf_copy, num_hidden_layers=1_000_000_000)
    proc = run("ckptconv", "to-nxd", hf_copy, tmp_path / "out", "--tp", "1", "--json")
    assert proc.returncode == 1
    line = one_line_error(proc.stderr)
    assert json.loads(proc.stdout) == {"error": line.removeprefix("ckptconv: error: "), "kind": "input", "exit": 1}
    proc = run("ckptconv", "--debug", "to-nxd", hf_copy, tmp_path / "out", "--tp", "1")
    assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1] == line
