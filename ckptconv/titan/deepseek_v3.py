"""DeepSeek-V3 in TorchTitan's ``deepseek_v3`` model (pinned: :data:`~ckptconv.titan.names.TITAN_VERSION`): its keys,
in its ``state_dict()`` order, each made of whole HF tensors (checked against the live model in the TorchTitan lane).

Per layer ``layers.N.`` (MTP layer ``i``: ``mtp_layers.i.``): ``attention.wq`` (or ``wq_a``, ``q_norm``, ``wq_b``),
``wkv_a``, ``kv_norm``, ``wkv_b``, ``wo``; ``attention_norm``, ``ffn_norm``; an MTP layer's ``enorm``, ``hnorm``,
``eh_proj``, ``mtp_norm`` (HF ``shared_head.norm``); then ``feed_forward.w1/w2/w3`` (gate/down/up) or the MoE block:
``moe.expert_bias_E`` (the router's ``e_score_correction_bias``, carried both ways: TorchTitan adds it to the scores
that choose the experts exactly as HF does), the stacked experts, ``moe.router.gate.weight`` and
``moe.shared_experts.w1/w2/w3``. TorchTitan's complex RoPE turns interleaved pairs: with ``rope_interleave`` (the
release) no row moves; without it, the rope rows of each q head and of ``kv_a_proj_with_mqa`` are permuted as for
Llama. An MTP layer's ``embed_tokens`` and ``shared_head.head`` are TorchTitan's ``tok_embeddings`` and ``lm_head``
(one module shared): ``to-dcp`` checks they are equal (:func:`check_mtp_copies`), ``from-dcp`` writes them back from
those (:func:`shared_copies`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

from ckptconv.core.families.deepseek_v3 import BIAS, dim, q_lora
from ckptconv.core.mapping import EMBED, LM_HEAD, hf_shapes
from ckptconv.core.plan import Piece, ReplicaGroup, Source
from ckptconv.engine.execute import replica_bands
from ckptconv.errors import ConversionError
from ckptconv.titan.deepseek_v3_config import BUILDERS, MODEL_CLS, loss, model_lines
from ckptconv.titan.names import TitanParam, TitanPiece, moe_params

if TYPE_CHECKING:
    from ckptconv.core.model_spec import ModelSpec
    from ckptconv.engine.execute import TensorReader

__all__ = ["BUILDERS", "MODEL_CLS", "carried_mtp", "check_mtp_copies", "loss", "model_lines", "mtp_found",
           "shared_copies", "titan_params"]
DROP_MTP = "--drop-mtp"
MTP_OWN = (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"), ("eh_proj.weight", "eh_proj.weight"),
           ("shared_head.norm.weight", "mtp_norm.weight"))
MTP_SHARED = (("embed_tokens.weight", EMBED), ("shared_head.head.weight", LM_HEAD))  # an MTP layer's, and the model's


def _attention(spec: ModelSpec) -> list[tuple[str, str, int]]:
    """(HF name, TorchTitan name, rows before the rope rows of each head (-1: none rotated)) of the attention."""
    c = spec.config
    nope, kv = dim(c, "qk_nope_head_dim"), dim(c, "kv_lora_rank")
    q = ([("self_attn.q_a_proj.weight", "attention.wq_a.weight", -1),
          ("self_attn.q_a_layernorm.weight", "attention.q_norm.weight", -1),
          ("self_attn.q_b_proj.weight", "attention.wq_b.weight", nope)] if q_lora(c) else
         [("self_attn.q_proj.weight", "attention.wq.weight", nope)])
    return [*q, ("self_attn.kv_a_proj_with_mqa.weight", "attention.wkv_a.weight", kv),
            ("self_attn.kv_a_layernorm.weight", "attention.kv_norm.weight", -1),
            ("self_attn.kv_b_proj.weight", "attention.wkv_b.weight", -1),
            ("self_attn.o_proj.weight", "attention.wo.weight", -1)]


def _pieces(spec: ModelSpec, key: str, rows: int, nope: int) -> tuple[TitanPiece, ...]:
    """The HF rows of a tensor; with ``nope`` >= 0 and halves-RoPE, each head's rope rows in TorchTitan's pair order."""
    if nope < 0 or spec.config.get("rope_interleave", True):
        return (TitanPiece(key, 0, rows),)
    head, rope = nope + spec.head_dim, spec.head_dim
    out = []
    for start in range(0, rows, head):  # kv_a_proj_with_mqa is one "head": kv_lora_rank rows, then the rope rows
        out += [TitanPiece(key, start, start + nope), TitanPiece(key, start + nope, start + nope + rope, rope=True)]
    return tuple(out)


def _whole(spec: ModelSpec, shapes: dict[str, tuple[int, ...]], hf: str, titan: str, nope: int = -1) -> TitanParam:
    shape = shapes[hf]
    return TitanParam(titan, shape, _pieces(spec, hf, shape[0], nope))


def _moe(spec: ModelSpec, shapes: dict[str, tuple[int, ...]], layer: int, prefix: str) -> list[TitanParam]:
    """The MoE block: TorchTitan's qwen3 block (:func:`~ckptconv.titan.names.moe_params`) with the trained bias for
    ``expert_bias_E`` and the shared experts last."""
    hf = f"model.layers.{layer}."
    bias, *stacked = moe_params(spec, layer)
    bias = dataclasses.replace(bias, pieces=(TitanPiece(hf + BIAS, 0, spec.experts),))
    shared = [_whole(spec, shapes, f"{hf}mlp.shared_experts.{p}.weight", f"{prefix}moe.shared_experts.{w}.weight")
              for p, w in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3"))]
    moved = [dataclasses.replace(p, key=prefix + p.key.split(".", 2)[2]) for p in (bias, *stacked)]
    return [*moved, *shared]


def _layer(spec: ModelSpec, shapes: dict[str, tuple[int, ...]], layer: int, prefix: str) -> list[TitanParam]:
    hf = f"model.layers.{layer}."
    out = [_whole(spec, shapes, hf + h, prefix + t, nope) for h, t, nope in _attention(spec)]
    out += [_whole(spec, shapes, hf + "input_layernorm.weight", prefix + "attention_norm.weight"),
            _whole(spec, shapes, hf + "post_attention_layernorm.weight", prefix + "ffn_norm.weight")]
    if layer >= spec.layers:
        out += [_whole(spec, shapes, hf + h, prefix + t) for h, t in MTP_OWN]
    if spec.sparse(layer):
        return out + _moe(spec, shapes, layer, prefix)
    return out + [_whole(spec, shapes, f"{hf}mlp.{p}.weight", f"{prefix}feed_forward.{w}.weight")
                  for p, w in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3"))]


def titan_params(spec: ModelSpec) -> list[TitanParam]:
    """TorchTitan's ``deepseek_v3`` keys for ``spec`` in its ``state_dict()`` order (MTP layers last)."""
    shapes = hf_shapes(spec, with_inv_freq=False)
    out = [_whole(spec, shapes, EMBED, "tok_embeddings.weight")]
    for n in range(spec.layers):
        out += _layer(spec, shapes, n, f"layers.{n}.")
    out += [_whole(spec, shapes, "model.norm.weight", "norm.weight"), _whole(spec, shapes, LM_HEAD, "lm_head.weight")]
    for i in range(spec.mtp_layers):
        out += _layer(spec, shapes, spec.layers + i, f"mtp_layers.{i}.")
    return out


def carried_mtp(spec: ModelSpec, *, drop: bool) -> tuple[ModelSpec, list[str]]:
    """``spec`` with the MTP layers ``to-dcp`` carries (none with ``drop``), and what to say about them."""
    key = spec.family.mtp_key
    stated = spec.config.get(key) or 0 if key else 0
    if drop and spec.mtp_layers:
        return dataclasses.replace(spec, mtp_layers=0), [
            f"{spec.mtp_layers} MTP layer(s) dropped ({DROP_MTP}); config.json keeps {key} {stated}"]
    if stated and not spec.mtp_layers:
        return spec, [f"config.json states {stated} MTP layer(s) ({key}) but the weights hold none (transformers "
                      "drops them on load): converted without them"]
    if spec.mtp_layers:
        return spec, [f"{spec.mtp_layers} MTP layer(s) carried as TorchTitan's mtp_layers (their embed_tokens and "
                      "shared_head.head are the model's: checked equal, written back from them)"]
    return spec, []


def mtp_found(spec: ModelSpec, keys: Collection[str]) -> ModelSpec:
    """``spec`` with the MTP layers a TorchTitan checkpoint holds (``mtp_layers.i.``; fewer than the config states
    when they were dropped or never there)."""
    found = len({key.split(".", 2)[1] for key in keys if key.startswith("mtp_layers.")})
    return spec if found >= spec.mtp_layers else dataclasses.replace(spec, mtp_layers=found)


def shared_copies(spec: ModelSpec) -> dict[str, str]:
    """An MTP layer's embedding and head -> the model's (HF keys): TorchTitan keeps one of each."""
    return {f"model.layers.{spec.layers + i}.{hf}": main for i in range(spec.mtp_layers) for hf, main in MTP_SHARED}


def check_mtp_copies(reader: TensorReader, spec: ModelSpec, where: str) -> None:
    """Each MTP layer's ``embed_tokens`` / ``shared_head.head`` equals the model's (TorchTitan keeps one of each): a
    different one is refused, naming it, unless the MTP layers are dropped."""
    for i in range(spec.mtp_layers):
        for hf, main in MTP_SHARED:
            key = f"model.layers.{spec.layers + i}.{hf}"
            group = ReplicaGroup(main, 0, 0, spec.vocab, (Piece(Source(None, main), 0, spec.vocab),
                                                           Piece(Source(None, key), 0, spec.vocab)))
            for first, other, _ in replica_bands(reader, group):
                if not torch.equal(first, other):
                    diff = (first.float() - other.float()).abs().max().item()
                    raise ConversionError(f"{where}: {key!r} differs from {main!r} (max abs difference {diff:.3g}); "
                                          f"TorchTitan's MTP layers share the model's; pass {DROP_MTP} to convert "
                                          "without the MTP layers")
