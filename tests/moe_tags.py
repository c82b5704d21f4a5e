"""Hand-written MoE training tags (nxdtrain's format 2) for the tests, and a reader of one expert's state in a tag.

The models: tiny Mixtral and Qwen3-MoE made by transformers (hidden 8 != expert intermediate 12, 4 experts top-2,
GQA: 4 heads, 2 KV heads; Qwen3-MoE with a dense layer). The shards come from ``ckptconv.to_nxd`` (their layout is
tested against transformers and NxD's shapes in tests/test_moe.py); the optimizer files are written here with
``torch.save``, not by ckptconv's writer, as docs/nxd-optimizer-format.md ("Format 2 with expert parallelism")
describes them: one file per dp rank, no ep field in the name, ep rank = dp rank % ep, non-expert state in any dp
rank's file, an ep rank's experts only in its own dp ranks' files. The parameters are dealt round-robin (not by
torch's ZeroRedundancyOptimizer rule): a reader must find state by name, wherever it was saved.

Every component is an elementwise function of its parameter's weight (:data:`COMPONENTS`), so each expert's
moments and masters differ (the weights are random) and the expected value of any tensor at any layout is known
from the HF weights alone: :func:`expected_expert` against :func:`expert_in_tag`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

import ckptconv
from ckptconv.core.families.moe import NXD_DOWN, NXD_GATE_UP
from ckptconv.io.digest import record_files
from ckptconv.io.metadata import read_metadata, write_metadata
from ckptconv.io.nxd_read import load_shard
from ckptconv.io.tags import write_markers

H, I, E, TOP_K = 8, 12, 4, 2  # noqa: E741  hidden != expert intermediate
STEP = 7
COMPONENTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "exp_avg": lambda w: 2 * w + 1,
    "exp_avg_sq": lambda w: w * w + 3,
    "master": lambda w: w + 0.25,  # not the weight itself: a weight read for a master shows
}
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": False, "maximize": False, "foreach": None,
         "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True}
EXPERT_NAMES = {"mixtral": ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
                            "block_sparse_moe.experts.{e}.w2.weight"),
                "qwen3_moe": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                              "mlp.experts.{e}.down_proj.weight")}
_SHARD = re.compile(r"^dp_rank_00(?:_ep_rank_(\d+))?_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")
_OPTIM = re.compile(r"^dp_rank_(\d+)_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")


def tiny_moe(family: str, out: Path) -> Path:
    """A tiny ``family`` model (``mixtral`` 2 layers, ``qwen3_moe`` 3 layers, layer 1 dense) saved at ``out``."""
    import transformers

    common = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=4, vocab_size=32,
                  num_experts_per_tok=TOP_K)
    torch.manual_seed(3)
    if family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=I, num_local_experts=E, num_hidden_layers=2, **common))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=16, moe_intermediate_size=I, num_experts=E, num_hidden_layers=3, mlp_only_layers=[1],
            norm_topk_prob=True, **common))
    model.save_pretrained(out)
    return out


def one_layer_mixtral(out: Path, hidden: int, intermediate: int, experts: int, *, head_dim: int, heads: int = 4,
                      kv_heads: int = 2, seed: int = 0) -> torch.nn.Module:
    """A one-layer Mixtral of these shapes (top-2, vocabulary 32, seeded weights) saved at ``out``; the model."""
    import transformers

    config = transformers.MixtralConfig(hidden_size=hidden, intermediate_size=intermediate, num_local_experts=experts,
                                        num_experts_per_tok=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                        head_dim=head_dim, vocab_size=32, num_hidden_layers=1)
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(config)
    model.save_pretrained(out)
    return model


def state_of(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every optimizer tensor of a parameter with this weight: AdamW's step, moments, the fp32 master."""
    w = weight.float()
    return {"step": torch.tensor(float(STEP)), **{c: f(w) for c, f in COMPONENTS.items()}}


def write_tag(hf: Path, out: Path, *, tp: int = 1, pp: int = 1, ep: int = 1, dp: int = 1, zero1: bool = False) -> Path:
    """A complete nxdtrain training tag of the model at ``hf``: shards at tp x pp x ep, optimizer files over ``dp``
    ranks (ZeRO-1) or one per ep rank (without), side files, digests in ckptconv.json, markers."""
    assert not zero1 or dp % ep == 0
    ckptconv.to_nxd(hf, out, tp=tp, pp=pp, ep=ep, options=ckptconv.RunOptions(quiet=True, workers=1))
    shards: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
    for path in sorted((out / "model").iterdir()):
        m = _SHARD.match(path.name)
        assert m, path.name
        shards[(int(m.group(1) or 0), int(m.group(2)), int(m.group(3)))] = load_shard(path)
    (out / "optim").mkdir()
    groups = [{**ADAMW, "weight_decay": 0.1}, {**ADAMW, "weight_decay": 0.0}]
    for s in range(tp):
        for p in range(pp):
            dense = {k: v for k, v in shards[(0, s, p)].items() if not _expert(k) and not k.endswith("inv_freq")}
            for d in range(dp if zero1 else ep):
                e, local = d % ep, d // ep
                experts = {k: v for k, v in shards[(e, s, p)].items() if _expert(k)}
                dense_here = _deal(list(dense), dp, d) if zero1 else (list(dense) if d == 0 else [])
                experts_here = _deal(list(experts), dp // ep, local) if zero1 else list(experts)
                flat: dict[str, object] = {
                    "format": 2, "names": list(dense) + list(experts), "zero1": zero1,
                    "zero_size": dp if zero1 else 1, "dp_rank": d, "owned": dense_here + experts_here,
                    "param_groups": groups}
                if ep > 1:
                    flat.update(ep=ep, ep_rank=e)
                for name in dense_here + experts_here:
                    weight = dense[name] if name in dense else experts[name]
                    flat.update({f"state.{name}.{c}": t for c, t in state_of(weight).items()})
                torch.save(flat, out / "optim" / f"dp_rank_{d:02d}_tp_rank_{s:02d}_pp_rank_{p:02d}.pt")
    torch.save({"step": STEP, "schedule": "cosine", "lr": 1e-3, "min_lr": 1e-4, "warmup": 2, "decay_steps": 20},
               out / "scheduler.pt")
    torch.save({"step": STEP, "consumed_samples": 8 * STEP, "rng": [],
                "options": {"tp": tp, "pp": pp, "ep": ep, "zero1": zero1}}, out / "user_content.pt")
    meta = read_metadata(out)
    assert meta is not None
    extra = sorted((out / "optim").iterdir()) + [out / "scheduler.pt", out / "user_content.pt"]
    meta.files.update({rel: rec.to_json() for rel, rec in record_files(extra, out, "blake3").items()})
    write_metadata(out, meta)
    write_markers(out)
    return out


def _expert(key: str) -> bool:
    return key.endswith(NXD_GATE_UP) or key.endswith(NXD_DOWN)


def _deal(names: list[str], world: int, rank: int) -> list[str]:
    return names[rank::world]


def expected_expert(hf: Path, family: str, layer: int, expert: int, component: str) -> list[torch.Tensor]:
    """``component`` of expert ``expert`` of ``layer`` in HF orientation: gate [I, H], up [I, H], down [H, I]."""
    weights = load_file(hf / "model.safetensors")
    return [state_of(weights[f"model.layers.{layer}." + n.format(e=expert)])[component]
            for n in EXPERT_NAMES[family]]


def expert_in_tag(tag: Path, layer: int, expert: int, component: str, *, experts: int = E,
                  inter: int = I) -> list[torch.Tensor]:
    """``component`` of that expert as a tag holds it, gathered by hand from NxD's expert layout (gate_up
    ``[E/ep, H, 2I/tp]`` with each tp rank's last dim ``[gate_r | up_r]``, down ``[E/ep, I/tp, H]``, ep rank r the
    experts ``[r E/ep, (r+1) E/ep)``) and the format's placement (ep rank = dp rank % ep), in HF orientation;
    ``experts`` and ``inter``: the model's, where it is not the tiny one of this module."""
    layout = json.loads((tag / "ckptconv.json").read_text())["layout"]
    tp, ep = layout.get("tp", 1), layout.get("ep", 1)
    per = experts // ep
    rank, local = divmod(expert, per)
    prefix = f"model.layers.{layer}."
    found: dict[tuple[str, int], torch.Tensor] = {}
    for path in sorted((tag / "optim").iterdir()):
        m = _OPTIM.match(path.name)
        assert m, path.name
        state = torch.load(path, weights_only=True)
        if int(m.group(1)) % ep != rank:
            continue
        assert state.get("ep_rank", 0) == rank, path
        for kind in (NXD_GATE_UP, NXD_DOWN):
            key = f"state.{prefix}{kind}.{component}"
            if key in state:
                assert (kind, int(m.group(2))) not in found, (path, key)  # one dp rank holds it
                found[(kind, int(m.group(2)))] = state[key][local]
    gate_up = [found[(NXD_GATE_UP, s)] for s in range(tp)]
    half = inter // tp
    gate = torch.cat([g[:, :half].T for g in gate_up])
    up = torch.cat([g[:, half:].T for g in gate_up])
    down = torch.cat([found[(NXD_DOWN, s)].T for s in range(tp)], dim=1)
    return [gate, up, down]


def all_state(tag: Path) -> dict[tuple[str, str], torch.Tensor]:
    """Every (shard file, state key) of a tag's optimizer files: a file of ep rank e (dp rank % ep) under ep rank e's
    shard for its experts, ep rank 0's for the rest; each key held once."""
    layout = json.loads((tag / "ckptconv.json").read_text())["layout"]
    ep = layout.get("ep", 1)
    out: dict[tuple[str, str], torch.Tensor] = {}
    for path in sorted((tag / "optim").iterdir()):
        m = _OPTIM.match(path.name)
        assert m, path.name
        d, s, p = (int(g) for g in m.groups())
        for key, value in torch.load(path, weights_only=True).items():
            if key.startswith("state."):
                e = d % ep if _expert(key.rsplit(".", 1)[0]) else 0
                shard = f"dp_rank_00{f'_ep_rank_{e:02d}' if ep > 1 else ''}_tp_rank_{s:02d}_pp_rank_{p:02d}.pt"
                assert (shard, key) not in out, (path, key)
                out[(shard, key)] = value
    return out
