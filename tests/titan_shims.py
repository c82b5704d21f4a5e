"""CPU shims the TorchTitan lane needs around TorchTitan 0.3.0 (test harness only; never in the product).

* ``sdpa_attention(model_config)``: TorchTitan's language models take FlexAttention (``attn_backend`` flex), which
  compiles for ~40 s per shape on CPU and has no CPU backward; the lane swaps each layer's inner attention for
  TorchTitan's own ``ScaledDotProductAttention`` module (causal), which computes the same attention for one
  document per row. The checkpoint layout and every other module are TorchTitan's as configured.
"""

from __future__ import annotations

from typing import Any


def sdpa_attention(model_config: Any) -> Any:
    """``model_config`` with every layer's inner attention TorchTitan's SDPA module (in place; returned)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return model_config
