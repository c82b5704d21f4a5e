"""DeepSeek-V3 into TorchTitan's DCP and back (issue 45), main lane: the tiny models of tests/deepseek_models.py (both q
forms, 8 experts top-2 in 4 groups, YaRN, a trained router bias, an MTP layer as the release names it). HF -> DCP
is checked against the safetensors by hand (TorchTitan's names, the experts stacked, the bias in ``expert_bias_E``,
halves RoPE rows permuted into pairs, the MTP layer under ``mtp_layers.0``), DCP -> HF bit-exact (bias and MTP
included, config.json as it was); FP8 blocks of 16 (not dividing the shapes) convert to the bytes of their
dequantized twin (the dequantization written in the test, element by element); the refusals in one line. TorchTitan's
own model loads these DCPs in the TorchTitan lane (tests/test_titan_deepseek.py)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptconv
from ckptconv.cli.main import main
from ckptconv.core.plan import Source
from ckptconv.io.hf import HfCheckpoint
from tests.conftest import hf_state
from tests.deepseek_models import BLOCK, LAYERS, E, dequantize, make_deepseek, make_fp8

QUIET = ckptconv.RunOptions(quiet=True)


def expected_titan(hf: dict[str, torch.Tensor], *, q_lora: bool, mtp: bool) -> dict[str, torch.Tensor]:
    """TorchTitan's deepseek_v3 keys of the HF tensors, written out by hand (interleaved RoPE: no row moves)."""
    out = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"],
           "lm_head.weight": hf["lm_head.weight"]}
    attention = {"kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b", "o_proj": "wo",
                 **({"q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b"} if q_lora else {"q_proj": "wq"})}
    for n in range(LAYERS + mtp):
        t, h = (f"layers.{n}." if n < LAYERS else "mtp_layers.0."), f"model.layers.{n}."
        out.update({f"{t}attention.{b}.weight": hf[f"{h}self_attn.{a}.weight"] for a, b in attention.items()})
        out[t + "attention_norm.weight"] = hf[h + "input_layernorm.weight"]
        out[t + "ffn_norm.weight"] = hf[h + "post_attention_layernorm.weight"]
        if n == 0:
            out.update({f"{t}feed_forward.{w}.weight": hf[f"{h}mlp.{p}_proj.weight"]
                        for w, p in (("w1", "gate"), ("w2", "down"), ("w3", "up"))})
            continue
        out[t + "moe.expert_bias_E"] = hf[h + "mlp.gate.e_score_correction_bias"]
        out[t + "moe.router.gate.weight"] = hf[h + "mlp.gate.weight"]
        for w, p in (("w1_EFD", "gate"), ("w2_EDF", "down"), ("w3_EFD", "up")):
            out[f"{t}moe.routed_experts.inner_experts.{w}"] = torch.stack(
                [hf[f"{h}mlp.experts.{e}.{p}_proj.weight"] for e in range(E)])
        out.update({f"{t}moe.shared_experts.{w}.weight": hf[f"{h}mlp.shared_experts.{p}_proj.weight"]
                    for w, p in (("w1", "gate"), ("w2", "down"), ("w3", "up"))})
    if mtp:
        out.update({"mtp_layers.0.enorm.weight": hf[f"model.layers.{LAYERS}.enorm.weight"],
                    "mtp_layers.0.hnorm.weight": hf[f"model.layers.{LAYERS}.hnorm.weight"],
                    "mtp_layers.0.eh_proj.weight": hf[f"model.layers.{LAYERS}.eh_proj.weight"],
                    "mtp_layers.0.mtp_norm.weight": hf[f"model.layers.{LAYERS}.shared_head.norm.weight"]})
    return out


def read_dcp(dcp: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every key of ``like`` read from the DCP with torch's DCP reader (in ``like``'s dtypes); the DCP holds no
    other model key."""
    import torch.distributed.checkpoint as dcp_api

    keys = set(dcp_api.FileSystemReader(str(dcp)).read_metadata().state_dict_metadata)
    assert keys == set(like)
    state = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_api.load(state, checkpoint_id=str(dcp))
    return state


def same_config(a: Path, b: Path) -> None:
    drop = ("dtype", "torch_dtype", "quantization_config")
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (a, b))
    assert {k: v for k, v in ca.items() if k not in drop} == {k: v for k, v in cb.items() if k not in drop}


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_hf_to_dcp_by_hand_and_back_bit_exact(tmp_path: Path, q_lora_rank):
    src = make_deepseek(tmp_path / "hf", q_lora_rank=q_lora_rank)
    hf = hf_state(src)
    assert hf[f"model.layers.{LAYERS - 1}.mlp.gate.e_score_correction_bias"].abs().min() > 0  # a trained bias
    result = ckptconv.to_dcp(src, tmp_path / "dcp", options=QUIET)
    assert any("1 MTP layer(s) carried" in n for n in result.notes)
    expected = expected_titan(hf, q_lora=q_lora_rank is not None, mtp=True)
    got = read_dcp(tmp_path / "dcp", expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "back", options=QUIET)
    back = hf_state(tmp_path / "back")
    assert set(back) == set(hf)
    for key, value in hf.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key
    same_config(src, tmp_path / "back")


def test_halves_rope_rows_become_pairs(tmp_path: Path):
    """rope_interleave false: HF rotates (i, i + rope/2) of each q head and of the shared key, TorchTitan's complex
    RoPE (2i, 2i+1): those rows are permuted, the nope rows and everything else stay."""
    src = make_deepseek(tmp_path / "hf", rope_interleave=False, mtp=False)
    hf = hf_state(src)
    ckptconv.to_dcp(src, tmp_path / "dcp", options=QUIET)
    like = expected_titan(hf, q_lora=True, mtp=False)
    got = read_dcp(tmp_path / "dcp", like)
    nope, rope, kv = 12, 8, 16
    pairs = [j for i in range(rope // 2) for j in (i, i + rope // 2)]
    wq_b = hf["model.layers.1.self_attn.q_b_proj.weight"].view(4, nope + rope, -1)
    want = torch.cat([wq_b[:, :nope], wq_b[:, nope:][:, pairs]], dim=1).reshape(-1, wq_b.shape[-1])
    assert torch.equal(got["layers.1.attention.wq_b.weight"], want)
    wkv_a = hf["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    assert torch.equal(got["layers.1.attention.wkv_a.weight"], torch.cat([wkv_a[:kv], wkv_a[kv:][pairs]]))
    assert not torch.equal(got["layers.1.attention.wkv_a.weight"], wkv_a)
    ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "back", options=QUIET)
    assert all(torch.equal(v, hf[k]) for k, v in hf_state(tmp_path / "back").items())


def test_mtp_absent_or_dropped(tmp_path: Path, capsys):
    """A transformers-saved model (the config states an MTP layer the weights lack) converts without it and comes
    back as it was; --drop-mtp leaves a present one out, said; config.json is kept."""
    saved = make_deepseek(tmp_path / "saved", mtp=False)
    result = ckptconv.to_dcp(saved, tmp_path / "dcp-saved", options=QUIET)
    assert any("states 1 MTP layer(s) (num_nextn_predict_layers) but the weights hold none" in n for n in result.notes)
    ckptconv.from_dcp(tmp_path / "dcp-saved", tmp_path / "back-saved", options=QUIET)
    assert hf_state(tmp_path / "back-saved").keys() == hf_state(saved).keys()
    same_config(saved, tmp_path / "back-saved")

    full = make_deepseek(tmp_path / "full")
    capsys.readouterr()
    assert main(["to-dcp", str(full), str(tmp_path / "dcp-dropped"), "--drop-mtp", "--quiet"]) == 0
    assert "1 MTP layer(s) dropped (--drop-mtp)" in capsys.readouterr().out
    read_dcp(tmp_path / "dcp-dropped", expected_titan(hf_state(full), q_lora=True, mtp=False))  # no mtp_layers key
    assert "num_mtp_layers=0)" in (tmp_path / "dcp-dropped" / "torchtitan_config.py").read_text()
    ckptconv.from_dcp(tmp_path / "dcp-dropped", tmp_path / "back-dropped", options=QUIET)
    back, hf = hf_state(tmp_path / "back-dropped"), hf_state(full)
    assert set(back) == {k for k in hf if not k.startswith(f"model.layers.{LAYERS}.")}
    assert all(torch.equal(v, hf[k]) for k, v in back.items())


def test_an_mtp_embedding_that_is_not_the_models_is_refused(tmp_path: Path, capsys):
    src = make_deepseek(tmp_path / "hf")
    state = load_file(src / "model.safetensors")
    state[f"model.layers.{LAYERS}.shared_head.head.weight"][3, 5] += 1.0
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()  # transformers' save_pretrained progress bar
    assert main(["to-dcp", str(src), str(tmp_path / "dcp"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"ckptconv: error: {src}: 'model.layers.{LAYERS}.shared_head.head.weight' differs from "
                   "'lm_head.weight' (max abs difference 1); TorchTitan's MTP layers share the model's; pass "
                   "--drop-mtp to convert without the MTP layers")
    assert not (tmp_path / "dcp").exists()
    assert main(["to-dcp", str(src), str(tmp_path / "dcp"), "--quiet", "--drop-mtp"]) == 0


def test_fp8_blocks_convert_to_the_bytes_of_their_dequantized_twin(tmp_path: Path, capsys):
    bf16 = make_deepseek(tmp_path / "bf16", dtype=torch.bfloat16)
    names = make_fp8(bf16, tmp_path / "fp8", tmp_path / "twin")
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    shapes = {tuple(stored[n].shape) for n in names}
    assert any(r % BLOCK or c % BLOCK for r, c in shapes)  # partial blocks at the edges
    twin = hf_state(tmp_path / "twin")
    with HfCheckpoint(tmp_path / "fp8") as reader:  # any band of rows: only its rows and their scale rows are read
        for name in names:
            rows = twin[name].shape[0]
            for start, stop in ((0, rows), (3, 20), (BLOCK, BLOCK + 1), (rows - 5, rows), (BLOCK - 1, 2 * BLOCK + 1)):
                start, stop = min(start, rows - 1), min(stop, rows)
                assert torch.equal(reader.read_rows(Source(None, name), start, stop), twin[name][start:stop]), name
    report = ckptconv.inspect(tmp_path / "fp8")
    assert report["quantization"] == (f"fp8 (float8 weights with a float32 scale per {BLOCK} x {BLOCK} block): "
                                      f"{len(names)} weights, read as bfloat16")
    result = ckptconv.to_dcp(tmp_path / "fp8", tmp_path / "dcp-fp8", options=QUIET)
    assert any(f"{len(names)} quantized weight(s)" in n and "dequantized to bfloat16" in n for n in result.notes)
    ckptconv.to_dcp(tmp_path / "twin", tmp_path / "dcp-twin", options=QUIET)
    data = sorted(p.name for p in (tmp_path / "dcp-twin").glob("*.distcp"))
    assert data and data == sorted(p.name for p in (tmp_path / "dcp-fp8").glob("*.distcp"))
    for name in data:
        assert (tmp_path / "dcp-fp8" / name).read_bytes() == (tmp_path / "dcp-twin" / name).read_bytes()
    ckptconv.from_dcp(tmp_path / "dcp-fp8", tmp_path / "back", options=QUIET)
    back = hf_state(tmp_path / "back")
    assert set(back) == set(twin) and all(torch.equal(back[k], v) for k, v in twin.items())
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert "quantization_config" not in config
    name = names[0]  # --dtype fp32: the products themselves, not their bf16 rounding
    ckptconv.to_dcp(tmp_path / "fp8", tmp_path / "dcp-fp32", dtype="fp32", options=QUIET)
    ckptconv.from_dcp(tmp_path / "dcp-fp32", tmp_path / "back32", options=QUIET)
    q, s = stored[name], stored[name + "_scale_inv"]
    exact = q.float() * s.repeat_interleave(BLOCK, 0)[:q.shape[0]].repeat_interleave(BLOCK, 1)[:, :q.shape[1]]
    assert torch.equal(hf_state(tmp_path / "back32")[name], exact)
    ckptconv.from_dcp(tmp_path / "dcp-fp32", tmp_path / "back16", dtype="bf16", options=QUIET)
    for key, value in hf_state(tmp_path / "back16").items():  # --dtype bf16, but the router bias stays fp32
        want = torch.float32 if key.endswith("e_score_correction_bias") else torch.bfloat16
        assert value.dtype == want and torch.equal(value, twin[key].to(want)), key
    assert torch.equal(exact.bfloat16(), dequantize(q, s))


@pytest.mark.parametrize(("edit", "message"), [
    ("scale", "model.layers.0.self_attn.o_proj.weight_scale_inv has shape [1, 1]; model.layers.0.self_attn.o_proj"
              ".weight [32, 40] in blocks [16, 16] (quantization_config.weight_block_size) needs [2, 3]"),
    ("missing", "model.layers.0.self_attn.o_proj.weight is float8_e4m3fn but has no "
                "model.layers.0.self_attn.o_proj.weight_scale_inv (expected float32 [2, 3] for blocks [16, 16])"),
    ("method", "quantization_config.quant_method is 'awq'; ckptconv reads fp8, mxfp4 (dequantize the checkpoint "
               "first for another method)"),
    ("block", "quantization_config.weight_block_size must be [rows, cols] of positive integers, got [16]"),
])
def test_fp8_refusals_are_one_line(tmp_path: Path, capsys, edit: str, message: str):
    make_fp8(make_deepseek(tmp_path / "bf16", dtype=torch.bfloat16, mtp=False), tmp_path / "fp8", tmp_path / "twin")
    fp8 = tmp_path / "fp8"
    key = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    if edit in ("scale", "missing"):
        state = load_file(fp8 / "model.safetensors")
        if edit == "scale":
            state[key] = torch.ones(1, 1)
        else:
            del state[key]
        save_file(state, fp8 / "model.safetensors", metadata={"format": "pt"})
    else:
        config = json.loads((fp8 / "config.json").read_text())
        if edit == "method":
            config["quantization_config"]["quant_method"] = "awq"
        else:
            config["quantization_config"]["weight_block_size"] = [16]
        (fp8 / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["to-dcp", str(fp8), str(tmp_path / "dcp"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"ckptconv: error: {fp8 / 'config.json'}: {message}"
    assert not (tmp_path / "dcp").exists()


def test_to_nxd_is_refused_naming_to_dcp_and_kimi_k2_converts(tmp_path: Path, capsys):
    src = make_deepseek(tmp_path / "hf", mtp=False)
    capsys.readouterr()  # transformers' save_pretrained progress bar
    assert main(["to-nxd", str(src), str(tmp_path / "nxd"), "--tp", "2", "--quiet"]) == 1
    assert capsys.readouterr().err.strip() == (
        "ckptconv: error: DeepSeek-V3 (model_type 'deepseek_v3'): there is no NxD training model for it (multi-head "
        "latent attention, shared experts, a biased group-limited router); convert it for TorchTitan with to-dcp")
    assert not (tmp_path / "nxd").exists()
    ckptconv.to_dcp(src, tmp_path / "dcp0", options=QUIET)  # nor from a DCP into NxD shards (nxdtrain's layout check)
    assert main(["from-dcp", str(tmp_path / "dcp0"), str(tmp_path / "nxd"), "--to", "nxd", "--quiet"]) == 1
    assert capsys.readouterr().err.strip().endswith("convert it for TorchTitan with to-dcp")
    assert not (tmp_path / "nxd").exists()
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    ckptconv.to_dcp(src, tmp_path / "dcp", options=QUIET)
    ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "back", options=QUIET)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "kimi_k2"
    hf = hf_state(src)
    assert all(torch.equal(v, hf[k]) for k, v in hf_state(tmp_path / "back").items())
