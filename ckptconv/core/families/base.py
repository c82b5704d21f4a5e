"""What a model family is: data the converter, verify and the trainer all read.

A :class:`Family` is registered by its HF ``model_type`` (:mod:`ckptconv.core.families`). It names the
decoder-layer parameters in HF module order, one rule object each (:mod:`ckptconv.core.families.rules`), the
features its layer computes (q/k/v biases, per-head q/k norms, a sliding attention window) and the config
keys whose features are not supported (refused in one line naming the key).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ckptconv.core.families.rules import QkvRule, ReplicatedRule, Shapes
from ckptconv.errors import ConversionError

if TYPE_CHECKING:
    from ckptconv.core.families.moe import MoeConfig
    from ckptconv.core.heads import ShardRecord
    from ckptconv.core.layout import ParallelLayout
    from ckptconv.core.model_spec import ModelSpec


class LayerRule(Protocol):
    """One kind of decoder-layer parameter (see :mod:`ckptconv.core.families.rules`)."""

    @property
    def hf_names(self) -> tuple[str, ...]: ...

    def shapes(self, spec: ModelSpec) -> Shapes: ...

    def records(self, spec: ModelSpec, layout: ParallelLayout, prefix: str, rank: int) -> Iterator[ShardRecord]: ...


def _truthy(value: Any) -> bool:
    return bool(value)


@dataclass(frozen=True)
class Refusal:
    """A config key whose feature the family's NxD layout or trainer does not have."""

    key: str
    reason: str
    refused: Callable[[Any], bool] = _truthy

    def check(self, config: dict[str, Any], source: str) -> None:
        if self.key in config and self.refused(config[self.key]):
            raise ConversionError(f"{source}: {self.key} is {config[self.key]!r}; {self.reason}")


@dataclass(frozen=True)
class Family:
    """One model family: its layer's parameters (rules, HF module order) and what its attention computes.

    ``window_key``: the config key holding a sliding attention window (None or absent: full causal
    attention). ``hf_class``: the transformers class whose computation the trainer reproduces.
    """

    model_type: str
    name: str
    hf_class: str
    layer_rules: tuple[LayerRule, ...]
    refusals: tuple[Refusal, ...] = ()
    window_key: str | None = None
    # Mixture of experts: where the config states the experts, and the rules of a sparse layer (its MLP replaced by
    # the router and the experts); ``layer_rules`` are then those of the dense layers the config may have.
    moe: MoeConfig | None = None
    sparse_rules: tuple[LayerRule, ...] = ()
    no_nxd: str = ""  # why the family has no NxD layout (to-nxd, reshard and nxdtrain refuse it), if so
    # Multi-token prediction: the config key of the MTP layers after the decoder layers (``model.layers.{L + i}``: a
    # sparse layer plus ``mtp_rules``' tensors); None: the family has none.
    mtp_key: str | None = None
    mtp_rules: tuple[LayerRule, ...] = ()
    kv_heads_key: str | None = "num_key_value_heads"  # None: as many kv heads as q heads (MLA)
    head_dim_key: str = "head_dim"  # the rotated head dim (DeepSeek-V3: qk_rope_head_dim)

    def rules_for(self, config: dict[str, Any], layer: int) -> tuple[LayerRule, ...]:
        """The rules of decoder layer ``layer`` (a sparse layer's when the family has experts there)."""
        if self.moe is not None and self.moe.experts(config) and self.moe.sparse(config, layer):
            return self.sparse_rules
        return self.layer_rules

    def layer_keys_of(self, config: dict[str, Any], layer: int) -> tuple[str, ...]:
        """HF names of layer ``layer``'s tensors (without ``model.layers.N.``), in HF module order."""
        names: list[str] = []
        for rule in self.rules_for(config, layer):
            of, names_for = getattr(rule, "hf_names_of", None), getattr(rule, "hf_names_for", None)
            if names_for is not None:  # names that depend on the config (DeepSeek-V3's q form)
                names += names_for(config)
                continue
            names += of(self.moe.experts(config)) if of is not None and self.moe is not None else rule.hf_names
        return tuple(names)

    @property
    def layer_keys(self) -> tuple[str, ...]:
        """HF names of one layer's tensors (without ``model.layers.N.``), in HF module order."""
        return tuple(name for rule in self.layer_rules for name in rule.hf_names)

    @property
    def optional_layer_keys(self) -> frozenset[str]:
        return frozenset(r.name for r in self.layer_rules if isinstance(r, ReplicatedRule) and r.optional)

    @property
    def qkv_bias(self) -> bool:
        return any(isinstance(r, QkvRule) and r.bias for r in self.layer_rules)

    @property
    def qk_norm(self) -> bool:
        return "self_attn.q_norm.weight" in self.layer_keys

    def layer_shapes(self, spec: ModelSpec) -> Shapes:
        shapes: Shapes = {}
        for rule in (*self.layer_rules, *self.sparse_rules, *self.mtp_rules):
            shapes.update(rule.shapes(spec))
        return shapes

    def check_nxd(self) -> None:
        """Refuse, in one line, a family that has no NxD layout (:attr:`no_nxd` says why and where to go)."""
        if self.no_nxd:
            raise ConversionError(f"{self.name} (model_type {self.model_type!r}): {self.no_nxd}")

    def mtp_keys(self) -> tuple[str, ...]:
        """HF names of an MTP layer's own tensors (besides its decoder layer's), without ``model.layers.N.``."""
        return tuple(name for rule in self.mtp_rules for name in rule.hf_names)

    def check_config(self, config: dict[str, Any], source: str) -> None:
        for refusal in self.refusals:
            refusal.check(config, source)

    def attention_window(self, config: dict[str, Any]) -> int | None:
        """Keys a query sees, itself included (None: all earlier ones), as ``window_key`` states it."""
        value = config.get(self.window_key) if self.window_key else None
        return None if value is None else int(value)
