"""What a model and a layout are, and how tensors map: spec, families, layout, heads, mapping, plan,
and the decoder math (reference). Pure: no files, no threads; imports nothing of ckptconv but errors.

The names below are what the trainer (nxdtrain) uses of this room: its entry point.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptconv.hall import lazy_exports

if TYPE_CHECKING:
    from ckptconv.core.human import human_bytes, human_number
    from ckptconv.core.layout import (
        HF_FILES_DIR,
        MODEL_DIR,
        Attention,
        ParallelLayout,
        default_kvm,
        layer_pp_ranks,
        layout_shard_file,
        parse_ep_shard_name,
        parse_shard_name,
        shard_file,
    )
    from ckptconv.core.layout_flags import LayoutOverrides, ResolvedLayout, apply_layout
    from ckptconv.core.mapping import (
        EMBED,
        LM_HEAD,
        ShardRecord,
        all_ep_shard_records,
        all_shard_records,
        expert_keys,
        hf_record_shape,
        hf_shapes,
        kv_heads,
        q_heads,
        shard_records,
        stores_lm_head,
    )
    from ckptconv.core.model_spec import ModelSpec
    from ckptconv.core.plan import OutTensor, Source, plan_reshard
    from ckptconv.core.reference import (
        ROPE_TYPES,
        apply_rope,
        causal_attention,
        rms_norm,
        rope_cos_sin,
        rope_inv_freq,
        rope_parameters,
        route_logits,
    )

__getattr__ = lazy_exports(__name__, __file__)
