"""Head order, pipeline split and validation: hand-computed tables (docs/nxd-format.md §3, §4)."""

from __future__ import annotations

import pytest

import ckptconv
from ckptconv.core.layout import ParallelLayout, layer_pp_ranks, parse_shard_name, shard_name, stage_layer_counts
from ckptconv.core.mapping import hf_key_order, hf_shapes, kv_heads, q_heads, shard_records, stores_lm_head
from ckptconv.core.model_spec import ModelSpec
from ckptconv.errors import ConversionError


def spec(heads: int = 8, kv: int = 2, layers: int = 4) -> ModelSpec:
    return ModelSpec(hidden=64, heads=heads, kv_heads=kv, head_dim=8, intermediate=96, vocab=128, layers=layers, tied=False)


def table(s: ModelSpec, layout: ParallelLayout) -> list[tuple[list[int], list[int]]]:
    return [(q_heads(s, layout, r), kv_heads(s, layout, r)) for r in range(layout.tp)]


def test_trn1_tiles_kv_and_interleaves_q():
    # q 8, kv 2, tp 4, kvm 2: G = 4, n = 2; r = i*kv + j
    assert table(spec(), ParallelLayout(tp=4, kvm=2, attention="qkv_linear")) == [
        ([0, 1], [0]),  # i0 j0
        ([4, 5], [1]),  # i0 j1
        ([2, 3], [0]),  # i1 j0
        ([6, 7], [1]),  # i1 j1
    ]


def test_trn2_runtime_puts_replicas_on_adjacent_ranks():
    assert table(spec(), ParallelLayout(tp=4, kvm=2, attention="qkv_linear", hw="trn2")) == [
        ([0, 1], [0]), ([2, 3], [0]), ([4, 5], [1]), ([6, 7], [1]),
    ]


def test_trn2_official_pairs_heads_wrongly():
    # Contiguous Q with tiled K/V: rank 1 holds Q heads 2,3 (group 0) next to K/V head 1.
    assert table(spec(), ParallelLayout(tp=4, kvm=2, attention="qkv_linear", hw="trn2", trn2_kv_layout="official")) == [
        ([0, 1], [0]), ([2, 3], [1]), ([4, 5], [0]), ([6, 7], [1]),
    ]


def test_every_q_head_meets_its_own_kv_head_except_official_trn2():
    s = spec(heads=32, kv=8)
    for hw, kv_layout, ok in (("trn1", "runtime", True), ("trn2", "runtime", True), ("trn2", "official", False)):
        layout = ParallelLayout(tp=32, kvm=4, attention="qkv_linear", hw=hw, trn2_kv_layout=kv_layout)
        paired = all(h // s.group == kv_heads(s, layout, r)[0] for r in range(32) for h in q_heads(s, layout, r))
        assert paired is ok, (hw, kv_layout)
        assert sorted(h for r in range(32) for h in q_heads(s, layout, r)) == list(range(32))


def test_tp_below_kv_is_contiguous():
    assert table(spec(kv=4), ParallelLayout(tp=2, attention="qkv_linear")) == [([0, 1, 2, 3], [0, 1]), ([4, 5, 6, 7], [2, 3])]
    assert table(spec(kv=2), ParallelLayout(tp=1, attention="qkv_linear")) == [(list(range(8)), [0, 1])]


def test_invalid_kvm_names_the_valid_value():
    with pytest.raises(ConversionError, match=r"--kv-size-multiplier 4 is invalid for tp 4 with 2 KV heads: the valid value is 2"):
        ParallelLayout(tp=4, kvm=4, attention="qkv_linear").check_model(spec())
    with pytest.raises(ConversionError, match=r"the valid value is 1"):
        ParallelLayout(tp=2, kvm=2, attention="qkv_linear").check_model(spec(kv=4))
    with pytest.raises(ConversionError, match=r"--tp 3 must divide num_attention_heads \(8\)"):
        ParallelLayout(tp=3).check_model(spec())
    with pytest.raises(ConversionError, match="needs multi-head attention"):
        ParallelLayout(tp=2, attention="coalesced").check_model(spec())
    with pytest.raises(ConversionError, match="--fuse-qkv needs --qkv-linear"):
        ParallelLayout(tp=2, fuse_qkv=True)


def test_unknown_choices_name_the_allowed_values():
    with pytest.raises(ConversionError, match=r"--hw-backend must be one of trn1, trn2; got 'trn3'"):
        ParallelLayout(tp=2, hw="trn3")
    with pytest.raises(ConversionError, match=r"attention must be one of separate, coalesced, qkv_linear; got 'fused'"):
        ParallelLayout(tp=2, attention="fused")
    with pytest.raises(ConversionError, match=r"flavour must be one of plain, xser-inline, xser-split; got 'xser'"):
        ckptconv.to_nxd("unused-src", "unused-out", flavour="xser")


def test_pipeline_split_gives_remainder_to_last_stages():
    assert stage_layer_counts(7, 3) == [2, 2, 3]
    assert stage_layer_counts(6, 4) == [1, 1, 2, 2]
    assert stage_layer_counts(4, 2) == [2, 2]
    # 6 layers, pp 2 x vpp 2: stages 0..3 on pp ranks 0,1,0,1
    assert layer_pp_ranks(6, ParallelLayout(pp=2, vpp=2)) == [0, 1, 0, 0, 1, 1]


def test_shard_names_round_trip_and_widen():
    assert shard_name(tp_rank=3, pp_rank=1) == "dp_rank_00_tp_rank_03_pp_rank_01.pt"
    assert shard_name(tp_rank=123, pp_rank=0) == "dp_rank_00_tp_rank_123_pp_rank_00.pt"
    assert parse_shard_name("dp_rank_00_tp_rank_123_pp_rank_07.pt") == (123, 7)
    assert parse_shard_name("tp_rank_01_pp_rank_02") == (1, 2)
    assert parse_shard_name("dp_rank_01_tp_rank_00_pp_rank_00.pt") is None  # a dp replica, not a model shard
    assert parse_shard_name("optim.pt") is None


def test_fused_qkv_rows_follow_head_counts_not_thirds():
    # Llama-3-70B-like ratios: q 64, kv 8, tp 32 -> per rank 2 Q heads, 1 K, 1 V: rows 2:1:1, not thirds.
    s = ModelSpec(hidden=64 * 8, heads=64, kv_heads=8, head_dim=8, intermediate=64, vocab=64, layers=1, tied=False)
    records = shard_records(s, ParallelLayout(tp=32, kvm=4, attention="qkv_linear", fuse_qkv=True), tp_rank=5, pp_rank=0)
    fused = next(r for r in records if r.key.endswith("weight_qkv"))
    assert [(seg.hf_key.rsplit(".", 2)[1], seg.length) for seg in fused.segments] == [
        ("q_proj", 16), ("k_proj", 8), ("v_proj", 8)
    ]
    # trn1, r = 5 = i*8 + j -> i 0, j 5: Q heads 40, 41 and K/V head 5
    assert [seg.start // 8 for seg in fused.segments] == [40, 5, 5]


def test_key_order_puts_renames_in_slot_and_fused_at_end():
    records = shard_records(spec(layers=2), ParallelLayout(tp=2, attention="qkv_linear", fuse_qkv=True), tp_rank=0, pp_rank=0)
    assert [r.key for r in records] == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.mlp.gate_up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.qkv_proj.weight_qkv",
        "model.layers.1.self_attn.qkv_proj.weight_qkv",
    ]


def test_tied_embedding_gives_last_stage_a_copy():
    s = ModelSpec(hidden=64, heads=8, kv_heads=2, head_dim=8, intermediate=96, vocab=128, layers=2, tied=True)
    last = shard_records(s, ParallelLayout(tp=2, pp=2), tp_rank=1, pp_rank=1)
    lm = next(r for r in last if r.key == "lm_head.weight")
    assert [(seg.hf_key, seg.start, seg.stop) for seg in lm.segments] == [("model.embed_tokens.weight", 64, 128)]


def test_module_order_puts_per_layer_inv_freq_right_after_o_proj():
    assert hf_key_order(1, with_inv_freq=True) == [
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
        "model.norm.weight",
        "lm_head.weight",
    ]
    s = ModelSpec(hidden=64, heads=8, kv_heads=2, head_dim=8, intermediate=96, vocab=128, layers=1, tied=True)
    assert list(hf_shapes(s, with_inv_freq=True)) == hf_key_order(1, with_inv_freq=True)[:-1]  # tied: no lm_head
    assert hf_shapes(s, with_inv_freq=True)["model.layers.0.self_attn.rotary_emb.inv_freq"] == (4,)


def test_separate_shard_order_with_inv_freq():
    records = shard_records(spec(layers=1), ParallelLayout(tp=2, with_inv_freq=True), tp_rank=1, pp_rank=0)
    assert [r.key for r in records] == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.rotary_emb.inv_freq",
        "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]


def test_official_tied_shards_have_no_lm_head():
    s = ModelSpec(hidden=64, heads=8, kv_heads=2, head_dim=8, intermediate=96, vocab=128, layers=2, tied=True)
    last = shard_records(s, ParallelLayout(tp=2, pp=2), tp_rank=1, pp_rank=1, lm_head_copy=False)
    assert [r.key for r in last][-3:] == ["model.layers.1.input_layernorm.weight",
                                          "model.layers.1.post_attention_layernorm.weight", "model.norm.weight"]
    assert stores_lm_head(s, ["model.norm.weight"]) is False
    assert stores_lm_head(s, ["model.norm.weight", "lm_head.weight"]) is True
    assert stores_lm_head(spec(), []) is True  # untied: lm_head is always part of the shards


def test_with_inv_freq_is_a_fact_read_not_part_of_the_layouts_identity():
    """Whether the shards hold inv_freq travels on the layout read, but ckptconv.json's layout record, equality
    and hashing (fingerprints, plan keys) are those of the sharding alone: the bytes written do not change."""
    plain, read = ParallelLayout(tp=2), ParallelLayout(tp=2, with_inv_freq=True)
    assert plain == read and hash(plain) == hash(read)
    assert read.to_json() == plain.to_json() and "with_inv_freq" not in read.to_json()
    keys = {r.key for r in shard_records(spec(layers=1), read, tp_rank=0, pp_rank=0)}
    assert keys - {r.key for r in shard_records(spec(layers=1), plain, tp_rank=0, pp_rank=0)} == {
        "model.layers.0.self_attn.rotary_emb.inv_freq"}
