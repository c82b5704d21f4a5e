"""The parallel layout of an NxD checkpoint: tp/pp/vpp/kvm, attention mode, hardware head order.

Also the two facts every reader and writer shares: which layers live on which pipeline rank,
and what a shard file is called.

Example:
    >>> layout = ParallelLayout(tp=2, pp=2, vpp=2)
    >>> stage_layer_counts(6, 4)
    [1, 1, 2, 2]
    >>> shard_name(tp_rank=1, pp_rank=0)
    'dp_rank_00_tp_rank_01_pp_rank_00.pt'
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

from ckptconv.errors import ConversionError, choice

if TYPE_CHECKING:
    from ckptconv.core.model_spec import ModelSpec


# Each layout field's native flag, the one table: check_model's default names, and LayoutOverrides' native names
# (ckptconv.core.layout_flags).
NATIVE_FLAGS = {"tp": "--tp", "pp": "--pp", "ep": "--ep", "vpp": "--vpp", "kvm": "--kv-size-multiplier",
                "fuse_qkv": "--fuse-qkv", "hw": "--hw-backend", "trn2_kv_layout": "--trn2-kv-layout"}


class Attention(str, Enum):
    """How q/k/v are stored in a shard (docs/nxd-format.md §3, "Attention modes")."""

    SEPARATE = "separate"      # q_proj / k_proj / v_proj, row chunks
    COALESCED = "coalesced"    # qkv_proj.weight = cat(q_r, k_r, v_r), MHA only
    QKV_LINEAR = "qkv_linear"  # GQAQKVColumnParallelLinear: weight_q / weight_k / weight_v (or weight_qkv)


class Hardware(str, Enum):
    TRN1 = "trn1"
    TRN2 = "trn2"


class Trn2KvLayout(str, Enum):
    RUNTIME = "runtime"    # K/V replicas on adjacent ranks: what the NxD trn2 runtime computes with
    OFFICIAL = "official"  # tiled replicas, as the official converter writes them (pairs heads wrongly)


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Everything about the sharding that is not a property of the model."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    kvm: int = 1
    attention: Attention = Attention.SEPARATE
    fuse_qkv: bool = False
    hw: Hardware = Hardware.TRN1
    trn2_kv_layout: Trn2KvLayout = Trn2KvLayout.RUNTIME
    # Rows of the embedding and lm_head in the shards when they exceed vocab_size: zero rows, never predicted
    # (None: vocab_size rounded up to a multiple of tp). Another tool's padding (NxDT: to 128 x tp) is read as stored.
    padded_vocab: int | None = None
    ep: int = 1  # expert-parallel degree (MoE families): each ep rank holds a contiguous block of E / ep experts
    # Whether the shards hold rotary_emb.inv_freq: a fact of the shards read (or of the HF state written), not of
    # the parallelism, so neither recorded (to_json) nor part of a layout's identity (equality, fingerprints).
    with_inv_freq: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", choice(Attention, self.attention, "attention"))
        object.__setattr__(self, "hw", choice(Hardware, self.hw, "--hw-backend"))
        object.__setattr__(self, "trn2_kv_layout", choice(Trn2KvLayout, self.trn2_kv_layout, "--trn2-kv-layout"))
        for name in ("tp", "pp", "vpp", "kvm", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConversionError(f"--{name.replace('kvm', 'kv-size-multiplier')} must be an integer >= 1, got {value!r}")
        if self.padded_vocab is not None and (type(self.padded_vocab) is not int or self.padded_vocab < 1):
            raise ConversionError(f"padded_vocab must be a positive integer, got {self.padded_vocab!r}")
        if self.fuse_qkv and self.attention is not Attention.QKV_LINEAR:
            raise ConversionError("--fuse-qkv needs --qkv-linear (fused weight_qkv exists only on the qkv_linear path)")
        if self.kvm > 1 and self.attention is not Attention.QKV_LINEAR:
            raise ConversionError(
                f"--kv-size-multiplier {self.kvm} needs --qkv-linear (K/V replication exists only on the qkv_linear path)"
            )

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    def check_model(self, spec: ModelSpec, *, name: Callable[[str], str] | None = None) -> None:
        """Reject every combination the shards cannot represent, naming the valid values.

        ``name(field)``: how an error names a value (default: as a flag, ``--tp 4``); a caller that knows
        which values the user did not give names them otherwise (``the source's tp 2``)."""
        spec.family.check_nxd()  # a family without an NxD layout (DeepSeek-V3, GPT-OSS) is refused before any layout value
        n = name or self._as_flag
        divisible = [("num_attention_heads", spec.heads)]
        if spec.dense_mlp_layers:
            divisible.append(("intermediate_size", spec.intermediate))
        if spec.experts:
            divisible.append((spec.family.moe.intermediate_key if spec.family.moe else "", spec.expert_intermediate))
        for what, value in divisible:
            if value % self.tp:
                raise ConversionError(f"{n('tp')} must divide {what} ({value})")
        self._check_experts(spec, n)
        rows = self.vocab_rows(spec)
        if rows % self.tp or rows < spec.vocab:
            raise ConversionError(f"padded vocabulary of {rows} rows: must be a multiple of {n('tp')} and at "
                                  f"least vocab_size ({spec.vocab})")
        if spec.layers < self.stages:
            raise ConversionError(
                f"{n('pp')} x {n('vpp')} = {self.stages} stages, but the model has only {spec.layers} layers"
            )
        if self.attention is Attention.SEPARATE:
            # Each rank must hold whole K/V heads, or its attention cannot be computed locally.
            if spec.kv_heads % self.tp:
                raise ConversionError(
                    f"{n('tp')} must divide num_key_value_heads ({spec.kv_heads}) for separate q/k/v; "
                    f"use --qkv-linear --kv-size-multiplier {max(1, self.tp // spec.kv_heads)} for tp > kv heads"
                )
        elif self.attention is Attention.COALESCED:
            if spec.kv_heads != spec.heads:
                raise ConversionError(
                    f"{n('attention')} needs multi-head attention (num_key_value_heads == num_attention_heads), "
                    f"got {spec.kv_heads} != {spec.heads}; use --qkv-linear for GQA"
                )
        else:
            self._check_kv_replication(spec, n)

    def _check_experts(self, spec: ModelSpec, n: Callable[[str], str]) -> None:
        if self.ep == 1:
            return
        if not spec.experts:
            raise ConversionError(f"{n('ep')}: a {spec.family.name} model has no experts (expert parallelism needs a "
                                  "mixture-of-experts model)")
        if spec.experts % self.ep:
            raise ConversionError(f"{n('ep')} must divide the number of experts ({spec.experts})")

    def _as_flag(self, key: str) -> str:
        value = getattr(self, key)
        if key == "attention":
            return {Attention.COALESCED: "--coalesce-qkv", Attention.QKV_LINEAR: "--qkv-linear"}.get(
                value, "--no-qkv-linear")
        return f"{NATIVE_FLAGS.get(key, '--' + key)} {getattr(value, 'value', value)}"

    def vocab_rows(self, spec: ModelSpec) -> int:
        """Rows of the embedding (and lm_head) over all tp ranks: vocab_size, padded to a multiple of tp."""
        if self.padded_vocab is not None:
            return self.padded_vocab
        return -(-spec.vocab // self.tp) * self.tp

    def padded_for(self, spec: ModelSpec) -> ParallelLayout:
        """This layout with its vocabulary padding spelled out when there is any (so ckptconv.json records it)."""
        rows = self.vocab_rows(spec)
        return replace(self, padded_vocab=rows if rows != spec.vocab else None)

    def _check_kv_replication(self, spec: ModelSpec, n: Callable[[str], str]) -> None:
        kv, tp, kvm = spec.kv_heads, self.tp, self.kvm
        if tp <= kv:
            if kv % tp:
                raise ConversionError(f"{n('tp')} must divide num_key_value_heads ({kv})")
            if kvm != 1:
                raise ConversionError(
                    f"{n('kvm')} is invalid for tp {tp} <= {kv} KV heads; the valid value is 1"
                )
            return
        if tp % kv:
            raise ConversionError(f"{n('tp')} must be a multiple of num_key_value_heads ({kv}) when tp > kv heads")
        if kv * kvm != tp:
            raise ConversionError(
                f"{n('kvm')} is invalid for tp {tp} with {kv} KV heads: "
                f"the valid value is {tp // kv} (tp / kv heads)"
            )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["with_inv_freq"]  # what was read, not how it is sharded
        if data["padded_vocab"] is None:  # unpadded layouts are recorded as before
            del data["padded_vocab"]
        if data["ep"] == 1:  # so are layouts without expert parallelism
            del data["ep"]
        for key, value in data.items():
            if isinstance(value, Enum):
                data[key] = value.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ParallelLayout:
        return cls(**data)


def stage_layer_counts(layers: int, stages: int) -> list[int]:
    """Layers per pipeline stage: an even split, the remainder one each to the *last* stages."""
    base, extra = divmod(layers, stages)
    return [base + (1 if s >= stages - extra else 0) for s in range(stages)]


def layer_stages(layers: int, stages: int) -> list[int]:
    """The pipeline stage of every layer."""
    out: list[int] = []
    for stage, count in enumerate(stage_layer_counts(layers, stages)):
        out.extend([stage] * count)
    return out


def layer_pp_ranks(layers: int, layout: ParallelLayout) -> list[int]:
    """The pp rank of every layer (stage s lives on pp rank s mod pp)."""
    return [stage % layout.pp for stage in layer_stages(layers, layout.stages)]


MODEL_DIR = "model"  # the shards' directory inside a checkpoint (or training tag)
HF_FILES_DIR = "hf"  # config.json, tokenizer and generation files kept beside the shards


def default_kvm(tp: int, kv_heads: int, attention: Attention) -> int:
    """The kv_size_multiplier a layout needs when none is given: a fused QKV layer replicates its K/V heads over
    tp / kv_heads ranks when tp exceeds them; every other layout has none."""
    return tp // kv_heads if attention is Attention.QKV_LINEAR and tp > kv_heads else 1


def shard_name(*, tp_rank: int, pp_rank: int, dp_rank: int = 0, ep_rank: int | None = None) -> str:
    """File name of one model shard; ``{:02d}`` widens by itself past 99. With ``ep_rank`` (a layout with ep > 1),
    NxD's expert-parallel name ``dp_rank_00_ep_rank_XX_tp_rank_YY_pp_rank_ZZ.pt``.

        >>> shard_name(tp_rank=1, pp_rank=0, ep_rank=1)
        'dp_rank_00_ep_rank_01_tp_rank_01_pp_rank_00.pt'
    """
    ep = "" if ep_rank is None else f"_ep_rank_{ep_rank:02d}"
    return f"dp_rank_{dp_rank:02d}{ep}_tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}.pt"


def shard_file(*, tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
    """A model shard's path relative to the checkpoint root: ``model/dp_rank_00_…pt``."""
    return f"{MODEL_DIR}/{shard_name(tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank)}"


class ShardId(NamedTuple):
    """Which model shard a planned file is, (ep, tp, pp) ranks: a value the plan that names the file carries
    (:attr:`ckptconv.core.plan.OutFile.shard`), so no rank is parsed back out of a file name inside the program;
    names are parsed only where a directory is read."""

    ep: int
    tp: int
    pp: int


def layout_shard_file(layout: ParallelLayout, *, ep_rank: int, tp_rank: int, pp_rank: int) -> str:
    """Shard (ep_rank, tp_rank, pp_rank) of ``layout``: the ep-rank form of the name only when ep > 1 (as NxD)."""
    return shard_file(tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank if layout.ep > 1 else None)


_SHARD_RE = re.compile(r"^dp_rank_(\d+)(?:_ep_rank_(\d+))?_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")
_LEGACY_RE = re.compile(r"^tp_rank_(\d+)_pp_rank_(\d+)$")


def parse_rank_file(name: str) -> tuple[int, int, int] | None:
    """``(dp_rank, tp_rank, pp_rank)`` of a ``dp_rank_XX_tp_rank_YY_pp_rank_ZZ.pt`` name (NxD's ZeRO-1
    optimizer files carry the real dp rank); None for any other name, expert-parallel ones included."""
    m = _SHARD_RE.match(name)
    if m is None or m.group(2) is not None:
        return None
    return int(m.group(1)), int(m.group(3)), int(m.group(4))


def parse_ep_shard_name(name: str) -> tuple[int, int, int] | None:
    """``(ep_rank, tp_rank, pp_rank)`` of an expert-parallel shard name (``dp_rank_00_ep_rank_XX_…``), else None."""
    m = _SHARD_RE.match(name)
    if m is None or m.group(2) is None or int(m.group(1)) != 0:
        return None
    return int(m.group(2)), int(m.group(3)), int(m.group(4))


def parse_shard_name(name: str) -> tuple[int, int] | None:
    """``(tp_rank, pp_rank)`` of a shard file name (current or legacy directory name), else None."""
    m = _SHARD_RE.match(name)
    if m:
        if m.group(2) not in (None, "00", "0") or int(m.group(1)) != 0:
            return None
        return int(m.group(3)), int(m.group(4))
    m = _LEGACY_RE.match(name)
    if m:
        return int(m.group(1)), int(m.group(2))
    return None
