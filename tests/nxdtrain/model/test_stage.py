"""The stage model: its state is the shard byte for byte, and its numerics are transformers'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ckptconv.commands.api import open_nxd
from ckptconv.core.layout import ParallelLayout, shard_name
from ckptconv.core.model_spec import ModelSpec
from ckptconv.io.nxd_read import load_shard
from ckptconv.io.nxd_write import save_shard
from nxdtrain.errors import TrainError
from nxdtrain.model.rope import inv_freq
from nxdtrain.model.stage import LlamaStage
from nxdtrain.parallel.layers import TpGroup, vocab_parallel_cross_entropy
from tests.conftest import hf_state
from tests.nxdtrain.harness import convert

LAYOUTS = {
    "gqa-tp2-pp2-fused": ("gqa", dict(tp=2, pp=2, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=2)),
    "gqa2-tp4-trn2-xser": ("gqa2", dict(tp=4, attention="qkv_linear", kv_size_multiplier=2, hw_backend="trn2",
                                        flavour="xser-split")),
    "mha-tp2-pp2-separate": ("mha", dict(tp=2, pp=2, attention="separate")),
    "mha-tp2-coalesced-xser": ("mha", dict(tp=2, attention="coalesced", flavour="xser-inline")),
    "tied-tp2-pp2": ("tied", dict(tp=2, pp=2, attention="qkv_linear")),
    "inv-freq-tp2-pp2": ("inv_freq", dict(tp=2, pp=2, attention="qkv_linear", kv_size_multiplier=2, fuse_qkv=True)),
}


def with_inv_freq(hf: Path, out: Path) -> Path:
    """An HF state dict that also carries rotary_emb.inv_freq per layer (older exports do)."""
    from safetensors.torch import save_file

    out.mkdir(exist_ok=True)
    state = hf_state(hf)
    config = json.loads((hf / "config.json").read_text())
    for layer in range(config["num_hidden_layers"]):
        state[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = inv_freq(config)
    save_file(state, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config))
    return out


def files_of(shard: Path) -> dict[str, bytes]:
    paths = [shard, Path(f"{shard}.info.pt"), *sorted(Path(f"{shard}.tensors").glob("*"))]
    return {p.name: p.read_bytes() for p in paths if p.is_file()}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_stage_state_is_the_shard_byte_for_byte(tmp_path, hf_model, case):
    """Load every rank's shard with strict=True and save it again: the same bytes as ckptconv wrote."""
    name, layout = LAYOUTS[case]
    flavour = layout.pop("flavour", "plain")
    hf = with_inv_freq(hf_model("gqa"), tmp_path / "hf") if name == "inv_freq" else hf_model(name)
    src = convert(hf / "model.safetensors" if name == "inv_freq" else hf, tmp_path / "nxd", flavour=flavour,
                  **({"config": hf / "config.json"} if name == "inv_freq" else {}), **layout)
    opened = open_nxd(src)
    ckpt, spec, parsed, inv = opened.ckpt, opened.spec, opened.layout, opened.with_inv_freq
    ckpt.close()
    assert inv == (name == "inv_freq")
    for pp in range(parsed.pp):
        for tp in range(parsed.tp):
            stage = LlamaStage(spec, parsed, tp=TpGroup(parsed.tp, tp), pp_rank=pp, with_inv_freq=inv)
            shard = src / "model" / shard_name(tp_rank=tp, pp_rank=pp)
            state = load_shard(shard)
            assert list(stage.state_dict()) != [] and set(stage.state_dict()) == set(state)
            stage.load_shard_state(state, str(shard))
            again = tmp_path / f"again-{tp}-{pp}" / shard.name
            again.parent.mkdir()
            save_shard(again, stage.shard_state(), flavour)
            assert files_of(again) == files_of(shard), (tp, pp)


@pytest.mark.parametrize("model,layout", [
    ("gqa", dict(attention="separate")),
    ("gqa2", dict(attention="qkv_linear")),
    ("gqa2", dict(attention="qkv_linear", fuse_qkv=True)),
    ("mha", dict(attention="coalesced")),
    ("tied", dict(attention="qkv_linear", fuse_qkv=True)),
    ("llama3", dict(attention="qkv_linear", fuse_qkv=True)),
])
def test_stages_compute_transformers_logits(tmp_path, hf_model, model, layout):
    """tp 1 x pp 2: stage 0 then stage 1 (offline, no process group) give transformers' logits."""
    from transformers import AutoModelForCausalLM

    hf = llama3_model(tmp_path / "hf", hf_model("gqa2")) if model == "llama3" else hf_model(model)
    src = convert(hf, tmp_path / "nxd", pp=2, **layout)
    opened = open_nxd(src)
    ckpt, spec, parsed = opened.ckpt, opened.spec, opened.layout
    ckpt.close()
    stages = [LlamaStage(spec, parsed, tp=TpGroup(), pp_rank=pp) for pp in range(2)]
    for pp, stage in enumerate(stages):
        shard = src / "model" / shard_name(tp_rank=0, pp_rank=pp)
        stage.load_shard_state(load_shard(shard), str(shard))
    ids = torch.randint(0, spec.vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = stages[1](stages[0](ids))
        theirs = AutoModelForCausalLM.from_pretrained(hf).eval()(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-5


def llama3_model(out: Path, base: Path) -> Path:
    """A copy of ``base`` whose config asks for Llama 3.1 RoPE scaling."""
    import shutil

    shutil.copytree(base, out)
    config = json.loads((out / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_frequencies_equal_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_parameters=rope,
                         max_position_embeddings=4096)
    if rope["rope_type"] == "default":
        theirs, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    assert torch.equal(inv_freq(config.to_dict()), theirs)


SPEC = ModelSpec(hidden=64, heads=8, kv_heads=2, head_dim=8, intermediate=96, vocab=128, layers=2, tied=False,
                 config={"hidden_size": 64, "num_attention_heads": 8})


def test_layouts_that_cannot_train_are_rejected():
    official = ParallelLayout(tp=4, attention="qkv_linear", kvm=2, hw="trn2", trn2_kv_layout="official")
    with pytest.raises(TrainError, match=r"puts Q head 2 on tp rank 1 without its K/V head 0; reshard with "
                                         r"ckptconv reshard --trn2-kv-layout runtime"):
        LlamaStage(SPEC, official, tp=TpGroup(4, 1), pp_rank=0)
    with pytest.raises(TrainError, match="virtual pipeline stages are not supported by nxdtrain; reshard with "
                                         "ckptconv reshard --vpp 1"):
        LlamaStage(SPEC, ParallelLayout(pp=1, vpp=2), tp=TpGroup(), pp_rank=0)
    with pytest.raises(TrainError, match="hidden_act 'gelu' is not supported"):
        spec = ModelSpec(**{**SPEC.__dict__, "config": {**SPEC.config, "hidden_act": "gelu"}})
        LlamaStage(spec, ParallelLayout(), tp=TpGroup(), pp_rank=0)


def test_cross_entropy_equals_torch():
    logits = torch.randn(10, 128, generator=torch.Generator().manual_seed(0), requires_grad=True)
    target = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(1))
    target[3] = -100
    ours = vocab_parallel_cross_entropy(logits, target, TpGroup()).sum()
    (grad_ours,) = torch.autograd.grad(ours, logits)
    theirs = F.cross_entropy(logits, target, reduction="sum")
    (grad_theirs,) = torch.autograd.grad(theirs, logits)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-5)
    assert (grad_ours - grad_theirs).abs().max().item() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_in_the_logits_memory_is_the_same_bits(dtype):
    """``overwrite=True`` (pp 1: the loss works in the logits' own memory) computes exactly what a fresh buffer does:
    the same loss and gradient bits, fp32 and bf16; without it the caller's logits are left as they were."""
    leaf = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    target = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(1))
    target[5] = -100
    results = []
    for overwrite in (False, True):
        logits = leaf * 3  # a temporary, as the LM head's output is
        kept = logits.detach().clone()
        loss = vocab_parallel_cross_entropy(logits, target, TpGroup(), overwrite=overwrite)
        (grad,) = torch.autograd.grad(loss.sum(), leaf)
        results.append((loss, grad))
        assert torch.equal(logits.detach(), kept) != (overwrite and dtype == torch.float32)
    (loss_fresh, grad_fresh), (loss_in_place, grad_in_place) = results
    assert torch.equal(loss_fresh, loss_in_place) and torch.equal(grad_fresh, grad_in_place)
    reference = F.cross_entropy((leaf.detach() * 3).float(), target, reduction="none")
    assert torch.allclose(loss_in_place, reference, atol=1e-5)
