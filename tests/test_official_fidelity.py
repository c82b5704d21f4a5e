"""The two rules the golden fixtures do not show (docs/nxd-format.md §3, §4), checked against the spec.

1. Per-layer ``rotary_emb.inv_freq`` (older transformers, fp32) sits right after ``o_proj`` in every
   shard, through ``nxd-compat`` (official argv, merged .pt input) and native ``to-nxd``
   (safetensors input, keys stored sorted), in every attention mode and flavour; the to_full_state
   output keeps that order.
2. Tied shards as the official converter writes them (no ``lm_head.weight``) are valid input.

Every expected key list below is written out by hand from the spec's rules, not computed by the
code under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptconv
from ckptconv.cli.main import main
from ckptconv.commands.inspect import inspect
from ckptconv.commands.verify import verify
from ckptconv.io.nxd_read import load_shard
from tests.conftest import hf_state, make_tiny_llama, warns_no_tokenizer
from tests.official_style import official_tied_shards, old_transformers_llama

QUIET = ckptconv.RunOptions(quiet=True, workers=2)
GQA = dict(heads=8, kv_heads=2, head_dim=8, layers=2)     # tp 2: one K/V head per rank
MHA = dict(heads=4, kv_heads=4, head_dim=16, layers=2)    # coalescing is MHA only

# The official argv per attention mode (official booleans take the string "True").
MODES = {
    "separate": ("gqa", []),
    "coalesced": ("mha", ["--coalesce_qkv", "True"]),
    "qkv_linear": ("gqa", ["--qkv_linear", "True"]),
    "fused": ("gqa", ["--qkv_linear", "True", "--fuse_qkv", "True"]),
}
NATIVE = {"separate": [], "coalesced": ["--coalesce-qkv"], "qkv_linear": ["--qkv-linear"],
          "fused": ["--qkv-linear", "--fuse-qkv"]}

# tp 2 x pp 2, 2 layers: pp rank 0 holds the embedding and layer 0, pp rank 1 layer 1, norm and lm_head.
# Both tp ranks of a pp rank hold the same keys.
EXPECTED_SHARD_KEYS = {
    "separate": [
        ["model.embed_tokens.weight",
         "model.layers.0.self_attn.q_proj.weight",
         "model.layers.0.self_attn.k_proj.weight",
         "model.layers.0.self_attn.v_proj.weight",
         "model.layers.0.self_attn.o_proj.weight",
         "model.layers.0.self_attn.rotary_emb.inv_freq",
         "model.layers.0.mlp.gate_up_proj.weight",
         "model.layers.0.mlp.down_proj.weight",
         "model.layers.0.input_layernorm.weight",
         "model.layers.0.post_attention_layernorm.weight"],
        ["model.layers.1.self_attn.q_proj.weight",
         "model.layers.1.self_attn.k_proj.weight",
         "model.layers.1.self_attn.v_proj.weight",
         "model.layers.1.self_attn.o_proj.weight",
         "model.layers.1.self_attn.rotary_emb.inv_freq",
         "model.layers.1.mlp.gate_up_proj.weight",
         "model.layers.1.mlp.down_proj.weight",
         "model.layers.1.input_layernorm.weight",
         "model.layers.1.post_attention_layernorm.weight",
         "model.norm.weight",
         "lm_head.weight"],
    ],
    "coalesced": [
        ["model.embed_tokens.weight",
         "model.layers.0.self_attn.o_proj.weight",
         "model.layers.0.self_attn.rotary_emb.inv_freq",
         "model.layers.0.mlp.gate_up_proj.weight",
         "model.layers.0.mlp.down_proj.weight",
         "model.layers.0.input_layernorm.weight",
         "model.layers.0.post_attention_layernorm.weight",
         "model.layers.0.self_attn.qkv_proj.weight"],
        ["model.layers.1.self_attn.o_proj.weight",
         "model.layers.1.self_attn.rotary_emb.inv_freq",
         "model.layers.1.mlp.gate_up_proj.weight",
         "model.layers.1.mlp.down_proj.weight",
         "model.layers.1.input_layernorm.weight",
         "model.layers.1.post_attention_layernorm.weight",
         "model.norm.weight",
         "lm_head.weight",
         "model.layers.1.self_attn.qkv_proj.weight"],
    ],
    "qkv_linear": [
        ["model.embed_tokens.weight",
         "model.layers.0.self_attn.qkv_proj.weight_q",
         "model.layers.0.self_attn.qkv_proj.weight_k",
         "model.layers.0.self_attn.qkv_proj.weight_v",
         "model.layers.0.self_attn.o_proj.weight",
         "model.layers.0.self_attn.rotary_emb.inv_freq",
         "model.layers.0.mlp.gate_up_proj.weight",
         "model.layers.0.mlp.down_proj.weight",
         "model.layers.0.input_layernorm.weight",
         "model.layers.0.post_attention_layernorm.weight"],
        ["model.layers.1.self_attn.qkv_proj.weight_q",
         "model.layers.1.self_attn.qkv_proj.weight_k",
         "model.layers.1.self_attn.qkv_proj.weight_v",
         "model.layers.1.self_attn.o_proj.weight",
         "model.layers.1.self_attn.rotary_emb.inv_freq",
         "model.layers.1.mlp.gate_up_proj.weight",
         "model.layers.1.mlp.down_proj.weight",
         "model.layers.1.input_layernorm.weight",
         "model.layers.1.post_attention_layernorm.weight",
         "model.norm.weight",
         "lm_head.weight"],
    ],
    "fused": [
        ["model.embed_tokens.weight",
         "model.layers.0.self_attn.o_proj.weight",
         "model.layers.0.self_attn.rotary_emb.inv_freq",
         "model.layers.0.mlp.gate_up_proj.weight",
         "model.layers.0.mlp.down_proj.weight",
         "model.layers.0.input_layernorm.weight",
         "model.layers.0.post_attention_layernorm.weight",
         "model.layers.0.self_attn.qkv_proj.weight_qkv"],
        ["model.layers.1.self_attn.o_proj.weight",
         "model.layers.1.self_attn.rotary_emb.inv_freq",
         "model.layers.1.mlp.gate_up_proj.weight",
         "model.layers.1.mlp.down_proj.weight",
         "model.layers.1.input_layernorm.weight",
         "model.layers.1.post_attention_layernorm.weight",
         "model.norm.weight",
         "lm_head.weight",
         "model.layers.1.self_attn.qkv_proj.weight_qkv"],
    ],
}

# The official to_full_state: tp rank 0's shards, pp ascending, each key expanded in place into its
# HF keys (coalesced qkv_proj at the end of each pp rank's keys, as in the golden mha case).
EXPECTED_FULL_STATE = {
    "qkv_linear": [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.rotary_emb.inv_freq",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.self_attn.rotary_emb.inv_freq",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ],
    "coalesced": [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.rotary_emb.inv_freq",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.self_attn.rotary_emb.inv_freq",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
    ],
}

# A tied model as the official converter shards it (qkv_linear, tp 2 x pp 2, no inv_freq): no
# lm_head.weight on the last stage, and none in its to_full_state output.
EXPECTED_TIED_LAST_STAGE = [
    "model.layers.1.self_attn.qkv_proj.weight_q",
    "model.layers.1.self_attn.qkv_proj.weight_k",
    "model.layers.1.self_attn.qkv_proj.weight_v",
    "model.layers.1.self_attn.o_proj.weight",
    "model.layers.1.mlp.gate_up_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.layers.1.input_layernorm.weight",
    "model.layers.1.post_attention_layernorm.weight",
    "model.norm.weight",
]
EXPECTED_TIED_FULL_STATE = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.1.self_attn.q_proj.weight",
    "model.layers.1.self_attn.k_proj.weight",
    "model.layers.1.self_attn.v_proj.weight",
    "model.layers.1.self_attn.o_proj.weight",
    "model.layers.1.mlp.gate_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.layers.1.input_layernorm.weight",
    "model.layers.1.post_attention_layernorm.weight",
    "model.norm.weight",
]


def cli(*argv: str | Path) -> None:
    assert main([str(a) for a in argv]) == 0, argv


def shard_keys(model_dir: Path, tp: int, pp: int) -> list[str]:
    """Key order as stored: torch.load for inline tensors; the xser-split .pt is a dict of references."""
    path = model_dir / f"dp_rank_00_tp_rank_0{tp}_pp_rank_0{pp}.pt"
    if Path(f"{path}.info.pt").is_file():
        return list(load_shard(path))
    return list(torch.load(path, weights_only=True))


def assert_equal_states(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


@pytest.fixture(scope="module")
def old_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("old-transformers")
    return {"gqa": old_transformers_llama(root / "gqa", **GQA), "mha": old_transformers_llama(root / "mha", **MHA)}


def test_source_holds_inv_freq_in_module_order(old_models: dict[str, Path]):
    """The input really is what an older transformers saved: fp32 inv_freq right after o_proj, bf16 weights."""
    merged = torch.load(old_models["gqa"] / "merged.pt", weights_only=True)
    keys = list(merged)
    assert keys[4:7] == ["model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.rotary_emb.inv_freq",
                         "model.layers.0.mlp.gate_proj.weight"]
    assert merged["model.layers.0.self_attn.rotary_emb.inv_freq"].dtype == torch.float32
    assert merged["model.layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16
    assert_equal_states(hf_state(old_models["gqa"] / "hf"), merged)


@pytest.mark.parametrize("mode", list(MODES))
def test_inv_freq_follows_o_proj_in_every_shard(old_models: dict[str, Path], tmp_path: Path, mode: str):
    model, flags = MODES[mode]
    src = old_models[model]
    official = ["--convert_from_full_state", "--input_dir", src / "merged.pt", "--config", src / "hf/config.json",
                "--output_dir", tmp_path / "compat", "--tp_size", "2", "--pp_size", "2", "--kv_size_multiplier", "1",
                *flags, "--hw_backend", "trn1"]
    cli("nxd-compat", *official, "--quiet")
    cli("nxd-compat", *[a if a != tmp_path / "compat" else tmp_path / "compat-xser" for a in official],
        "--save_xser", "True", "--quiet")
    cli("to-nxd", src / "hf", tmp_path / "native", "--tp", "2", "--pp", "2", *NATIVE[mode], "--quiet")
    cli("to-nxd", src / "hf", tmp_path / "native-split", "--tp", "2", "--pp", "2", *NATIVE[mode],
        "--xser", "split", "--quiet")
    # plain and xser inline (official --save_xser) from nxd-compat, plain and xser split (NxD training's) natively
    outputs = ["compat", "compat-xser", "native", "native-split"]
    for out in outputs:
        for pp in range(2):
            for tp in range(2):
                assert shard_keys(tmp_path / out / "model", tp, pp) == EXPECTED_SHARD_KEYS[mode][pp], (out, tp, pp)
    # Same bytes from the merged .pt (module order) and from safetensors (keys stored sorted).
    for shard in sorted((tmp_path / "compat" / "model").glob("*.pt")):
        assert shard.read_bytes() == (tmp_path / "native" / "model" / shard.name).read_bytes(), shard.name
    # HF -> NxD -> HF is bit-exact, inv_freq (fp32) included.
    for out in outputs:
        with warns_no_tokenizer():
            ckptconv.to_hf(tmp_path / out, tmp_path / f"back-{out}", config=src / "hf/config.json", options=QUIET)
        assert_equal_states(hf_state(tmp_path / f"back-{out}"), hf_state(src / "hf"))


@pytest.mark.parametrize("mode", list(EXPECTED_FULL_STATE))
def test_to_full_state_keeps_the_official_order(old_models: dict[str, Path], tmp_path: Path, mode: str):
    model, flags = MODES[mode]
    src = old_models[model]
    common = ["--config", src / "hf/config.json", "--tp_size", "2", "--pp_size", "2", "--kv_size_multiplier", "1",
              *flags, "--hw_backend", "trn1", "--quiet"]
    cli("nxd-compat", "--convert_from_full_state", "--input_dir", src / "merged.pt", "--output_dir", tmp_path / "out",
        *common)
    cli("nxd-compat", "--convert_to_full_state", "--input_dir", tmp_path / "out/model", "--output_dir",
        tmp_path / "full", *common)
    full = torch.load(tmp_path / "full/checkpoint.pt", weights_only=True)
    assert list(full) == EXPECTED_FULL_STATE[mode]
    assert_equal_states(full, torch.load(src / "merged.pt", weights_only=True))


def test_reshard_keeps_inv_freq_after_o_proj(old_models: dict[str, Path], tmp_path: Path):
    src = old_models["gqa"]
    ckptconv.to_nxd(src / "hf", tmp_path / "nxd", tp=2, pp=2, attention="qkv_linear", options=QUIET)
    ckptconv.reshard(tmp_path / "nxd", tmp_path / "one", tp=1, pp=1, options=QUIET)
    assert shard_keys(tmp_path / "one/model", 0, 0) == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.qkv_proj.weight_q",
        "model.layers.0.self_attn.qkv_proj.weight_k",
        "model.layers.0.self_attn.qkv_proj.weight_v",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.rotary_emb.inv_freq",
        "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.self_attn.qkv_proj.weight_q",
        "model.layers.1.self_attn.qkv_proj.weight_k",
        "model.layers.1.self_attn.qkv_proj.weight_v",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.self_attn.rotary_emb.inv_freq",
        "model.layers.1.mlp.gate_up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "one", tmp_path / "back", options=QUIET)
    assert_equal_states(hf_state(tmp_path / "back"), hf_state(src / "hf"))


# --------------------------------------------------------------------------------------------
# Tied embeddings: the official converter's shards carry no lm_head.weight


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tied bf16 Llama, our tp 2 x pp 2 qkv_linear shards of it, and the official converter's form."""
    root = tmp_path_factory.mktemp("tied")
    hf = make_tiny_llama(root / "hf", tied=True, dtype=torch.bfloat16, **GQA)
    ckptconv.to_nxd(hf, root / "ours", tp=2, pp=2, attention="qkv_linear", options=QUIET)
    return {"hf": hf, "ours": root / "ours", "official": official_tied_shards(root / "ours", root / "official")}


def test_official_tied_shards_are_ours_without_lm_head(tied: dict[str, Path]):
    """Same writer: pp rank 0 files are byte-identical to ours, the last stage only lacks lm_head.weight."""
    for tp in range(2):
        name = f"dp_rank_00_tp_rank_0{tp}_pp_rank_00.pt"
        assert (tied["official"] / "model" / name).read_bytes() == (tied["ours"] / "model" / name).read_bytes()
        assert shard_keys(tied["official"] / "model", tp, 1) == EXPECTED_TIED_LAST_STAGE
        assert shard_keys(tied["ours"] / "model", tp, 1) == [*EXPECTED_TIED_LAST_STAGE, "lm_head.weight"]
    assert sorted(p.name for p in tied["official"].iterdir()) == ["model"]


def test_official_tied_shards_to_full_state(tied: dict[str, Path], tmp_path: Path):
    cli("nxd-compat", "--convert_to_full_state", "--input_dir", tied["official"] / "model", "--output_dir",
        tmp_path / "full", "--config", tied["hf"] / "config.json", "--tp_size", "2", "--pp_size", "2",
        "--kv_size_multiplier", "1", "--qkv_linear", "True", "--hw_backend", "trn1", "--quiet")
    full = torch.load(tmp_path / "full/checkpoint.pt", weights_only=True)
    assert list(full) == EXPECTED_TIED_FULL_STATE
    assert_equal_states(full, hf_state(tied["hf"]))


def test_official_tied_shards_to_hf_compute_the_source_logits(tied: dict[str, Path], tmp_path: Path):
    from transformers import LlamaForCausalLM

    cli("to-hf", tied["official"], tmp_path / "back", "--config", tied["hf"] / "config.json", "--quiet")
    assert json.loads((tmp_path / "back/config.json").read_text())["tie_word_embeddings"] is True
    assert_equal_states(hf_state(tmp_path / "back"), hf_state(tied["hf"]))
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = LlamaForCausalLM.from_pretrained(tied["hf"]).eval()(ids).logits
        actual = LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()(ids).logits
    assert torch.equal(actual, expected)


def test_verify_computes_official_tied_logits_with_the_embedding(tied: dict[str, Path], tmp_path: Path):
    report = verify(tied["hf"], tied["official"], config=tied["hf"] / "config.json")
    assert report["ok"], report["problems"]
    # The check can fail: another embedding on tp rank 1 changes the lookup and the tied logits.
    broken = official_tied_shards(tied["official"], tmp_path / "broken")
    path = broken / "model/dp_rank_00_tp_rank_01_pp_rank_00.pt"
    state = torch.load(path, weights_only=True)
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * 2
    torch.save(state, path)
    report = verify(tied["hf"], broken, config=tied["hf"] / "config.json")
    assert [p.split(":")[0] for p in report["problems"]] == ["embedding", "lm_head"]


def test_inspect_names_how_the_tied_head_is_stored(tied: dict[str, Path]):
    official = inspect(tied["official"], config=tied["hf"] / "config.json")
    ours = inspect(tied["ours"])
    assert official["lm_head"] == ("tied: no lm_head.weight (the official converter's form); "
                                   "the embedding is the output projection")
    assert ours["lm_head"] == "tied: lm_head.weight is a copy of the embedding"
    assert official["model"]["tied"] is True and official["layout"]["tp"] == 2


def test_reshard_of_official_tied_shards_writes_our_copy(tied: dict[str, Path], tmp_path: Path):
    ckptconv.reshard(tied["official"], tmp_path / "one", tp=1, pp=1, config=tied["hf"] / "config.json", options=QUIET)
    shard = torch.load(tmp_path / "one/model/dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    assert list(shard)[-1] == "lm_head.weight"
    assert torch.equal(shard["lm_head.weight"], hf_state(tied["hf"])["model.embed_tokens.weight"])
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "one", tmp_path / "back", options=QUIET)
    assert_equal_states(hf_state(tmp_path / "back"), hf_state(tied["hf"]))


def test_tied_last_stage_shards_must_agree(tied: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """tp rank 0 has no lm_head.weight (official form), tp rank 1 has one: a mix, refused by name."""
    mixed = official_tied_shards(tied["official"], tmp_path / "mixed")
    name = "dp_rank_00_tp_rank_01_pp_rank_01.pt"
    (mixed / "model" / name).write_bytes((tied["ours"] / "model" / name).read_bytes())
    assert main(["to-hf", str(mixed), str(tmp_path / "back"), "--config", str(tied["hf"] / "config.json"),
                 "--quiet"]) == 1
    assert capsys.readouterr().err == (
        f"ckptconv: error: {mixed / 'model' / name}: unexpected key 'lm_head.weight' for layout "
        "tp 2 pp 2 vpp 1 kvm 1 qkv_linear trn1\n")
