"""One pipeline stage of a tensor-parallel decoder (any family of ``ckptconv.core.families``) whose ``state_dict()`` is exactly one NxD shard.

Which heads, rows and layers a (tp, pp) rank holds is asked from ``ckptconv.core.mapping`` (the single
source of truth for the GQA head order); this module only builds layers of those sizes. Each
rank computes attention with its own Q heads against the K/V heads it holds, so any layout in
which every local Q head finds its K/V head locally can be trained.

Example (offline, no process group: building, loading and saving need none):

    >>> from ckptconv.core.model_spec import ModelSpec
    >>> from ckptconv.core.layout import ParallelLayout
    >>> spec = ModelSpec(hidden=64, heads=8, kv_heads=2, head_dim=8, intermediate=96, vocab=128,
    ...                  layers=4, tied=False, config={"hidden_size": 64, "num_attention_heads": 8})
    >>> layout = ParallelLayout(tp=2, pp=2, attention="qkv_linear", fuse_qkv=True)
    >>> stage = LlamaStage(spec, layout, tp=TpGroup(2, 1), pp_rank=1)
    >>> list(stage.shard_state())[-1]
    'model.layers.3.self_attn.qkv_proj.weight_qkv'
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ckptconv.core import (
    EMBED,
    LM_HEAD,
    ModelSpec,
    ParallelLayout,
    ShardRecord,
    causal_attention,
    hf_record_shape,
    hf_shapes,
    kv_heads,
    layer_pp_ranks,
    q_heads,
    rms_norm,
    shard_records,
)
from ckptconv.core import Attention as AttentionMode
from nxdtrain.errors import TrainError
from nxdtrain.model.capacity import Routing
from nxdtrain.model.moe import AuxLoss, MicroBatch, SparseMLP
from nxdtrain.model.rope import apply_rope, cos_sin, inv_freq
from nxdtrain.parallel.context import CpGroup, zigzag_positions
from nxdtrain.parallel.dist import Mesh
from nxdtrain.parallel.experts import EpGroup
from nxdtrain.parallel.grads import GradPlan
from nxdtrain.parallel.layers import (
    ColumnParallelLinear,
    GQAQKVColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    TpGroup,
    enter_tp,
)
from nxdtrain.parallel.recompute import MODES as RECOMPUTE_MODES
from nxdtrain.parallel.recompute import maybe_checkpoint
from nxdtrain.parallel.ring_attention import ring_attention


@dataclass(frozen=True)
class RankHeads:
    """Global Q and K/V head indices a tp rank holds, in shard order (K/V replicas included)."""

    q: tuple[int, ...]
    kv: tuple[int, ...]


def rank_heads(spec: ModelSpec, layout: ParallelLayout, tp_rank: int) -> RankHeads:
    """The rank's heads, from the functions ckptconv's shard records take them from."""
    return RankHeads(tuple(q_heads(spec, layout, tp_rank)), tuple(dict.fromkeys(kv_heads(spec, layout, tp_rank))))


def describe(layout: ParallelLayout) -> str:
    """``tp 2 pp 2 kvm 1 qkv_linear fused`` (the words a reshard command needs)."""
    words = f"tp {layout.tp} pp {layout.pp}" + (f" ep {layout.ep}" if layout.ep > 1 else "") + \
        f" kvm {layout.kvm} {layout.attention.value}"
    return words + (" fused" if layout.fuse_qkv else "") + (f" vpp {layout.vpp}" if layout.vpp > 1 else "")


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm, operation for operation."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))

    recompute = False  # selective checkpointing of LlamaRMSNorm (set by LlamaStage)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return maybe_checkpoint(self.recompute, rms_norm, x, self.weight, self.eps)


class _InvFreq(nn.Module):
    """Holds a shard's ``rotary_emb.inv_freq`` so it round-trips; the forward uses the config's values."""

    def __init__(self, values: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("inv_freq", values.clone())


class SelfAttention(nn.Module):
    """Causal attention of this rank's Q heads over the K/V heads it holds; o_proj sums over tp ranks.

    The projections keep the shard's names: ``q_proj``/``k_proj``/``v_proj`` (separate),
    ``qkv_proj.weight`` (coalesced) or the GQA QKV layer ``qkv_proj`` (qkv_linear).
    """

    kv_index: torch.Tensor

    def __init__(self, spec: ModelSpec, layout: ParallelLayout, tp: TpGroup, heads: RankHeads,
                 *, dtype: torch.dtype, carried_inv_freq: torch.Tensor | None, cp: CpGroup | None = None) -> None:
        super().__init__()
        self.cp = cp or CpGroup()
        hd, hidden = spec.head_dim, spec.hidden
        n, m = len(heads.q), len(heads.kv)
        self.shape = (n, m, hd)
        self.scaling = hd ** -0.5
        self.window = spec.window  # family: sliding attention window (None: full causal)
        self.separate = layout.attention is AttentionMode.SEPARATE
        bias = spec.family.qkv_bias  # family: q/k/v biases (Qwen2), split like their weight rows
        self.qkv_proj: ColumnParallelLinear | GQAQKVColumnParallelLinear  # absent with separate q/k/v
        if self.separate:
            self.q_proj = ColumnParallelLinear(hidden, n * hd, tp, dtype=dtype, bias=bias)
            self.k_proj = ColumnParallelLinear(hidden, m * hd, tp, dtype=dtype, bias=bias)
            self.v_proj = ColumnParallelLinear(hidden, m * hd, tp, dtype=dtype, bias=bias)
        elif layout.attention is AttentionMode.COALESCED:
            self.qkv_proj = ColumnParallelLinear(hidden, (n + 2 * m) * hd, tp, dtype=dtype, bias=bias)
        else:
            self.qkv_proj = GQAQKVColumnParallelLinear(hidden, n * hd, m * hd, tp, fuse=layout.fuse_qkv, dtype=dtype,
                                                       bias=bias)
        self.o_proj = RowParallelLinear(n * hd, hidden, tp, dtype=dtype)
        self.qk_norm = spec.family.qk_norm  # family: per-head q/k RMSNorm before RoPE (Qwen3), replicated
        if self.qk_norm:
            eps = float(spec.config.get("rms_norm_eps", 1e-6))
            self.q_norm, self.k_norm = RMSNorm(hd, eps, dtype), RMSNorm(hd, eps, dtype)
        if carried_inv_freq is not None:
            self.rotary_emb = _InvFreq(carried_inv_freq)
        # The K/V head each local Q head attends with (GQA: global head h uses K/V head h // group).
        missing = [h for h in heads.q if h // spec.group not in heads.kv]
        if missing:
            raise TrainError(
                f"layout {describe(layout)} ({layout.hw.value}, {layout.trn2_kv_layout.value} K/V order) puts Q head "
                f"{missing[0]} on tp rank {tp.rank} without its K/V head {missing[0] // spec.group}; reshard with "
                "ckptconv reshard --trn2-kv-layout runtime"
            )
        index = [heads.kv.index(h // spec.group) for h in heads.q]
        self.register_buffer("kv_index", torch.tensor(index), persistent=False)
        self.expand_kv = index != list(range(m))
        self.recompute_core = False  # selective activation checkpointing (set by LlamaStage)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.separate:  # one tp region for the shared input: one gradient all-reduce, not three
            x = enter_tp(x, self.q_proj.tp)
            return self.q_proj.project(x), self.k_proj.project(x), self.v_proj.project(x)
        qkv = self.qkv_proj(x)
        if isinstance(qkv, tuple):  # the GQA QKV layer
            return qkv
        n, m, hd = self.shape  # coalesced: one weight, rows q | k | v
        q, k, v = qkv.split((n * hd, m * hd, m * hd), dim=-1)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, m, hd = self.shape
        q, k, v = self._project(x)
        batch, seq = q.shape[:2]  # the whole sequence, also when x is a sequence-parallel slice
        q = q.view(batch, seq, n, hd).transpose(1, 2)
        k = k.view(batch, seq, m, hd).transpose(1, 2)
        v = v.view(batch, seq, m, hd).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, cos, sin)
        out = maybe_checkpoint(self.recompute_core, self._core, q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, n * hd))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(QKᵀ)V: what selective checkpointing recomputes (ring attention over the cp ranks)."""
        if self.cp.size > 1:
            return ring_attention(q, k, v, self.cp, scale=self.scaling, kv_index=self.kv_index if self.expand_kv else None)
        if self.expand_kv:
            k, v = k.index_select(1, self.kv_index), v.index_select(1, self.kv_index)
        return causal_attention(q, k, v, scale=self.scaling, window=self.window)

    def kv_rows(self) -> list[tuple[nn.Parameter, slice]]:
        """(parameter, rows) that hold K/V heads (the rows that may be replicated on other tp ranks)."""
        n, m, hd = self.shape
        if self.separate:
            layers, rows = [self.k_proj, self.v_proj], slice(0, m * hd)
        elif isinstance(self.qkv_proj, GQAQKVColumnParallelLinear):
            return self.qkv_proj.kv_rows()
        else:
            layers, rows = [self.qkv_proj], slice(n * hd, (n + 2 * m) * hd)
        return [(p, rows) for layer in layers for p in (layer.weight, layer.bias) if p is not None]


class MLP(nn.Module):
    """SiLU-gated MLP with NxD's fused ``gate_up_proj`` (rows: this rank's gate rows, then its up rows)."""

    def __init__(self, spec: ModelSpec, tp: TpGroup, *, dtype: torch.dtype) -> None:
        super().__init__()
        local = spec.intermediate // tp.size
        self.gate_up_proj = ColumnParallelLinear(spec.hidden, 2 * local, tp, dtype=dtype)
        self.down_proj = RowParallelLinear(local, spec.hidden, tp, dtype=dtype)

    recompute = False  # selective checkpointing of NxDT's LlamaMLP: the whole MLP (set by LlamaStage)
    recompute_act = False  # of NxDT's ActivationMultiplyMLP: act(gate) x up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return maybe_checkpoint(self.recompute, self._mlp, x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(maybe_checkpoint(self.recompute_act, _act_multiply, self.gate_up_proj(x)))


def _act_multiply(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layout: ParallelLayout, tp: TpGroup, heads: RankHeads, *,
                 eps: float, dtype: torch.dtype, carried_inv_freq: torch.Tensor | None, cp: CpGroup,
                 layer: int = 0, ep: EpGroup | None = None, routing: Routing | None = None) -> None:
        super().__init__()
        self.self_attn = SelfAttention(spec, layout, tp, heads, dtype=dtype, carried_inv_freq=carried_inv_freq, cp=cp)
        self.mlp: MLP | SparseMLP = (SparseMLP(spec, layer, tp, ep or EpGroup(), dtype=dtype, routing=routing)
                                     if spec.sparse(layer) else MLP(spec, tp, dtype=dtype))
        self.input_layernorm = RMSNorm(spec.hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden, eps, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, aux: AuxLoss | None = None,
                batch: MicroBatch | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, aux, batch) if isinstance(self.mlp, SparseMLP) else self.mlp(h))


class _Body(nn.Module):
    """The ``model.`` prefix of the keys: embedding (first stage), layers by global index, norm (last stage)."""

    embed_tokens: ParallelEmbedding
    layers: nn.ModuleDict
    norm: RMSNorm


def _check_arch(config: dict[str, object]) -> float:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise TrainError(f"config.json: hidden_act {act!r} is not supported (Llama uses 'silu')")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise TrainError(f"config.json: {flag} is true; biases are not part of the NxD Llama layout")
    return float(config.get("rms_norm_eps", 1e-6))  # type: ignore[arg-type]


class LlamaStage(nn.Module):
    """The layers of pipeline rank ``pp_rank`` for tensor-parallel rank ``tp.rank``.

    Input: token ids (first stage) or hidden states; output: hidden states, or on the last stage
    this rank's vocabulary slice of the logits. Layers keep their global numbers. With
    ``tp.sequence_parallel`` the hidden states in and out are this tp rank's sequence slice
    ``[batch, seq/tp, hidden]``; ``recompute`` is the activation checkpointing mode. With context
    parallelism (``cp.size > 1``) the sequence is this cp rank's zigzag chunks
    (:mod:`nxdtrain.parallel.context`): RoPE takes their global positions, attention is the ring.
    """

    rope_inv_freq: torch.Tensor
    lm_head: ColumnParallelLinear
    vocab_padding: torch.Tensor | None

    def __init__(self, spec: ModelSpec, layout: ParallelLayout, *, tp: TpGroup, pp_rank: int,
                 with_inv_freq: bool = False, dtype: torch.dtype = torch.float32, recompute: str = "none",
                 cp: CpGroup | None = None, recompute_modules: tuple[str, ...] = ("CoreAttention",),
                 ep: EpGroup | None = None, aux: AuxLoss | None = None, routing: Routing | None = None) -> None:
        super().__init__()
        self.cp = cp = cp or CpGroup()
        self.ep = ep = ep or EpGroup()
        self.aux = aux  # MoE families: the router's aux loss (nxdtrain.model.moe)
        # pp > 1: the aux loss's counts travel between the stages with the activations (a second output)
        self.carries = aux is not None and bool(aux.coef) and layout.pp > 1
        assert recompute in RECOMPUTE_MODES, recompute
        self.recompute = recompute
        if layout.vpp != 1:
            raise TrainError(f"layout {describe(layout)}: virtual pipeline stages are not supported by nxdtrain; "
                             "reshard with ckptconv reshard --vpp 1")
        assert tp.size == layout.tp, (tp, layout)
        # the run's layout, its shards holding inv_freq as the source's did
        self.spec, self.layout, self.tp, self.pp_rank = spec, replace(layout, with_inv_freq=with_inv_freq), tp, pp_rank
        self.with_inv_freq = with_inv_freq
        self.is_first, self.is_last = pp_rank == 0, pp_rank == layout.pp - 1
        eps = _check_arch(spec.config)
        self.register_buffer("rope_inv_freq", inv_freq(spec.config, spec.head_dim), persistent=False)
        heads = rank_heads(spec, layout, tp.rank)
        carried = self.rope_inv_freq if with_inv_freq else None
        self.layer_ids = [i for i, owner in enumerate(layer_pp_ranks(spec.layers, layout)) if owner == pp_rank]
        self.model = _Body()
        vocab_local = layout.vocab_rows(spec) // tp.size  # padded to a multiple of tp: zero rows, masked logits
        if self.is_first:
            self.model.embed_tokens = ParallelEmbedding(vocab_local, spec.hidden, tp, dtype=dtype)
        self.model.layers = nn.ModuleDict({
            str(i): DecoderLayer(spec, layout, tp, heads, eps=eps, dtype=dtype, carried_inv_freq=carried, cp=cp,
                                 layer=i, ep=ep, routing=routing)
            for i in self.layer_ids
        })
        if self.is_last:
            self.model.norm = RMSNorm(spec.hidden, eps, dtype)
            self.lm_head = ColumnParallelLinear(spec.hidden, vocab_local, tp, dtype=dtype)
            padding = torch.arange(tp.rank * vocab_local, (tp.rank + 1) * vocab_local) >= spec.vocab
            self.register_buffer("vocab_padding", padding if bool(padding.any()) else None, persistent=False)
        self._check_matches_shard()
        self._set_recompute(recompute_modules if recompute == "selective" else ())

    def _set_recompute(self, modules: tuple[str, ...]) -> None:
        """Selective checkpointing of NxDT's modules (nxdtrain.parallel.recompute) on this stage's modules."""
        if "LlamaDecoderLayer" in modules:
            self.recompute = "full"
        for module in self.modules():
            if isinstance(module, SelfAttention):
                module.recompute_core = "CoreAttention" in modules
            elif isinstance(module, MLP):
                module.recompute, module.recompute_act = "LlamaMLP" in modules, "ActivationMultiplyMLP" in modules
            elif isinstance(module, RMSNorm):
                module.recompute = "LlamaRMSNorm" in modules

    def records(self) -> list[ShardRecord]:
        """The stage's tensors: those of ep rank 0's shard, with this ep rank's experts (NxD keeps every other
        tensor only in ep rank 0's files)."""
        mine = {r.key: r for r in self.file_records()}
        if self.ep.rank == 0:
            return list(mine.values())
        return [mine.get(r.key, r) for r in shard_records(self.spec, self.layout, tp_rank=self.tp.rank,
                                                          pp_rank=self.pp_rank)]

    def file_records(self) -> list[ShardRecord]:
        """What this rank's shard file holds (at ep rank > 0: its experts only)."""
        return shard_records(self.spec, self.layout, tp_rank=self.tp.rank, pp_rank=self.pp_rank, ep_rank=self.ep.rank)

    def _check_matches_shard(self) -> None:
        shapes = hf_shapes(self.spec, with_inv_freq=self.with_inv_freq)
        expected = {r.key: hf_record_shape(r, shapes[r.segments[0].hf_key]) for r in self.records()}
        actual = {k: tuple(v.shape) for k, v in self.state_dict().items()}
        assert actual == expected, f"stage keys/shapes differ from the shard: {set(actual.items()) ^ set(expected.items())}"

    def forward(self, x: torch.Tensor, carried: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``carried`` (pp > 1, MoE with the aux loss; zeros on the first stage): the micro-batch's router counts of
        the stages before, returned with this stage's added as a second output."""
        h = self.model.embed_tokens(x) if self.is_first else x
        seq = h.shape[1] * (self.tp.size if self.tp.sequence_parallel else 1)  # h: this rank's slice with SP
        positions = zigzag_positions(seq * self.cp.size, self.cp, h.device) if self.cp.size > 1 else None
        cos, sin = cos_sin(self.rope_inv_freq, seq, h.dtype, positions=positions)
        batch = self.aux.next() if self.aux is not None else None  # this micro-batch's router statistics
        if self.carries and batch is not None:
            batch.carried = torch.zeros(self.spec.experts, device=h.device) if carried is None else carried
        for layer in self.model.layers.values():
            h = maybe_checkpoint(self.recompute == "full", layer, h, cos, sin, self.aux, batch)
        if self.is_last:
            h = self.lm_head(self.model.norm(h))
            if self.vocab_padding is not None:  # padding rows never win the softmax (and get no gradient)
                h = h.masked_fill(self.vocab_padding, torch.finfo(h.dtype).min)
        if self.carries and batch is not None and batch.carried is not None:
            counts, batch.carried = batch.carried.view_as(batch.carried), None  # a view: an input is not an output
            return h, counts
        return h

    # ------------------------------------------------------------------ shard I/O

    def shard_state(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """This rank's shard: keys in ckptconv's file order, o_proj column-major where the format stores it so.
        ``state``: these tensors instead of the parameters' (whole ones gathered from an FSDP-sharded stage)."""
        state = self.state_dict() if state is None else state
        out = {}
        for record in self.file_records():
            t = state[record.key].detach()
            out[record.key] = t.t().contiguous().t() if record.column_major else t
        return out

    def load_shard_state(self, state: dict[str, torch.Tensor], source: str) -> None:
        """Copy a shard's tensors in (any dtype; cast to the parameters'); keys and shapes must match exactly."""
        own = self.state_dict()
        missing = [k for k in own if k not in state]
        extra = [k for k in state if k not in own]
        if missing or extra:
            what = f"missing {missing[0]!r}" if missing else f"unexpected {extra[0]!r}"
            raise TrainError(f"{source}: {what} for layout {describe(self.layout)}; reshard the checkpoint")
        for key, value in state.items():
            if tuple(value.shape) != tuple(own[key].shape):
                raise TrainError(f"{source}: {key!r} has shape {list(value.shape)}, layout {describe(self.layout)} "
                                 f"needs {list(own[key].shape)}")
        self.load_state_dict({k: v.contiguous() for k, v in state.items()}, strict=True)

    # ------------------------------------------------------------------ what the trainer must know

    def attention_layers(self) -> Iterator[SelfAttention]:
        for layer in self.model.layers.values():
            assert isinstance(layer, DecoderLayer)
            yield layer.self_attn

    def tp_replicated(self) -> list[str]:
        """Parameters every tp rank holds whole (norm weights, per-head q/k norms and MoE routers included)."""
        return [name for name, _ in self.named_parameters() if name.endswith(("norm.weight", "linear_router.weight"))]

    def expert_params(self) -> list[str]:
        """This ep rank's experts: summed over expert-data-parallel ranks, not over dp."""
        return [name for name, _ in self.named_parameters() if ".expert_mlps." in name]

    def tp_partial(self) -> list[str]:
        """Replicated parameters whose gradient each tp rank holds only its heads' part of (per-head q/k norms:
        summed over tp)."""
        return [name for name, _ in self.named_parameters() if name.endswith(("q_norm.weight", "k_norm.weight"))]


# Which gradients a rank sums with whom: the parallel.grads.GradPlan of one stage in a run's process groups
# (dp x cp, K/V replicas, sequence-parallel norms, the tied embedding, MoE's expert groups).


def grad_plan(model: LlamaStage, mesh: Mesh, spec: ModelSpec, layout: ParallelLayout,
              experts: tuple[Any, Any] | None = None) -> GradPlan:
    """Who sums which gradients with whom (see nxdtrain.parallel.grads) for ``model``, this rank's stage of the
    run's ``layout``; ``experts``: MoE's (ep, expert-data-parallel) groups. Collective: every rank calls it."""
    tp_rank = mesh.coords.tp
    # Gradients are summed over dp x cp: the cp ranks of a replica each hold their chunks' share.
    out = GradPlan(dp_group=mesh.dpcp_group, mp_group=mesh.mp_group)
    names = {id(p): n for n, p in model.named_parameters()}
    if model.tp.sequence_parallel and mesh.tp_group is not None:  # norm weights saw only their sequence slice
        out.seq_group, out.seq_names = mesh.tp_group, tuple(model.tp_replicated())
    elif model.tp_partial() and mesh.tp_group is not None:  # per-head q/k norms saw only this rank's heads
        out.seq_group, out.seq_names = mesh.tp_group, tuple(model.tp_partial())
    if tp_rank != 0:
        out.uncounted.update({name: [] for name in model.tp_replicated()})
    # Ranks holding the same K/V heads form a replica group (kv_size_multiplier > 1).
    replicas: dict[tuple[int, ...], list[int]] = {}
    for rank in range(layout.tp):
        replicas.setdefault(rank_heads(spec, layout, rank).kv, []).append(rank)
    partition = list(replicas.values())
    if any(len(part) > 1 for part in partition):
        out.kv_group = mesh.tp_subgroups(partition)
        out.kv_rows = [(names[id(p)], rows) for attn in model.attention_layers() for p, rows in attn.kv_rows()]
        if next(part for part in partition if tp_rank in part)[0] != tp_rank:
            for name, rows in out.kv_rows:
                out.uncounted.setdefault(name, []).append(rows)
    if experts is not None:  # MoE: each ep rank's experts are summed over the ranks holding the same ones
        out.expert_names, (out.ep_group, out.edp_group) = tuple(model.expert_params()), experts
    if spec.tied:
        out.tied_group = mesh.first_last_stage_group()
        out.tied_names = tuple(n for n in (EMBED, LM_HEAD) if n in names.values())
        if LM_HEAD in out.tied_names:
            out.uncounted[LM_HEAD] = []
    return out
