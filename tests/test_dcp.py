"""TorchTitan DCP: to-dcp / from-dcp round trips, the RoPE row order, torch's own DCP loader as the reader.

References independent of the code under test: transformers' rotary embedding against complex RoPE
(for the row order), the permutation in HF's Llama conversion script (written out here), and
``torch.distributed.checkpoint`` for what we write and for checkpoints we read.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import ckptconv
from ckptconv.cli.main import main
from ckptconv.commands.api import RunOptions
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import OutFile, OutTensor, Piece, Source
from ckptconv.errors import ConversionError, IntegrityError
from ckptconv.io.dcp import DcpCheckpoint, distcp_name, encode_metadata, layout_items, sink_factory
from ckptconv.titan.names import (
    fused_qkv_param,
    inverse_rows,
    optimizer_params,
    planner_path,
    rope_rows,
    titan_params,
)
from ckptconv.titan.state import ScheduleFlags
from tests.conftest import hf_state, warns_no_tokenizer

QUIET = RunOptions(quiet=True)

MODELS = {  # name: (kv_heads, tied)
    "gqa": (2, False),
    "mha": (8, False),
    "gqa-tied": (2, True),
    "mha-tied": (8, True),
}


@pytest.fixture(scope="module")
def models(tiny_models) -> dict[str, Path]:
    return {name: tiny_models(f"dcp-{name}", kv_heads=kv, tied=tied, layers=2, seed=7 + i)
            for i, (name, (kv, tied)) in enumerate(MODELS.items())}


def hf_to_titan_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of HF's conversion-script ``permute`` (Meta -> HF): written out independently."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def expected_titan_state(hf: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """TorchTitan's llama3 model keys from an HF state, by hand (not through ckptconv's table)."""
    out = {"tok_embeddings.weight": hf["model.embed_tokens.weight"]}
    for n in range(spec.layers):
        p = f"model.layers.{n}."
        out |= {
            f"layers.{n}.attention.qkv_linear.wq.weight": hf_to_titan_rows(hf[p + "self_attn.q_proj.weight"], spec.heads),
            f"layers.{n}.attention.qkv_linear.wk.weight": hf_to_titan_rows(hf[p + "self_attn.k_proj.weight"], spec.kv_heads),
            f"layers.{n}.attention.qkv_linear.wv.weight": hf[p + "self_attn.v_proj.weight"],
            f"layers.{n}.attention.wo.weight": hf[p + "self_attn.o_proj.weight"],
            f"layers.{n}.feed_forward.w1.weight": hf[p + "mlp.gate_proj.weight"],
            f"layers.{n}.feed_forward.w2.weight": hf[p + "mlp.down_proj.weight"],
            f"layers.{n}.feed_forward.w3.weight": hf[p + "mlp.up_proj.weight"],
            f"layers.{n}.attention_norm.weight": hf[p + "input_layernorm.weight"],
            f"layers.{n}.ffn_norm.weight": hf[p + "post_attention_layernorm.weight"],
        }
    out["norm.weight"] = hf["model.norm.weight"]
    out["lm_head.weight"] = hf["model.embed_tokens.weight" if spec.tied else "lm_head.weight"]
    return out


def dcp_load(path: Path, shapes: dict[str, tuple[int, ...]], dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Load with torch's own DCP reader into zeros."""
    import torch.distributed.checkpoint as dcp

    state = {k: torch.zeros(s, dtype=dtype) for k, s in shapes.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.load(state, checkpoint_id=str(path))
    return state


def dcp_save(state: dict, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))


# --------------------------------------------------------------------------------------------
# The row order


def test_rope_rows_turn_hf_rotary_into_complex_rotary():
    """Attention scores after HF's rotary embedding (transformers' own function, rotate-half pairs)
    equal the scores after complex RoPE on interleaved pairs of the rows as the table orders them;
    the HF order itself does not."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    heads, hd, hidden, seq = 4, 16, 32, 12
    wq, wk = torch.randn(heads * hd, hidden, dtype=torch.float64), torch.randn(heads * hd, hidden, dtype=torch.float64)
    x = torch.randn(seq, hidden, dtype=torch.float64)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)  # [seq, hd/2]
    emb = torch.cat([angles, angles], dim=-1)
    q = (x @ wq.T).view(seq, heads, hd).transpose(0, 1)
    k = (x @ wk.T).view(seq, heads, hd).transpose(0, 1)
    q_hf, k_hf = apply_rotary_pos_emb(q[None], k[None], emb.cos()[None], emb.sin()[None])
    scores_hf = q_hf[0] @ k_hf[0].transpose(-1, -2)

    def complex_scores(order: tuple[int, ...]) -> torch.Tensor:
        rows = torch.tensor([h * hd + r for h in range(heads) for r in order])
        qt = (x @ wq[rows].T).view(seq, heads, hd // 2, 2)
        kt = (x @ wk[rows].T).view(seq, heads, hd // 2, 2)
        cis = torch.polar(torch.ones_like(angles), angles)[:, None, :]
        qr = torch.view_as_real(torch.view_as_complex(qt.contiguous()) * cis).reshape(seq, heads, hd).transpose(0, 1)
        kr = torch.view_as_real(torch.view_as_complex(kt.contiguous()) * cis).reshape(seq, heads, hd).transpose(0, 1)
        return qr @ kr.transpose(-1, -2)

    assert torch.allclose(complex_scores(rope_rows(hd)), scores_hf, atol=1e-9)
    assert not torch.allclose(complex_scores(tuple(range(hd))), scores_hf, atol=1e-3)


def test_rope_rows_match_the_conversion_script_and_invert():
    w = torch.arange(6 * 8 * 3, dtype=torch.float32).reshape(6 * 8, 3)
    ours = w.view(6, 8, 3)[:, list(rope_rows(8))].reshape(48, 3)
    assert torch.equal(ours, hf_to_titan_rows(w, 6))
    back = ours.view(6, 8, 3)[:, list(inverse_rows(rope_rows(8)))].reshape(48, 3)
    assert torch.equal(back, w)


def test_planner_paths_and_fused_qkv_rows():
    assert planner_path("layers.0.attention.wo.weight") == ("layers.0.attention.wo.weight",)
    assert planner_path("optimizer.state.norm.weight.exp_avg") == ("optimizer", "state.norm.weight.exp_avg")
    assert planner_path("dataloader") == ("dataloader",)
    spec = ModelSpec(hidden=64, heads=8, kv_heads=2, head_dim=8, intermediate=96, vocab=128, layers=1, tied=True)
    fused = fused_qkv_param(spec, 0)
    q, k, v = (f"model.layers.0.self_attn.{n}_proj.weight" for n in "qkv")
    assert [(p.hf_key, p.start, p.stop, p.rope) for p in fused.pieces] == [
        (q, 0, 32, True), (k, 0, 8, True), (v, 0, 8, False), (q, 32, 64, True), (k, 8, 16, True), (v, 8, 16, False)]
    assert fused.shape == (96, 64)
    assert "lm_head.weight" not in optimizer_params(spec)
    assert "layers.0.attention.qkv_linear.wqkv.weight" in optimizer_params(spec)


# --------------------------------------------------------------------------------------------
# Round trips, and torch's DCP loader as the independent reader


@pytest.mark.parametrize("name", MODELS)
def test_hf_dcp_hf_is_bit_exact_and_torch_loads_the_titan_tensors(models, tmp_path, name):
    hf = models[name]
    spec = ModelSpec.from_file(hf / "config.json")
    original = hf_state(hf)
    result = ckptconv.to_dcp(hf, tmp_path / "dcp", options=QUIET)
    assert result.finalized
    loaded = dcp_load(tmp_path / "dcp", {p.key: p.shape for p in titan_params(spec)})
    expected = expected_titan_state(original, spec)
    assert sorted(loaded) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(loaded[key], tensor), key
    ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "back", options=QUIET)
    back = hf_state(tmp_path / "back")
    assert sorted(back) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(back[key], tensor) and back[key].dtype == tensor.dtype, key
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["tie_word_embeddings"] == spec.tied


@pytest.mark.parametrize("name,layout", [
    ("gqa", dict(tp=4, pp=2, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=2, hw_backend="trn2")),
    ("mha-tied", dict(tp=2, pp=2)),
    ("gqa-tied", dict(tp=2, pp=1, vpp=1, attention="qkv_linear", fuse_qkv=False, flavour="xser-split")),
])
def test_nxd_dcp_nxd_is_byte_identical(models, tmp_path, name, layout):
    hf = models[name]
    ckptconv.to_nxd(hf, tmp_path / "nxd", options=QUIET, **layout)
    ckptconv.to_dcp(tmp_path / "nxd", tmp_path / "dcp", options=QUIET)
    ckptconv.to_dcp(hf, tmp_path / "dcp-from-hf", options=QUIET)
    for file in (distcp_name(0),):  # the same tensors whichever source they were read from
        assert (tmp_path / "dcp" / file).read_bytes() == (tmp_path / "dcp-from-hf" / file).read_bytes()
    ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "back", to="nxd", options=QUIET, **layout)
    ours = sorted(p.relative_to(tmp_path / "nxd") for p in (tmp_path / "nxd" / "model").rglob("*") if p.is_file())
    theirs = sorted(p.relative_to(tmp_path / "back") for p in (tmp_path / "back" / "model").rglob("*") if p.is_file())
    assert ours == theirs and ours
    for rel in ours:
        assert (tmp_path / "nxd" / rel).read_bytes() == (tmp_path / "back" / rel).read_bytes(), rel


def test_from_dcp_to_nxd_at_another_layout_equals_to_nxd(models, tmp_path):
    hf = models["gqa"]
    ckptconv.to_dcp(hf, tmp_path / "dcp", options=QUIET)
    layout = dict(tp=8, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=4)
    ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "a", to="nxd", options=QUIET, **layout)
    ckptconv.to_nxd(hf, tmp_path / "b", options=QUIET, **layout)
    files = sorted((tmp_path / "b" / "model").iterdir())
    assert len(files) == 8
    for f in files:
        assert (tmp_path / "a" / "model" / f.name).read_bytes() == f.read_bytes()


def test_every_verb_says_each_note_once(models, tmp_path):
    """A result's notes hold each note once (from-dcp --to nxd once listed its reading notes twice)."""
    hf = models["gqa"]
    layout = dict(tp=2, attention="qkv_linear", fuse_qkv=True)
    results = [ckptconv.to_nxd(hf, tmp_path / "nxd", options=QUIET, **layout),
               ckptconv.reshard(tmp_path / "nxd", tmp_path / "pp2", pp=2, options=QUIET),
               ckptconv.to_dcp(tmp_path / "nxd", tmp_path / "dcp", options=QUIET),
               ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "back-nxd", to="nxd", options=QUIET, **layout)]
    with warns_no_tokenizer():
        results.append(ckptconv.to_hf(tmp_path / "nxd", tmp_path / "back-hf", options=QUIET))
    results.append(ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "back-hf2", to="hf", config=hf / "config.json",
                                     options=QUIET))
    for result in results:
        assert result.notes and len(result.notes) == len(set(result.notes)), result.notes


def test_many_files_bf16_and_a_small_memory_budget(models, tmp_path):
    """Several .distcp files, a dtype cast, bands far smaller than a tensor: torch still reads it all."""
    hf = models["gqa"]
    spec = ModelSpec.from_file(hf / "config.json")
    options = RunOptions(quiet=True, max_memory=2**20, workers=3)
    ckptconv.to_dcp(hf, tmp_path / "dcp", dtype="bf16", max_file_size=40_000, options=options)
    assert len(list((tmp_path / "dcp").glob("*.distcp"))) > 3
    loaded = dcp_load(tmp_path / "dcp", {p.key: p.shape for p in titan_params(spec)}, dtype=torch.bfloat16)
    for key, tensor in expected_titan_state(hf_state(hf), spec).items():
        assert torch.equal(loaded[key], tensor.to(torch.bfloat16)), key


# --------------------------------------------------------------------------------------------
# Reading what others wrote; refusing what we do not know


def titan_like_state(hf: Path) -> tuple[dict, ModelSpec]:
    spec = ModelSpec.from_file(hf / "config.json")
    return dict(expected_titan_state(hf_state(hf), spec)), spec


def test_an_unfinished_newest_step_is_skipped_and_said(models, tmp_path):
    """TorchTitan's folder whose newest step-N has no .metadata yet (a save running or dead: DCP writes it last):
    from-dcp converts the newest finished step and the result says which step it skipped; only unfinished steps
    are refused as such."""
    hf = models["gqa"]
    state, _ = titan_like_state(hf)
    dcp_save(state, tmp_path / "ckpt" / "step-2")
    dcp_save(state, tmp_path / "ckpt" / "step-4")
    (tmp_path / "ckpt" / "step-4" / ".metadata").unlink()
    result = ckptconv.from_dcp(tmp_path / "ckpt", tmp_path / "hf", config=hf / "config.json", options=QUIET)
    assert (f"reading {tmp_path / 'ckpt' / 'step-2'} (newest checkpoint step-2; skipped the unfinished save step-4 "
            "(no .metadata: DCP writes it last))") in result.notes
    assert all(torch.equal(hf_state(tmp_path / "hf")[k], v) for k, v in hf_state(hf).items())
    shutil.rmtree(tmp_path / "ckpt" / "step-2")
    with pytest.raises(ConversionError, match=r"ckpt: no finished checkpoint: step-4 has no .metadata \(an unfinished "
                                              r"save: DCP writes it last\)"):
        ckptconv.from_dcp(tmp_path / "ckpt", tmp_path / "hf2", config=hf / "config.json", options=QUIET)


def test_a_truncated_data_file_is_called_an_unfinished_save(models, tmp_path):
    """A data file shorter than .metadata says (a foreign DCP: no ckptconv.json sizes to check it against) is
    refused naming both sizes, not read past its end."""
    hf = models["gqa"]
    state, _ = titan_like_state(hf)
    dcp_save(state, tmp_path / "dcp")
    data = sorted((tmp_path / "dcp").glob("*.distcp"), key=lambda p: p.stat().st_size)[-1]
    size = data.stat().st_size
    os.truncate(data, size // 2)
    with pytest.raises(ConversionError, match=rf"{data}: {size // 2} bytes, but .*/.metadata stores items in it up to "
                                              rf"byte \d+: a truncated file \(an unfinished save, or an incomplete copy\)"):
        ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "hf", config=hf / "config.json", options=QUIET)


def test_reads_a_checkpoint_torch_wrote_with_state_families(models, tmp_path):
    """A DCP saved by torch itself, shaped like TorchTitan's full checkpoint: the model comes back,
    the optimizer/scheduler/train state is recognised and reported as not carried."""
    hf = models["gqa-tied"]
    state, spec = titan_like_state(hf)
    param = optimizer_params(spec)[1]
    state |= {
        "optimizer": {f"state.{param}.exp_avg": torch.ones(3), f"param_groups.{param}.lr": 0.1},
        "lr_scheduler": {"last_epoch": 2}, "train_state": {"step": 2, "ntokens_seen": 64}, "dataloader": None,
    }
    dcp_save(state, tmp_path / "ckpt" / "step-2")
    dcp_save({k: v for k, v in state.items() if "." in k}, tmp_path / "ckpt" / "step-1")
    result = ckptconv.from_dcp(tmp_path / "ckpt", tmp_path / "hf", config=hf / "config.json", options=QUIET)
    assert any("newest checkpoint step-2" in n for n in result.notes)
    assert any("optimizer" in n and "not carried" in n for n in result.notes)
    back, original = hf_state(tmp_path / "hf"), hf_state(hf)
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[k], v) for k, v in original.items())
    with DcpCheckpoint(tmp_path / "ckpt") as ckpt:
        assert ckpt.read_value("train_state.ntokens_seen") == 64
        assert ckpt.read_value(f"optimizer.param_groups.{param}.lr") == 0.1
    # into an nxdtrain tag, the state must be whole: the first missing key named, --weights-only takes the model
    with pytest.raises(ConversionError, match=r"'optimizer.state.tok_embeddings.weight.step' is missing.*--weights-only"):
        ckptconv.from_dcp(tmp_path / "ckpt", tmp_path / "nxd", to="nxd", config=hf / "config.json", options=QUIET)
    ckptconv.from_dcp(tmp_path / "ckpt", tmp_path / "nxd", to="nxd", config=hf / "config.json", weights_only=True,
                      options=QUIET)


@pytest.mark.parametrize("key", ["layers.0.attention.wq.weight", "optimizer.state.lm_head.weight.exp_avg",
                                 "optimizer.state.norm.weight.momentum_buffer", "lr_scheduler.base_lrs"])
def test_a_foreign_key_is_refused_by_name(models, tmp_path, key, capsys):
    hf = models["gqa-tied"]
    state, _ = titan_like_state(hf)
    state[key] = torch.zeros(2)
    dcp_save(state, tmp_path / "dcp")
    with pytest.raises(ConversionError, match=f"unknown key '{key}'.*first unknown key"):
        ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "out", config=hf / "config.json", options=QUIET)
    assert main(["from-dcp", str(tmp_path / "dcp"), str(tmp_path / "out"), "--config", str(hf / "config.json")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ckptconv: error: ") and repr(key) in err[0]
    assert not (tmp_path / "out" / "ckptconv.json").exists()


def test_shape_missing_key_and_missing_config_are_one_line_errors(models, tmp_path):
    hf = models["gqa"]
    state, _ = titan_like_state(hf)
    del state["norm.weight"]
    dcp_save(state, tmp_path / "missing")
    with pytest.raises(ConversionError, match="missing model key 'norm.weight'"):
        ckptconv.from_dcp(tmp_path / "missing", tmp_path / "o1", config=hf / "config.json", options=QUIET)
    state, _ = titan_like_state(hf)
    state["layers.1.feed_forward.w2.weight"] = torch.zeros(64, 95)
    dcp_save(state, tmp_path / "shape")
    with pytest.raises(ConversionError, match=r"w2.weight' is shape \[64, 95\]; the config implies shape \[64, 96\]"):
        ckptconv.from_dcp(tmp_path / "shape", tmp_path / "o2", config=hf / "config.json", options=QUIET)
    with pytest.raises(ConversionError, match="pass --config"):
        ckptconv.from_dcp(tmp_path / "shape", tmp_path / "o3", options=QUIET)
    tied = models["gqa-tied"]
    state, _ = titan_like_state(tied)
    state["lm_head.weight"] = state["lm_head.weight"].clone()
    state["lm_head.weight"][100, 3] += 0.5
    dcp_save(state, tmp_path / "untied")
    with pytest.raises(ConversionError, match=r"ties the embeddings, but .* differ \(max abs difference 0.5\)"):
        ckptconv.from_dcp(tmp_path / "untied", tmp_path / "o4", config=tied / "config.json", options=QUIET)


def _sharded_save(rank: int, world: int, path: str, port: int) -> None:
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
    state = {"rows": distribute_tensor(full, mesh, [Shard(0)]), "cols": distribute_tensor(full * 2, mesh, [Shard(1)])}
    dcp.save(state, checkpoint_id=path)
    dist.destroy_process_group()


def test_reads_tensors_saved_in_chunks_by_several_ranks(tmp_path):
    """FSDP/TP checkpoints store a tensor as chunks split by rows or columns, one per rank."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_sharded_save, args=(2, str(tmp_path / "dcp"), port), nprocs=2, start_method="fork")
    full = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
    with DcpCheckpoint(tmp_path / "dcp") as ckpt:
        assert len(ckpt.entry("rows").chunks) == 2 and len(ckpt.entry("cols").chunks) == 2
        assert len(ckpt.data_files()) == 2
        for start, stop in ((0, 10), (3, 8), (4, 5), (0, 5), (5, 10)):
            assert torch.equal(ckpt.read_rows(Source(None, "rows"), start, stop), full[start:stop])
            assert torch.equal(ckpt.read_rows(Source(None, "cols"), start, stop), 2 * full[start:stop])
        assert ckpt.finish_checks() == 2  # zip CRCs of every item read


# --------------------------------------------------------------------------------------------
# Checked reads, the bytes items phase 2 needs, the CLI


def test_a_damaged_distcp_is_caught_unless_no_check(models, tmp_path, capsys):
    hf = models["gqa"]
    ckptconv.to_dcp(hf, tmp_path / "dcp", options=QUIET)
    data = tmp_path / "dcp" / distcp_name(0)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=distcp_name(0)):
        ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "out", options=QUIET)
    assert not (tmp_path / "out" / "ckptconv.json").exists()
    code = main(["from-dcp", str(tmp_path / "dcp"), str(tmp_path / "out2"), "--no-check", "--quiet"])
    assert code == 0
    back, original = hf_state(tmp_path / "out2"), hf_state(hf)
    assert sum(not torch.equal(back[k], v) for k, v in original.items()) == 1  # the flipped byte, carried


def test_bytes_items_load_in_torch_and_in_our_reader(tmp_path):
    """The writer's small values (what phase 2 puts under lr_scheduler/train_state) as DCP stores them."""
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensor = OutTensor("w", torch.float32, (3, 4), 0, (Piece(Source(None, "w"), 0, 3),))
    files = [OutFile(distcp_name(0), "dcp", (tensor,))]
    values = {distcp_name(0): {"train_state.step": 7, "lr_scheduler.last_epoch": 7}}
    items = layout_items(files, values)
    sink = sink_factory(items)(files[0], tmp_path)
    sink.write_extent("w", 0, weights[:2].contiguous())
    sink.write_extent("w", 32, weights[2:].contiguous())
    sink.finish()
    (tmp_path / ".metadata").write_bytes(encode_metadata(items, planner_path, "s"))
    state = {"w": torch.zeros(3, 4), "train_state": {"step": 0}, "lr_scheduler": {"last_epoch": 0}}
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(tmp_path))
    assert torch.equal(state["w"], weights) and state["train_state"]["step"] == 7
    assert state["lr_scheduler"]["last_epoch"] == 7
    with DcpCheckpoint(tmp_path) as ckpt:
        assert ckpt.read_value("train_state.step") == 7
        assert torch.equal(ckpt.read_rows(Source(None, "w"), 1, 3), weights[1:])


def test_cli_json_quiet_and_layout_flags_need_to_nxd(models, tmp_path, capsys):
    hf = models["mha"]
    assert main(["to-dcp", str(hf), str(tmp_path / "dcp"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # .metadata, one .distcp, torchtitan_config.py, hf/config.json, hf/generation_config.json
    assert out["complete"] and out["files"] == 5
    meta = json.loads((tmp_path / "dcp" / "ckptconv.json").read_text())
    assert meta["kind"] == "dcp" and meta["extra"]["torchtitan"] == "0.3.0"
    assert set(meta["files"]) == {".metadata", distcp_name(0), "torchtitan_config.py", "hf/config.json",
                                 "hf/generation_config.json"}
    assert main(["from-dcp", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--tp", "2"]) == 1
    assert "--to nxd" in capsys.readouterr().err
    assert main(["from-dcp", str(tmp_path / "dcp"), str(tmp_path / "nxd"), "--to", "nxd", "--tp", "2", "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    assert sorted(p.name for p in (tmp_path / "nxd" / "model").iterdir()) == [
        "dp_rank_00_tp_rank_00_pp_rank_00.pt", "dp_rank_00_tp_rank_01_pp_rank_00.pt"]
    assert main(["from-dcp", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--hw-backend", "trn2"]) == 1
    assert "--hw-backend is a layout flag; pass --to nxd" in capsys.readouterr().err
    assert main(["to-dcp", str(hf), str(tmp_path / "dcp3"), "--tp", "2"]) == 1
    assert "layout flags (tp) describe NxD sources only" in capsys.readouterr().err
    # a rerun finds OUT up to date
    assert main(["to-dcp", str(hf), str(tmp_path / "dcp"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["up_to_date"] is True


@pytest.mark.parametrize("damage", ["hostile", "truncated", "not-metadata", "path-escape"])
def test_a_bad_metadata_file_is_one_line_and_runs_nothing(models, tmp_path, capsys, damage):
    import os
    import pickle

    hf = models["gqa"]
    dcp_save(titan_like_state(hf)[0], tmp_path / "dcp")
    meta = tmp_path / "dcp" / ".metadata"
    raw = meta.read_bytes()
    if damage == "hostile":
        meta.write_bytes(pickle.dumps(os.system))
    elif damage == "truncated":
        meta.write_bytes(raw[: len(raw) // 2])
    elif damage == "not-metadata":
        meta.write_bytes(pickle.dumps({"a": 1}))
    else:
        meta.write_bytes(raw.replace(b"__0_0.distcp", b"../_0.distcp"))  # same length
    code = main(["from-dcp", str(tmp_path / "dcp"), str(tmp_path / "out"), "--config", str(hf / "config.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and ".metadata" in err[0] and "Traceback" not in err[0], err
    expected = {"hostile": "refusing to unpickle global posix.system", "truncated": "not a DCP metadata file",
                "not-metadata": "not a DCP Metadata object", "path-escape": "must be a plain name"}[damage]
    assert expected in err[0]


def test_parts_write_what_one_process_writes(models, tmp_path):
    hf = models["gqa"]
    ckptconv.to_dcp(hf, tmp_path / "one", max_file_size=60_000, options=QUIET)
    for k in range(3):
        ckptconv.to_dcp(hf, tmp_path / "parts", max_file_size=60_000, options=RunOptions(quiet=True, part=(k, 3)))
    one = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    parts = sorted(p.relative_to(tmp_path / "parts") for p in (tmp_path / "parts").rglob("*") if p.is_file())
    assert one == parts and len([p for p in one if p.suffix == ".distcp"]) > 3
    for rel in one:
        if rel.name != "ckptconv.json":
            assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "parts" / rel).read_bytes(), rel


def test_fused_qkv_rows_go_into_dcp_and_back_through_the_same_tables(models, tmp_path):
    """What phase 2 does with AdamW moments (keyed by TorchTitan's fused wqkv): any tensor of the fused
    parameter's rows is written from HF-keyed rows and read back through ``titan_tiles``."""
    from ckptconv.core.plan import Plan, compose
    from ckptconv.engine.execute import ExecOptions, run_plan
    from ckptconv.io.hf import HfCheckpoint
    from ckptconv.io.safetensors_sink import safetensors_sink
    from ckptconv.titan.plans import titan_tensor, titan_tiles

    hf = models["gqa"]
    spec = ModelSpec.from_file(hf / "config.json")
    state = hf_state(hf)
    fused = [fused_qkv_param(spec, n) for n in range(spec.layers)]
    key = "optimizer.state.{}.exp_avg"
    tensors = tuple(titan_tensor(p, spec, torch.float32, key=key.format(p.key)) for p in fused)
    files = [OutFile(distcp_name(0), "dcp", tensors)]
    items = layout_items(files)
    with HfCheckpoint(hf) as reader:
        run_plan(Plan(files), reader, tmp_path / "dcp", sink_factory(items), ExecOptions(hash=None, max_memory=2**20))
    (tmp_path / "dcp" / ".metadata").write_bytes(encode_metadata(items, planner_path, "s"))
    # the fused layout by hand: per KV group, its q heads, k head, v head; q/k rows in RoPE order
    hd, group = spec.head_dim, spec.group
    loaded = dcp_load(tmp_path / "dcp", {key.format(p.key): p.shape for p in fused})
    for n, p in enumerate(fused):
        q = hf_to_titan_rows(state[f"model.layers.{n}.self_attn.q_proj.weight"], spec.heads)
        k = hf_to_titan_rows(state[f"model.layers.{n}.self_attn.k_proj.weight"], spec.kv_heads)
        v = state[f"model.layers.{n}.self_attn.v_proj.weight"]
        parts = [t for g in range(spec.kv_heads) for t in (q[g * group * hd:(g + 1) * group * hd],
                                                            k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd])]
        assert torch.equal(loaded[key.format(p.key)], torch.cat(parts))
    # and back: HF q/k/v read from the fused tensors through the inverse table
    tiles = titan_tiles(fused, spec, source_of=lambda titan_key: Source(None, key.format(titan_key)))
    hf_keys = [f"model.layers.{n}.self_attn.{m}_proj.weight" for n in range(spec.layers) for m in "qkv"]
    back = [compose(OutTensor(k, torch.float32, tuple(state[k].shape), 0, (Piece(Source(None, k), 0, state[k].shape[0]),)),
                    tiles) for k in hf_keys]
    with DcpCheckpoint(tmp_path / "dcp", check=False) as reader:
        run_plan(Plan([OutFile("model.safetensors", "safetensors", tuple(back))]), reader, tmp_path / "hf",
                 safetensors_sink, ExecOptions(hash=None, max_memory=2**20))
    from safetensors.torch import load_file

    out = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(out) == sorted(hf_keys) and all(torch.equal(out[k], state[k]) for k in hf_keys)


def test_to_dcp_from_nxd_checks_kv_replicas(models, tmp_path):
    """Copies of a K/V head under kv_size_multiplier must agree, as for to-hf; --kv-replicas first takes rank order."""
    hf = models["gqa"]
    ckptconv.to_nxd(hf, tmp_path / "nxd", tp=4, attention="qkv_linear", kv_size_multiplier=2, options=QUIET)
    shard = tmp_path / "nxd" / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt"
    state = torch.load(shard, weights_only=True)
    state["model.layers.0.self_attn.qkv_proj.weight_k"] += 1.0
    torch.save(state, shard)
    options = RunOptions(quiet=True, check=False)
    with pytest.raises(ConversionError, match="replicas of model.layers.0.self_attn.k_proj.weight.*differ"):
        ckptconv.to_dcp(tmp_path / "nxd", tmp_path / "dcp", options=options)
    ckptconv.to_dcp(tmp_path / "nxd", tmp_path / "dcp2", kv_replicas="first", options=options)
    with pytest.raises(ConversionError, match="'error' or 'first'"):
        ckptconv.to_dcp(tmp_path / "nxd", tmp_path / "dcp3", kv_replicas="mean", options=options)


# --------------------------------------------------------------------------------------------
# A training tag's AdamW state, schedule and step into TorchTitan's keys


ADAMW_GROUP = {"lr": 7e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
               "decoupled_weight_decay": True}


def fake_training_tag(hf: Path, out: Path, *, weight_decay_norms: float = 0.0, **layout) -> Path:
    """Shards of ``layout`` with format-2 AdamW files whose moments are functions of the weights
    (tests.training.nxdtrain_format.test_state), torch AdamW's param groups, and nxdtrain's side files at step 5."""
    from tests.training.nxdtrain_format.test_state import _fake_tag

    ckptconv.to_nxd(hf, out, options=QUIET, **layout)
    _fake_tag(out)
    for path in (out / "optim").iterdir():
        flat = torch.load(path, weights_only=True)
        flat["param_groups"] = [dict(ADAMW_GROUP), {**ADAMW_GROUP, "weight_decay": weight_decay_norms}]
        torch.save(flat, path)
    torch.save({"schedule": "cosine", "lr": 1e-3, "min_lr": 1e-4, "warmup": 2, "decay_steps": 10, "step": 5,
                "last_lr": 7e-4}, out / "scheduler.pt")
    torch.save({"step": 5, "consumed_samples": 20, "rng": [], "options": {"seq_len": 16, "optimizer": "adamw"}},
               out / "user_content.pt")
    return out


def expected_trained(titan: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """TorchTitan's trained parameters from its model keys, by hand: q/k/v fused per KV group (its q heads,
    its k head, its v head), no lm_head when tied."""
    hd, group = spec.head_dim, spec.group
    out = {}
    for key, value in titan.items():
        if key.endswith(("wk.weight", "wv.weight")) or (spec.tied and key == "lm_head.weight"):
            continue
        if key.endswith("wq.weight"):
            q, k, v = (titan[key.replace("wq.", f"w{m}.")] for m in "qkv")
            parts = [t for g in range(spec.kv_heads) for t in (q[g * group * hd:(g + 1) * group * hd],
                                                                k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd])]
            out[key.replace("wq.weight", "wqkv.weight")] = torch.cat(parts)
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("name,layout", [
    ("gqa", dict(tp=2, pp=2, attention="qkv_linear", fuse_qkv=True)),
    ("gqa-tied", dict(tp=2, pp=2, attention="qkv_linear", kv_size_multiplier=1)),
    ("mha", dict(tp=1, pp=1)),
])
def test_to_dcp_of_a_training_tag_writes_titans_adamw_state(models, tmp_path, name, layout):
    hf = models[name]
    spec = ModelSpec.from_file(hf / "config.json")
    tag = fake_training_tag(hf, tmp_path / "tag", **layout)
    # bands far smaller than a tensor, several files: the state streams like the weights
    result = ckptconv.to_dcp(tag, tmp_path / "dcp", max_file_size=40_000,
                             options=RunOptions(quiet=True, check=False, max_memory=2**20, workers=2))
    assert len(list((tmp_path / "dcp").glob("*.distcp"))) > 3
    weights = expected_titan_state(hf_state(hf), spec)
    trained = expected_trained(weights, spec)
    fields = ("lr", "initial_lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
              "differentiable", "fused", "decoupled_weight_decay")
    with DcpCheckpoint(tmp_path / "dcp") as ckpt:
        keys = set(ckpt.keys())
        values = {k: ckpt.read_value(k) for k in keys if not ckpt.entry(k).is_tensor}
    assert keys == (set(weights) | {f"optimizer.state.{p}.{c}" for p in trained for c in ("step", "exp_avg", "exp_avg_sq")}
                    | {f"optimizer.param_groups.{p}.{f}" for p in trained for f in fields}
                    | {"lr_scheduler.last_epoch", "train_state.step", "train_state.ntokens_seen"})
    # torch's own DCP reader: the model as before, every moment the same function of its (fused, permuted) weight
    loaded = dcp_load(tmp_path / "dcp", {**{k: v.shape for k, v in weights.items()},
                                         **{f"optimizer.state.{p}.{c}": w.shape for p, w in trained.items()
                                            for c in ("exp_avg", "exp_avg_sq")},
                                         **{f"optimizer.state.{p}.step": () for p in trained}})
    for key, w in weights.items():
        assert torch.equal(loaded[key], w), key
    for p, w in trained.items():
        assert torch.equal(loaded[f"optimizer.state.{p}.exp_avg"], 2 * w + 1), p
        assert torch.equal(loaded[f"optimizer.state.{p}.exp_avg_sq"], w * w + 3), p
        assert loaded[f"optimizer.state.{p}.step"].item() == 5.0
    # step 6's lr by hand: cosine from 1e-3 to 1e-4 between steps 2 and 10, half way
    group = {f: values[f"optimizer.param_groups.tok_embeddings.weight.{f}"] for f in fields}
    assert group == {**ADAMW_GROUP, "lr": pytest.approx(1e-4 + 9e-4 * 0.5, rel=1e-12), "initial_lr": 1e-3}
    for p in trained:  # nxdtrain's second group (no weight decay) is the norm weights'
        want = {**group, "weight_decay": 0.0} if p.endswith("norm.weight") else group
        assert {f: values[f"optimizer.param_groups.{p}.{f}"] for f in fields} == want, p
    # past warmup: one more than the step (TorchTitan's schedule runs its decay one step later; see titan_state)
    assert (values["lr_scheduler.last_epoch"], values["train_state.step"], values["train_state.ntokens_seen"]) == (6, 5, 320)
    assert any("warmup_steps=2" in n and "decay_type=cosine" in n and "min_lr_factor=0.1" in n
               and "total_steps=10" in n for n in result.notes)
    assert any("data loader position" in n for n in result.notes)
    calls = config_calls(tmp_path / "dcp" / "torchtitan_config.py")
    assert calls["ParamGroupConfig"] == [  # the norm weights' group (nxdtrain's, no weight decay) first
        {"pattern": r"norm\.weight$", "optimizer_name": "AdamW",
         "optimizer_kwargs": {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}},
        {"pattern": ".*", "optimizer_name": "AdamW",
         "optimizer_kwargs": {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}}]
    assert calls["LRSchedulersContainer.Config"] == [dict(warmup_steps=2, total_steps=10, decay_ratio=None,
                                                         decay_type="cosine", min_lr_factor=pytest.approx(0.1))]
    assert calls["CheckpointManager.Config"][0]["initial_load_model_only"] is False
    assert calls["CheckpointManager.Config"][0]["exclude_from_loading"] == ["dataloader"]


def config_calls(path: Path) -> dict[str, list[dict]]:
    """The literal keyword arguments of every call in a generated torchtitan_config.py, by callee (its text
    parsed, not run: TorchTitan is the TorchTitan lane's)."""
    import ast

    out: dict[str, list[dict]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            kwargs = {}
            for kw in node.keywords:
                try:
                    kwargs[kw.arg] = ast.literal_eval(kw.value)
                except ValueError:
                    kwargs[kw.arg] = ast.unparse(kw.value)
            out.setdefault(name, []).append(kwargs)
    return out


def test_to_dcp_of_a_training_tag_weights_only_and_refusals(models, tmp_path):
    hf = models["gqa"]
    tag = fake_training_tag(hf, tmp_path / "tag", weight_decay_norms=0.1)
    options = RunOptions(quiet=True, check=False)
    ckptconv.to_dcp(tag, tmp_path / "dcp", options=options)
    groups = config_calls(tmp_path / "dcp" / "torchtitan_config.py")["ParamGroupConfig"]
    assert [g["optimizer_kwargs"]["weight_decay"] for g in groups] == [0.1, 0.1]  # as the tag's groups hold them
    assert main(["to-dcp", str(tag), str(tmp_path / "model"), "--weights-only", "--no-check", "--quiet"]) == 0
    with DcpCheckpoint(tmp_path / "model") as ckpt:
        assert all(not k.startswith(("optimizer", "lr_scheduler", "train_state")) for k in ckpt.keys())
    for path in (tag / "optim").iterdir():  # SGD: no moments to give TorchTitan's AdamW
        flat = torch.load(path, weights_only=True)
        torch.save({k: v for k, v in flat.items() if not k.endswith(("exp_avg", "exp_avg_sq"))}, path)
    with pytest.raises(ConversionError, match="no AdamW exp_avg for tok_embeddings.weight.*--weights-only"):
        ckptconv.to_dcp(tag, tmp_path / "sgd", options=options)


@pytest.mark.parametrize("name,there,back", [
    ("gqa", dict(tp=2, pp=2, attention="qkv_linear", fuse_qkv=True), dict(tp=1, pp=2, attention="qkv_linear")),
    ("gqa-tied", dict(tp=1, pp=1), dict(tp=2, pp=2, attention="qkv_linear", fuse_qkv=True)),
])
def test_from_dcp_of_a_full_checkpoint_writes_an_nxdtrain_tag(models, tmp_path, name, there, back):
    """Into TorchTitan's keys and back at another layout: every moment is still the same function of its
    weight, the step and hyper-parameters come along, and the tag is complete (side files, markers)."""
    from ckptconv.io.nxd_read import load_shard

    hf = models[name]
    tag = fake_training_tag(hf, tmp_path / "tag", **there)
    ckptconv.to_dcp(tag, tmp_path / "dcp", options=RunOptions(quiet=True, check=False))
    result = ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "back", to="nxd", config=hf / "config.json",
                               consumed_samples=20, options=QUIET, **back)
    assert any("AdamW state and step carried" in n for n in result.notes)
    assert not any("not carried" in n and "optimizer" in n for n in result.notes)
    out = tmp_path / "back"
    assert (out / "done").is_file() and (out / "checkpoint").is_file()
    content = torch.load(out / "user_content.pt", weights_only=True)
    assert (content["step"], content["consumed_samples"], content["options"]["optimizer"]) == (5, 20, "adamw")
    assert torch.load(out / "scheduler.pt", weights_only=True)["step"] == 5
    shards = sorted((out / "model").iterdir())
    assert len(list((out / "optim").iterdir())) == len(shards) == back["tp"] * back["pp"]
    for shard in shards:
        weights = {k: v for k, v in load_shard(shard).items() if not k.endswith("inv_freq")}
        flat = torch.load(out / "optim" / shard.name, weights_only=True)
        assert flat["format"] == 2 and flat["names"] == list(weights) and sorted(flat["owned"]) == sorted(weights)
        assert [g["weight_decay"] for g in flat["param_groups"]] == [0.1, 0.0]
        assert flat["param_groups"][0]["betas"] == (0.9, 0.95)
        for key, w in weights.items():
            assert torch.equal(flat[f"state.{key}.exp_avg"], 2 * w + 1), key
            assert torch.equal(flat[f"state.{key}.exp_avg_sq"], w * w + 3), key
            assert flat[f"state.{key}.step"].item() == 5.0
    # the CLI's flags are the API's
    flags = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in back.items()]
    flags = [f.replace("--attention=qkv_linear", "--qkv-linear") for f in flags]
    assert main(["from-dcp", str(tmp_path / "dcp"), str(tmp_path / "cli"), "--to", "nxd", "--config",
                 str(hf / "config.json"), "--consumed-samples", "20", "--quiet", *flags]) == 0
    assert sorted(p.name for p in (tmp_path / "cli" / "optim").iterdir()) == sorted(p.name for p in (out / "optim").iterdir())
    assert all((tmp_path / "cli" / "optim" / p.name).read_bytes() == p.read_bytes() for p in (out / "optim").iterdir())
    # weights only: plain shards, as before
    weights_only = ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "plain", to="nxd", config=hf / "config.json",
                                     weights_only=True, options=QUIET, **back)
    assert not (tmp_path / "plain" / "optim").exists()
    assert any("not carried" in n and "optimizer key(s)" in n for n in weights_only.notes)
    with pytest.raises(ConversionError, match="--consumed-samples"):
        ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "hf", config=hf / "config.json", consumed_samples=3,
                          options=QUIET)


def test_to_dcp_of_a_bf16_tag_writes_its_fp32_masters(models, tmp_path):
    """A bf16 nxdtrain run keeps fp32 masters with its optimizer state: TorchTitan gets those, not the bf16 copy."""
    from ckptconv.io.nxd_read import load_shard

    hf = models["gqa"]
    spec = ModelSpec.from_file(hf / "config.json")
    tag = fake_training_tag(hf, tmp_path / "tag", tp=2, attention="qkv_linear", fuse_qkv=True)
    for path in (tag / "optim").iterdir():
        flat = torch.load(path, weights_only=True)
        for key, w in load_shard(tag / "model" / path.name).items():
            if not key.endswith("inv_freq"):
                flat[f"state.{key}.master"] = 3 * w.float()
        torch.save(flat, path)
    result = ckptconv.to_dcp(tag, tmp_path / "dcp", options=RunOptions(quiet=True, check=False))
    assert any("fp32 master weights" in n for n in result.notes)
    want = expected_titan_state({k: 3 * v for k, v in hf_state(hf).items()}, spec)
    loaded = dcp_load(tmp_path / "dcp", {k: v.shape for k, v in want.items()})
    assert all(torch.equal(loaded[k], want[k]) for k in want)
    # --no-masters: the shards' weights, the AdamW state still carried
    result = ckptconv.to_dcp(tag, tmp_path / "shards", masters=False, options=RunOptions(quiet=True, check=False))
    assert not any("fp32 master weights" in n for n in result.notes)
    want = expected_titan_state(hf_state(hf), spec)
    loaded = dcp_load(tmp_path / "shards", {k: v.shape for k, v in want.items()})
    assert all(torch.equal(loaded[k], want[k]) for k in want)
    with DcpCheckpoint(tmp_path / "shards") as ckpt:
        assert "optimizer.state.norm.weight.exp_avg" in ckpt.keys()


NXD_CASES = ["zero1_bf16_masters", "zero1_fp32", "plain_fp32", "plain_bf16", "zero1_bf16", "zero1_bf16_dcp",
             "zero1_bf16_masters_xser", "zero1_downcast_fp64_masters", "nxdt_zero1_bf16_masters_xser"]
NXDT_FLAGS = dict(schedule="LinearAnnealingWithWarmUp", warmup=2, decay_steps=10)  # how the NxDT case was run


def nxd_case(name: str) -> tuple[Path, Path]:
    from tests.conftest import REPO

    case = REPO / "fixtures" / "nxdt-official" / name
    return next((case / "ckpt").iterdir()), case / "hf" / "config.json"


def dcp_everything(path: Path) -> dict[str, object]:
    """Every entry of a DCP, tensors and values, as torch's own reader loads it."""
    with DcpCheckpoint(path) as ckpt:
        shapes = {k: tuple(ckpt.entry(k).size) for k in ckpt.keys() if ckpt.entry(k).is_tensor}
        dtypes = ckpt.dtypes()
        values = {k: ckpt.read_value(k) for k in ckpt.keys() if not ckpt.entry(k).is_tensor}
    state = {k: torch.empty(shape, dtype=dtypes[k]) for k, shape in shapes.items()}
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=str(path))
    return {**state, **values}


@pytest.mark.parametrize("name", NXD_CASES)
def test_to_dcp_of_nxds_own_tags_carries_what_reshard_carries(tmp_path, name):
    """A tag NxD's own code saved (its examples' and NxDT's; ZeRO-1 with/without masters, xser, DCP optimizer):
    to-dcp carries its AdamW state, schedule and step directly, every value equal to what it carries of the
    nxdtrain tag `reshard` makes of it (the route that worked before, checked against NxD's own loader)."""
    tag, config = nxd_case(name)
    flags = ScheduleFlags(**NXDT_FLAGS) if name.startswith("nxdt") else None
    result = ckptconv.to_dcp(tag, tmp_path / "direct", config=config, schedule=flags, options=QUIET)
    assert not any("not carried: the optimizer" in n for n in result.notes)
    ckptconv.reshard(tag, tmp_path / "tag", tp=1, pp=1, config=config, options=QUIET)
    ckptconv.to_dcp(tmp_path / "tag", tmp_path / "via", schedule=flags, options=QUIET)
    direct, via = dcp_everything(tmp_path / "direct"), dcp_everything(tmp_path / "via")
    assert sorted(direct) == sorted(via)
    assert any(k.startswith("optimizer.state.") and k.endswith("exp_avg_sq") for k in direct)
    for key, value in direct.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == via[key].dtype and torch.equal(value, via[key]), key
        else:
            assert value == via[key], key
    # the next step's lr is the one NxD's scheduler set (CosineAnnealing / LinearAnnealingWithWarmUp at step 3)
    assert direct["train_state.step"] == 2 and direct["lr_scheduler.last_epoch"] == 2
    assert direct["optimizer.param_groups.norm.weight.lr"] == pytest.approx(0.01, rel=1e-12)
    assert direct["optimizer.param_groups.norm.weight.initial_lr"] == 0.01
    calls = config_calls(tmp_path / "direct" / "torchtitan_config.py")
    scheduler = calls["LRSchedulersContainer.Config"][0]
    want = (dict(decay_type="linear", min_lr_factor=0.0) if name.startswith("nxdt")
            else dict(decay_type="cosine", min_lr_factor=pytest.approx(0.1)))
    assert scheduler == dict(warmup_steps=2, total_steps=10, decay_ratio=None, **want)


def test_to_dcp_of_an_nxdt_tag_without_its_schedule_is_refused_naming_what_is_missing(tmp_path):
    tag, config = nxd_case("nxdt_zero1_bf16_masters_xser")
    with pytest.raises(ConversionError, match=r"records no schedule, min_lr, warmup, decay_steps .*--schedule "
                                              r"SCHEDULE --min-lr MIN_LR \(none for LinearAnnealingWithWarmUp, which "
                                              r"decays to 0\) --warmup WARMUP --decay-steps DECAY_STEPS"):
        ckptconv.to_dcp(tag, tmp_path / "dcp", config=config, options=QUIET)
    assert not (tmp_path / "dcp").exists()
    with pytest.raises(ConversionError, match=r"scheduler set lr 0.01 for step 3; the schedule .* gives"):
        ckptconv.to_dcp(tag, tmp_path / "dcp", config=config, options=QUIET,
                        schedule=ScheduleFlags(schedule="LinearAnnealingWithWarmUp", warmup=4, decay_steps=10))
    with pytest.raises(ConversionError, match=r"--lr 0.02: the tag records lr 0.01"):
        ckptconv.to_dcp(tag, tmp_path / "dcp", config=config, options=QUIET, schedule=ScheduleFlags(lr=0.02, **NXDT_FLAGS))
    result = ckptconv.to_dcp(tag, tmp_path / "model", config=config, weights_only=True, options=QUIET)
    assert not any("optimizer" in k for k in dcp_everything(tmp_path / "model"))
    with pytest.raises(ConversionError, match=r"--warmup: the schedule of a training tag's state; --weights-only"):
        ckptconv.to_dcp(tag, tmp_path / "m2", config=config, weights_only=True, options=QUIET,
                        schedule=ScheduleFlags(warmup=2))
    assert "initial_load_model_only=True" in (tmp_path / "model" / "torchtitan_config.py").read_text()
    assert any("torchtitan.train --module torchtitan_config --config continue_run" in n for n in result.notes)


def test_to_dcp_of_an_nxd_dir_without_state_says_it_is_model_only(models, tmp_path):
    ckptconv.to_nxd(models["gqa"], tmp_path / "nxd", tp=2, options=QUIET)
    result = ckptconv.to_dcp(tmp_path / "nxd", tmp_path / "dcp", options=QUIET)
    assert any(n.startswith("model-only DCP") and "initial_load_model_only=true" in n for n in result.notes)
    calls = config_calls(tmp_path / "dcp" / "torchtitan_config.py")
    assert calls["CheckpointManager.Config"][0]["initial_load_model_only"] is True


def test_a_real_bf16_zero1_tag_through_titans_format_continues(tmp_path):
    """nxdtrain's real bf16 ZeRO-1 tag (format 1, fixtures/nxdtrain-format1) into TorchTitan's keys and back into a
    tag: nxdtrain resumes it (fp32 masters as the weights, AdamW state resharded over dp 2 with ZeRO-1 on load) and its
    steps 3-4 give the losses of the run that wrote it."""
    from tests.conftest import REPO
    from tests.nxdtrain.harness import DIST_TIMEOUT, run_world

    fixture = REPO / "fixtures" / "nxdtrain-format1"
    run = json.loads((fixture / "run.json").read_text())
    result = ckptconv.to_dcp(fixture / "step_2", tmp_path / "dcp", options=QUIET)
    assert any("fp32 master weights" in n for n in result.notes)
    layout = json.loads((fixture / "step_2" / "ckptconv.json").read_text())["layout"]
    back = ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "tag", to="nxd", config=fixture / "step_2/hf/config.json",
                             tp=layout["tp"], pp=layout["pp"], attention=layout["attention"], fuse_qkv=layout["fuse_qkv"],
                             kv_size_multiplier=layout["kvm"], consumed_samples=2 * run["options"]["gbs"], options=QUIET)
    assert any("a run that came from nxdtrain" in n for n in back.notes)
    log = run_world(4, resume=str(tmp_path / "tag"), checkpoint_dir=str(tmp_path / "ckpt"),
                    log_jsonl=str(tmp_path / "log.jsonl"), **{**run["options"], "dist_timeout": DIST_TIMEOUT})
    assert [r["step"] for r in log] == [3, 4]
    assert [r["loss"] for r in log] == pytest.approx(run["losses"][2:], rel=1e-5)


def test_qwen3_goes_to_titans_qwen3_and_back_bit_exact_and_other_families_are_refused(tiny_models, tmp_path):
    """Qwen3 (head_dim, q/k norms) into TorchTitan's qwen3: its cos/sin RoPE rotates halves as HF does, so no q/k
    rows move; the q/k norms are TorchTitan's attention.q_norm/k_norm. A family TorchTitan has no model for is refused
    naming those it has."""
    hf = tiny_models("dcp-qwen3", model_type="qwen3", head_dim=16, layers=2, seed=11)
    ckptconv.to_dcp(hf, tmp_path / "dcp", options=QUIET)
    state = hf_state(hf)
    with DcpCheckpoint(tmp_path / "dcp") as ckpt:
        shapes = {k: tuple(ckpt.entry(k).size) for k in ckpt.keys()}
    loaded = dcp_load(tmp_path / "dcp", shapes)
    assert torch.equal(loaded["layers.1.attention.qkv_linear.wq.weight"], state["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(loaded["layers.0.attention.q_norm.weight"], state["model.layers.0.self_attn.q_norm.weight"])
    assert torch.equal(loaded["layers.0.attention.k_norm.weight"], state["model.layers.0.self_attn.k_norm.weight"])
    assert len(loaded) == len(state) and "torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers" in (
        tmp_path / "dcp" / "torchtitan_config.py").read_text()
    ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "back", options=QUIET)
    back = hf_state(tmp_path / "back")
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)
    mistral = tiny_models("dcp-mistral", model_type="mistral", layers=1, seed=12)
    with pytest.raises(ConversionError, match=r"TorchTitan 0.3.0 has no model for Mistral \(model_type 'mistral'\); "
                                              r"the families it has: llama \(llama3\), qwen3 \(qwen3\), qwen3_moe \(qwen3\)"):
        ckptconv.to_dcp(mistral, tmp_path / "mistral", options=QUIET)
    assert not (tmp_path / "mistral").exists()


def test_a_rope_scaling_torchtitan_does_not_compute_is_refused(tiny_models, tmp_path):
    hf = tiny_models("dcp-yarn", layers=1, seed=13, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 10000.0})
    with pytest.raises(ConversionError, match=r"rope scaling 'linear': TorchTitan 0.3.0's complex RoPE \(llama3\) "
                                              r"does not compute it"):
        ckptconv.to_dcp(hf, tmp_path / "dcp", options=QUIET)
    assert not (tmp_path / "dcp").exists()
