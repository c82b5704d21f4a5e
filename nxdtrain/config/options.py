"""One typed config tree for a training run; YAML (ours or NxDT-shaped) and CLI flags fill it.

Every leaf field is one CLI flag and one flat YAML key of the same name (``seq_len`` is
``--seq-len`` and ``seq_len:``). A field's ``help`` metadata is its ``--help``, its ``group`` the section of
``nxdtrain run --help`` it is listed in (:data:`GROUPS`). Precedence: defaults < YAML < flags. ``--resume`` and
``--data`` have no default (random tokens are ``--data synthetic``, never the absence of ``--data``).

Example:
    >>> cfg = TrainConfig.from_flat({"resume": "/fsx/llama-nxd", "data": "synthetic", "tp": 2, "lr": 3e-4})
    >>> cfg.parallel.tp, cfg.optim.lr, cfg.data.gbs
    (2, 0.0003, 8)
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ckptconv.engine import NXD_PARAM_GROUPS
from ckptconv.training import NXDT_SCHEDULES
from nxdtrain.config.checks import flag, is_int, sharding_limits, xla_refusal
from nxdtrain.device import DEVICES, xla_limits
from nxdtrain.errors import TrainError

OPTIMIZER_FORMATS = ("nxdtrain", "nxd")  # what a save writes in optim/ (ckptconv.training.nxd_format.write: nxd)
NXD_SCHEDULE = NXDT_SCHEDULES[0]  # CosineAnnealing: the schedule NxD's scheduler.pt can hold (nxd_trainer_files.COSINE)
OPTIMIZERS = ("adamw", "sgd")
# Ours, then NxDT's by their class names (NeMo's CosineAnnealing, NxDT's LinearAnnealingWithWarmUp; ckptconv.training.nxdt_lr)
SCHEDULES = ("cosine", "linear", "constant", "CosineAnnealing", "LinearAnnealingWithWarmUp")
NXDT_SCHEDULES = SCHEDULES[3:]
PRECISIONS = ("auto", "fp32", "bf16")
PP_SCHEDULES = ("1f1b", "gpipe")
AUX_SCALES = ("transformers", "nxd")  # MoE aux loss: x E (transformers) or x E / top_k (NxD's loss_function.py)
MIN_LR_FRACTION = 0.1  # --min-lr default, as a fraction of --lr (NxDT's examples decay to a tenth too)
RECOMPUTE = ("none", "selective", "full")  # activation checkpointing modes (nxdtrain.parallel.recompute)
# What --activation-checkpointing selective recomputes, by NxDT's module names (nxdtrain.parallel.recompute)
RECOMPUTE_MODULES = ("CoreAttention", "LlamaMLP", "ActivationMultiplyMLP", "LlamaRMSNorm", "LlamaDecoderLayer")
LONG_ROWS = ("cut", "split", "error")  # rows longer than --seq-len (nxdtrain.data.check)
AUTO = "auto"  # --resume auto
SYNTHETIC = "synthetic"  # --data synthetic: random tokens
DATA_SPEC = ("a save_to_disk dataset dir, a .jsonl/.json(.gz) file, or a directory or glob of those (an NxDT YAML's "
             "data.train_dir)")


# The sections of ``nxdtrain run --help``, in order: title -> what the section is for and what in it is required.
# Each field names its section (``option(group=...)``); the flags are grouped by job, not by config class.
GROUPS: dict[str, str] = {
    "model and layout": "where the weights come from and how this run splits them. Required: --resume (with "
                        "--resume auto also --checkpoint-dir, and --init while that holds no completed tag). A "
                        "source saved at another tp/pp/kv layout is resharded on load",
    "data": "the rows and their batches. Required: --data PATH, or --data synthetic for random tokens",
    "optimizer and schedule": "how long to train, the optimizer, the learning-rate schedule and clipping",
    "parallelism": "the splits beyond --tp/--pp (world = dp x tp x pp x context parallel) and memory savers",
    "checkpoints": "what the run saves. Required: --checkpoint-dir DIR, or --no-checkpoint to save nothing",
    "logging": "what the run reports while it trains",
    "device and launch": "where the run trains, in what precision, and how its processes start",
}
# What every run needs, as the usage line of nxdtrain run says it (the fields with required=True).
REQUIRED_USAGE = "--resume PATH|auto --data PATH|synthetic (--checkpoint-dir DIR | --no-checkpoint)"


def option(default: Any, help: str, *, group: str, aliases: tuple[str, ...] = (),
           choices: tuple[str, ...] | None = None, path: bool = False, required: bool = False) -> Any:
    """A config field that is also a CLI flag ``--name-with-dashes`` (booleans also get ``--no-name``).

    ``group``: its section of ``nxdtrain run --help`` (a key of :data:`GROUPS`). ``path``: a file or directory;
    ``~`` and ``$VARS`` in its value are expanded (YAML and flags alike). ``required``: a run needs it (checked
    in ``__post_init__``, where the message says what to give); listed first in its section.
    """
    if group not in GROUPS:
        raise ValueError(f"option group {group!r} is none of {', '.join(GROUPS)}")
    return field(default=default, metadata={"help": help, "aliases": aliases, "choices": choices, "path": path,
                                            "group": group, "required": required})


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise TrainError(message)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the model is split: tp x pp (a source of another layout is resharded on load), context parallel, and
    dp = world / (tp·pp·cp)."""

    tp: int | None = option(None, "tensor-parallel degree of this run (not given: the shards'); a --resume saved at "
                                  "another tp is resharded on load, each rank reading its slices",
                            group="model and layout")
    pp: int | None = option(None, "pipeline-parallel degree of this run (not given: the shards'); a --resume saved at "
                                  "another pp is resharded on load, each rank reading its slices",
                            group="model and layout")
    kv_replicator: int | None = option(None, "K/V head replication (kv_size_multiplier); default: the shards' at "
                                       "their tp and attention, else what tp needs (tp / kv heads when tp exceeds "
                                       "them)",
                                       aliases=("--kv-size-multiplier",), group="model and layout")
    qkv_linear: bool | None = option(None, "GQA QKV layer (weight_q/k/v or weight_qkv); default: the shards'",
                                     group="model and layout")
    fuse_qkv: bool | None = option(None, "fused weight_qkv (needs qkv_linear); default: the shards'",
                                   group="model and layout")
    pp_schedule: str = option("1f1b", "pipeline schedule", choices=PP_SCHEDULES, group="parallelism")
    zero1: bool = option(False, "shard the optimizer state over data-parallel ranks (ZeRO-1)", group="parallelism")
    shard_params: bool = option(False, "shard parameters, gradients and optimizer state over all data-parallel "
                                       "ranks with torch's FSDP2 (fully_shard); tags still hold whole per-tp-rank "
                                       "shards", group="parallelism")
    hybrid_shard: int | None = option(None, "shard as --shard-params over groups of N data-parallel ranks, "
                                            "replicated across dp / N groups (FSDP2 hybrid sharding; SMP's "
                                            "hybrid_shard_degree); N = dp is --shard-params", group="parallelism")
    offload_activations: bool = option(False, "keep the activations saved for the backward in host memory "
                                              "(torch.autograd.graph.save_on_cpu) on cuda; no effect on cpu (said "
                                              "once); refused on xla", group="parallelism")
    sequence_parallel: bool = option(False, "split activations between tp regions along the sequence over the "
                                            "tp ranks (needs --seq-len divisible by --tp)", group="parallelism")
    activation_checkpointing: str = option("none", "recompute activations in the backward: the attention core "
                                                   "(selective) or each decoder layer (full)", choices=RECOMPUTE,
                                           aliases=("--activations-checkpoint-granularity",), group="parallelism")
    recompute_modules: str | None = option(None, "with --activation-checkpointing selective: what it recomputes, "
                                                 "NxDT's module names comma-separated: CoreAttention (the attention "
                                                 "core, the default), LlamaMLP (the whole MLP), ActivationMultiplyMLP "
                                                 "(act(gate) x up), LlamaRMSNorm (every RMSNorm), LlamaDecoderLayer "
                                                 "(whole layers)", aliases=("--activations-checkpoint-recompute",),
                                           group="parallelism")
    ep: int | None = option(None, "expert-parallel degree (MoE families; not given: the shards'): carved out of data "
                                  "parallel (must divide it), each ep rank holding E / ep experts, tokens sent to "
                                  "them by all-to-all",
                     aliases=("--expert-model-parallel-size",), group="parallelism")
    context_parallel: int = option(1, "split every row's sequence over this many ranks (zigzag chunks, ring "
                                      "attention); needs --seq-len divisible by 2 x N",
                                    aliases=("--context-parallel-size",), group="parallelism")
    ring_attention: bool = option(True, "attention across context-parallel ranks is ring attention (NxDT's "
                                        "model.fusions.ring_attention); nxdtrain has no other, so --context-parallel "
                                        "> 1 needs it", group="parallelism")

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):  # None: the shards' (resolved by prepare, nxdtrain.checkpoint.resume.run_layout)
            value = getattr(self, name)
            _check(value is None or (is_int(value) and value >= 1), f"--{name} must be an integer >= 1, got {value!r}")
        _check(is_int(self.context_parallel) and self.context_parallel >= 1,
               f"--context-parallel must be an integer >= 1, got {self.context_parallel!r}")
        _check(self.ring_attention or self.context_parallel == 1,
               f"--context-parallel {self.context_parallel} needs ring attention (model.fusions.ring_attention: true), "
               "the only context-parallel attention nxdtrain has; drop --no-ring-attention or use --context-parallel 1")
        _check((why := sharding_limits(shard_params=self.shard_params, hybrid_shard=self.hybrid_shard,
                                       zero1=self.zero1, pp=self.pp or 1, cp=self.context_parallel)) is None, str(why))
        _check(self.kv_replicator is None or (is_int(self.kv_replicator) and self.kv_replicator >= 1),
               f"--kv-replicator must be an integer >= 1, got {self.kv_replicator!r}")
        _check(not (self.fuse_qkv and self.qkv_linear is False), "--fuse-qkv needs --qkv-linear; drop --no-qkv-linear")
        _choice("--pp-schedule", self.pp_schedule, PP_SCHEDULES)
        _choice("--activation-checkpointing", self.activation_checkpointing, RECOMPUTE)
        if self.recompute_modules is not None:
            unknown = [m for m in self.modules() if m not in RECOMPUTE_MODULES]
            _check(not unknown, f"--recompute-modules {self.recompute_modules}: {', '.join(unknown)} is none of "
                                f"{', '.join(RECOMPUTE_MODULES)}")
            _check(self.activation_checkpointing == "selective", f"--recompute-modules {self.recompute_modules} "
                   f"needs --activation-checkpointing selective, got {self.activation_checkpointing}")

    @property
    def shards(self) -> bool:
        """Parameters sharded over data parallel (--shard-params or --hybrid-shard)."""
        return self.shard_params or self.hybrid_shard is not None

    @property
    def shard_flag(self) -> str:
        return flag(shard_params=self.shard_params, hybrid_shard=self.hybrid_shard)

    def xla_refusal(self) -> str | None:
        """Why --shard-params/--hybrid-shard or --offload-activations cannot run on xla (None: neither is asked)."""
        return xla_refusal(shard_flag=self.shard_flag if self.shards else None, offload=self.offload_activations)

    def modules(self) -> tuple[str, ...]:
        """What selective checkpointing recomputes (NxDT's module names); () without it."""
        if self.activation_checkpointing != "selective":
            return ()
        if self.recompute_modules is None:
            return ("CoreAttention",)
        return tuple(m.strip() for m in self.recompute_modules.split(",") if m.strip())


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Optimizer, learning-rate schedule and clipping."""

    optimizer: str = option("adamw", "optimizer (sgd is plain SGD: no momentum)", choices=OPTIMIZERS,
                            group="optimizer and schedule")
    lr: float = option(3e-4, "peak learning rate", group="optimizer and schedule")
    min_lr: float | None = option(None, f"learning rate at the end of the decay (default: {MIN_LR_FRACTION} x --lr; "
                                        "0 for NxDT's schedules; --min-lr 0 ends the decay at 0)",
                                  group="optimizer and schedule")
    warmup: float = option(0, "linear warmup: a step count (an integer >= 1, 1.0 included) or a fraction of the "
                              "run's steps (0 < x < 1, rounded up)", group="optimizer and schedule")
    schedule: str = option("cosine", "decay after warmup: ours (warmup lr x step/warmup, then to --min-lr at "
                                     "--decay-steps), or NxDT's CosineAnnealing / LinearAnnealingWithWarmUp with "
                                     "their own step counting (what an NxDT YAML's model.optim.sched.name selects)",
                           choices=SCHEDULES, group="optimizer and schedule")
    decay_steps: int | None = option(None, "step at which the decay reaches min_lr (default: --steps)",
                                     group="optimizer and schedule")
    weight_decay: float = option(0.0, "AdamW/SGD weight decay on matrices (on norm weights too with "
                                      "--norm-weight-decay)", group="optimizer and schedule")
    norm_weight_decay: bool = option(False, "apply --weight-decay to the norm weights too (NxDT's hf models do with "
                                            "model.do_layer_norm_weight_decay: false); a resume keeps what the tag "
                                            "recorded", group="optimizer and schedule")
    beta1: float = option(0.9, "AdamW beta1", group="optimizer and schedule")
    beta2: float = option(0.95, "AdamW beta2", group="optimizer and schedule")
    eps: float = option(1e-8, "AdamW epsilon", group="optimizer and schedule")
    clip_grad: float = option(1.0, "clip the global gradient norm to this value (0 disables)",
                              group="optimizer and schedule")

    def __post_init__(self) -> None:
        _choice("--optimizer", self.optimizer, OPTIMIZERS)
        _choice("--schedule", self.schedule, SCHEDULES)
        _check(self.lr > 0, f"--lr must be > 0, got {self.lr!r}")
        default_min = 0.0 if self.schedule in NXDT_SCHEDULES else MIN_LR_FRACTION * self.lr
        min_lr = default_min if self.min_lr is None else self.min_lr
        if self.min_lr is None:  # resolved here, so every reader (schedule, checkpoint, log) sees the number
            object.__setattr__(self, "min_lr", min_lr)
        _check(0 <= min_lr <= self.lr, f"--min-lr must be in [0, --lr {self.lr}], got {min_lr!r}")
        _check(self.schedule != "LinearAnnealingWithWarmUp" or min_lr == 0,
               f"--schedule LinearAnnealingWithWarmUp decays to 0 (NxDT's schedule takes no minimum), got --min-lr "
               f"{min_lr!r}; drop --min-lr, or use --schedule linear")
        _check(_is_warmup(self.warmup), f"--warmup must be a step count (integer >= 0) or a fraction in (0, 1), "
                                        f"got {self.warmup!r}")
        _check(self.decay_steps is None or (is_int(self.decay_steps) and self.decay_steps >= 1),
               f"--decay-steps must be an integer >= 1, got {self.decay_steps!r}")
        _check(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay!r}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            _check(0 <= value < 1, f"--{name} must be in [0, 1), got {value!r}")
        _check(self.eps > 0, f"--eps must be > 0, got {self.eps!r}")
        _check(self.clip_grad >= 0, f"--clip-grad must be >= 0 (0 disables clipping), got {self.clip_grad!r}")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where rows come from and how they are batched."""

    # No default (None is refused below), so a valid config always holds a str here.
    data: str = option(None, "required: a save_to_disk dataset dir, a .jsonl/.json(.gz) file (input_ids per row), a "
                             "directory or glob of those (sorted), or 'synthetic': random tokens from --seed, on "
                             "purpose", path=True, group="data", required=True)
    seq_len: int = option(1024, "tokens per row (shorter rows are an error, checked before the run starts; "
                                "longer rows: --long-rows)", group="data")
    long_rows: str = option("cut", "rows longer than --seq-len: cut (their tail is not trained; the start says how "
                                   "many tokens that drops), split (into rows of --seq-len; a remainder shorter "
                                   "than --seq-len is dropped) or error", choices=LONG_ROWS, group="data")
    pad: bool = option(False, "pad rows shorter than --seq-len after their last token; padded positions are not "
                              "trained (no target), and the step's loss still divides by gbs x (seq_len - 1)",
                       group="data")
    gbs: int = option(8, "global batch size in rows (all microbatches of all data-parallel ranks)", group="data")
    mbs: int = option(1, "microbatch size in rows", group="data")
    shuffle: bool = option(True, "visit rows in a seeded random order per epoch (--no-shuffle: file order)",
                           group="data")
    eval_data: str | None = option(None, "held-out rows (what --data takes) for the evaluation loss", path=True,
                                   group="data")
    eval_every: int = option(0, "compute the loss on --eval-data every N steps (0: never); every rank takes part",
                             group="data")
    eval_batches: int | None = option(None, "global batches of --gbs rows per evaluation, from the start of "
                                            "--eval-data in file order (default: all its full batches)", group="data")

    def __post_init__(self) -> None:
        # No silent default: a run without --data used to train on random tokens, which looked like a real run.
        _check(bool(self.data), f"--data is required: {DATA_SPEC}; --data synthetic trains on random tokens")
        _check(is_int(self.seq_len) and self.seq_len >= 2, f"--seq-len must be an integer >= 2, got {self.seq_len!r}")
        _choice("--long-rows", self.long_rows, LONG_ROWS)
        _check(is_int(self.gbs) and self.gbs >= 1, f"--gbs must be an integer >= 1, got {self.gbs!r}")
        _check(is_int(self.mbs) and self.mbs >= 1, f"--mbs must be an integer >= 1, got {self.mbs!r}")
        _check(self.gbs % self.mbs == 0, f"--gbs {self.gbs} must be a multiple of --mbs {self.mbs}")
        _check(is_int(self.eval_every) and self.eval_every >= 0,
               f"--eval-every must be an integer >= 0, got {self.eval_every!r}")
        _check(self.eval_batches is None or (is_int(self.eval_batches) and self.eval_batches >= 1),
               f"--eval-batches must be an integer >= 1, got {self.eval_batches!r}")
        _check(not (self.eval_every and not self.eval_data), f"--eval-every {self.eval_every} needs --eval-data PATH")
        _check(not (self.eval_data and not self.eval_every), "--eval-data needs --eval-every N (steps between "
                                                             "evaluations)")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where training starts from and where its tags go."""

    resume: str | None = option(None, "required: a converted NxD dir (weights only), a checkpoint root (its newest "
                                      "tag), a tag dir, or 'auto': the newest completed tag in --checkpoint-dir, else "
                                      "--init", path=True, group="model and layout", required=True)
    init: str | None = option(None, "with --resume auto: where to start while --checkpoint-dir holds no completed "
                                    "tag (read as --resume reads a path)", path=True, group="model and layout")
    weights_only: bool = option(False, "load only the weights of --resume: step 0, fresh optimizer",
                                group="model and layout")
    hf_config: str | None = option(None, "the HF config.json of a --resume (--init) that has none (NxD's own "
                                         "tags); read, never written into it (the run's tags record it)",
                                   path=True, group="model and layout")
    checkpoint_dir: str | None = option(None, "required unless --no-checkpoint: where step_<N> tags are written",
                                        path=True, group="checkpoints", required=True)
    checkpoint_freq: int = option(0, "save a tag every N steps (0: only at the end); needs --checkpoint-dir",
                                  group="checkpoints")
    keep: int = option(2, "completed step_<N> tags to keep (older ones are deleted)", group="checkpoints")
    async_save: bool = option(False, "write each save's files on a thread while training goes on (on cpu from the "
                              "live state, the next optimizer step waiting for the writes; on a device from a host "
                              "copy kept for the run); the tag completes at the next save, the end or a stop",
                              group="checkpoints")
    xser: bool = option(False, "write model shards in NxD training's xser split format (default: plain)",
                        group="checkpoints")
    no_checkpoint: bool = option(False, "train without --checkpoint-dir on purpose: nothing is saved and the "
                                        "trained weights are lost when the run ends", group="checkpoints")
    optimizer_format: str = option("nxdtrain", "format of the optimizer state each save writes: nxdtrain's own "
                                   "(format 2), or nxd: NxD's (NeuronZero1Optimizer with --zero1, else torch "
                                   "AdamW state dicts; NxD's scheduler.pt and user_content.pt), which NxD 2.28 "
                                   "reads; needs --optimizer adamw and --schedule CosineAnnealing",
                                   choices=OPTIMIZER_FORMATS, group="checkpoints")
    nxd_param_groups: str | None = option(None, "with --optimizer-format nxd: the param groups of the NxD run that "
                                                "will load the tags: bias-norm (NxD's Llama example, the default), "
                                                "bias-LayerNorm, bias (NxDT's with do_layer_norm_weight_decay: "
                                                "false, the default with --norm-weight-decay), or one", choices=NXD_PARAM_GROUPS, group="checkpoints")
    override_schedule: bool = option(False, "resume with another learning-rate schedule, data order or AdamW "
                                            "setting than the tag recorded (peak/min lr, warmup, decay steps, "
                                            "schedule, seed, shuffle, epochs; an explicit --weight-decay, --beta1, "
                                            "--beta2, --eps); without it such a resume is refused",
                                       group="model and layout")
    allow_high_loss: bool = option(False, "start even when the first batch's loss of a resumed or converted start "
                                          "says the weights were loaded wrong (nxdtrain.checkpoint.loss_check)",
                                     group="model and layout")

    def __post_init__(self) -> None:
        _check(bool(self.resume), "--resume PATH is required: a converted NxD directory, a checkpoint root, a tag, "
                                  "or auto (with --checkpoint-dir and --init)")
        if self.resume == AUTO:
            _check(bool(self.checkpoint_dir), "--resume auto needs --checkpoint-dir (where it looks for the newest "
                                              "completed tag)")
        else:
            _check(self.init is None, f"--init {self.init} is where --resume auto starts; with --resume {self.resume} "
                                      "it would be ignored: drop it, or pass --resume auto")
        _check(is_int(self.checkpoint_freq) and self.checkpoint_freq >= 0,
               f"--checkpoint-freq must be an integer >= 0, got {self.checkpoint_freq!r}")
        _check(is_int(self.keep) and self.keep >= 1, f"--keep must be an integer >= 1, got {self.keep!r}")
        _check(not (self.no_checkpoint and self.checkpoint_dir),
               f"--no-checkpoint and --checkpoint-dir {self.checkpoint_dir} exclude each other; choose one")
        _choice("--optimizer-format", self.optimizer_format, OPTIMIZER_FORMATS)
        _check(self.nxd_param_groups is None or self.optimizer_format == "nxd",
               f"--nxd-param-groups {self.nxd_param_groups} applies to --optimizer-format nxd only")
        if self.nxd_param_groups is not None:
            _choice("--nxd-param-groups", self.nxd_param_groups, NXD_PARAM_GROUPS)


@dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """MoE routing as NxDT's model.moe sets it (nxdtrain.model.capacity); defaults: the checkpoint's config.json."""

    capacity_factor: float | None = option(None, "MoE: drop tokens as NxD does: each expert takes at most "
                                           "ceil(T x top_k x F / E) of a micro-batch's T tokens, counted in token "
                                           "order, the rest of its slots dropped; unset or 0: dropless; >= E / top_k: "
                                           "full capacity, dropless too", group="model and layout")
    moe_top_k: int | None = option(None, "MoE: experts per token (default: config.json's num_experts_per_tok)",
                                   group="model and layout")
    normalize_top_k_affinities: bool | None = option(None, "MoE: renormalize each token's kept experts' weights to "
                                                           "sum 1 (default: the family's rule)",
                                                     group="model and layout")
    router_aux_loss_coef: float | None = option(None, "MoE: the aux loss's coefficient (default: config.json's, "
                                                      "else 0.001)", group="model and layout")
    output_router_logits: bool = option(True, "MoE: train with the router's aux loss", group="model and layout")
    aux_loss_scale: str = option("transformers", "MoE: the aux loss as transformers defines it (x E) or as NxD's "
                                 "load_balancing_loss_func (x E / top_k, what an NxDT YAML's model.moe sets)",
                                 choices=AUX_SCALES, group="model and layout")
    num_experts: int | None = option(None, "MoE: the experts the checkpoint must have (NxDT's model.moe.num_experts; "
                                           "checked, never changed)", group="model and layout")
    override_moe: bool = option(False, "resume with another --capacity-factor, --moe-top-k or aux loss than the tag "
                                       "recorded; without it such a resume is refused", group="model and layout")

    def __post_init__(self) -> None:
        cf = self.capacity_factor
        _check(cf is None or cf >= 0, f"--capacity-factor must be >= 0, got {cf!r}")
        _check(self.moe_top_k is None or (is_int(self.moe_top_k) and self.moe_top_k >= 1),
               f"--moe-top-k must be an integer >= 1, got {self.moe_top_k!r}")
        _choice("--aux-loss-scale", self.aux_loss_scale, AUX_SCALES)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A whole training run. ``nxdtrain run`` flags and YAML keys are the leaf field names."""

    steps: int = option(1000, "train until this global step (a resumed run continues from its step)",
                        group="optimizer and schedule")
    epochs: int | None = option(None, "train this many passes over --data instead of --steps (last partial global "
                                      "batch of each epoch dropped)", group="optimizer and schedule")
    seed: int = option(1234, "seed of the data order and of torch's RNG", group="data")
    precision: str = option("auto", "fp32, or bf16 parameters with fp32 master weights and optimizer state; auto: "
                                    "what a resumed checkpoint was trained in, else bf16 on an accelerator (cuda, "
                                    "Trainium) and fp32 on cpu", choices=PRECISIONS, group="device and launch")
    nproc: int | None = option(None, "start this many local processes (without it: join torchrun/srun or run "
                                     "alone)", group="device and launch")
    log_jsonl: str | None = option(None, "append one JSON line per step to this file", path=True, group="logging")
    tensorboard: str | None = option(None, "write loss, lr, grad and parameter norms, tokens/s, consumed samples and "
                                           "the evaluation loss to TensorBoard event files in this directory (our "
                                           "tags and NxDT's)", path=True, group="logging")
    export_hf: str | None = option(None, "export the final checkpoint to this HF directory (ckptconv to-hf)",
                                   path=True, group="checkpoints")
    dist_timeout: float = option(1800.0, "seconds a collective may wait before the run fails", group="device and launch")
    device: str = option("auto", "where to train; auto: xla when torch-xla imports and its PJRT device is an "
                         "accelerator (Trainium: NEURON), else cuda when available, else cpu", choices=DEVICES,
                         group="device and launch")
    log_every: int = option(1, "read loss, grad norm and tokens/s back from the device every N steps (each read "
                            "waits for the device)", group="logging")
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    # Not an option: where values came from when not from a flag (name -> "KEY (FILE)"), so that later
    # messages name the YAML key the user wrote (:func:`explain`).
    origins: dict[str, str] = field(default_factory=dict, compare=False, repr=False, metadata={"internal": True})
    # Not an option: the names the user gave (flags or YAML), as opposed to defaults: a resume compares those
    # of the optimizer with the tag's (nxdtrain.checkpoint.continuity.optimizer_groups).
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False, metadata={"internal": True})

    def __post_init__(self) -> None:
        _check(is_int(self.steps) and self.steps >= 0, f"--steps must be an integer >= 0, got {self.steps!r}")
        _choice("--precision", self.precision, PRECISIONS)
        _check(self.epochs is None or (is_int(self.epochs) and self.epochs >= 1),
               f"--epochs must be an integer >= 1, got {self.epochs!r}")
        _check(self.nproc is None or (is_int(self.nproc) and self.nproc >= 1), f"--nproc must be >= 1, got {self.nproc!r}")
        _check(self.dist_timeout > 0, f"--dist-timeout must be > 0 seconds, got {self.dist_timeout!r}")
        _choice("--device", self.device, DEVICES)
        _check(is_int(self.log_every) and self.log_every >= 1, f"--log-every must be an integer >= 1, got {self.log_every!r}")
        if self.device == "xla":
            _check((why := self.xla_why()) is None, str(why))
        ckpt = self.checkpoint
        _check(not (self.export_hf and not ckpt.checkpoint_dir),
               "--export-hf needs --checkpoint-dir (the export reads the final checkpoint)")
        _check(not (ckpt.checkpoint_freq and not ckpt.checkpoint_dir), "--checkpoint-freq needs --checkpoint-dir")
        if ckpt.optimizer_format == "nxd":  # NxD's files hold AdamW's state and NxD's CosineAnnealing schedule only
            _check(self.optim.optimizer == "adamw", f"--optimizer-format nxd needs --optimizer adamw (NxD's files hold "
                                                    f"AdamW's state), got --optimizer {self.optim.optimizer}")
            _check(self.optim.schedule == NXD_SCHEDULE,
                   f"--optimizer-format nxd needs --schedule {NXD_SCHEDULE} (the only schedule of NxD's examples "
                   f"whose scheduler.pt can be written), got --schedule {self.optim.schedule}")

    def xla_why(self) -> str | None:
        """Why this run cannot train on xla, in one line, or None (the config for ``--device xla``, ``prepare`` for
        ``--device auto`` resolving to xla)."""
        return (xla_limits(pp=self.parallel.pp or 1, optimizer=self.optim.optimizer, cp=self.parallel.context_parallel)
                or self.parallel.xla_refusal())

    def with_layout(self, *, tp: int, pp: int, ep: int) -> TrainConfig:
        """The run's tp, pp and ep, the shards' where not given (``prepare`` resolves them before dp = world /
        (tp x pp x cp)): the checks of the other options run again with them, and a refusal names a value the user
        did not give as the shards'."""
        try:
            return dataclasses.replace(self, parallel=dataclasses.replace(self.parallel, tp=tp, pp=pp, ep=ep))
        except TrainError as exc:
            raise TrainError(self.layout_explained(str(exc))) from None

    def layout_explained(self, message: str) -> str:
        """``message`` with ``--tp``/``--pp``/``--ep`` not given named as the shards' (:func:`explain`); call it on
        the config before :meth:`with_layout`."""
        from_shards = {k: f"the shards' {k}" for k in ("tp", "pp", "ep") if getattr(self.parallel, k) is None}
        return explain(message, {**from_shards, **self.origins})

    def with_precision(self, device: str, recorded: str | None) -> tuple[TrainConfig, str]:
        """``--precision auto`` resolved for ``device`` (a resumed checkpoint's ``recorded`` precision first),
        and the line that says which precision the run uses and why."""
        from nxdtrain.device import default_precision

        if self.precision != "auto":
            changed = f"; the checkpoint was trained in {recorded}" if recorded and recorded != self.precision else ""
            return self, explain(f"precision {self.precision} (--precision{changed})", self.origins)
        if recorded in ("fp32", "bf16"):
            return dataclasses.replace(self, precision=recorded), f"precision {recorded} (recorded in the checkpoint)"
        chosen = default_precision(device)
        other = "bf16" if chosen == "fp32" else "fp32"
        return (dataclasses.replace(self, precision=chosen),
                f"precision {chosen} (the default on {device}; --precision {other} to change it)")

    @property
    def decay_steps(self) -> int:
        return self.optim.decay_steps or self.steps

    # ------------------------------------------------------------------ flat views

    @classmethod
    def from_flat(cls, values: dict[str, Any], source: str = "options",
                  origins: dict[str, str] | None = None) -> TrainConfig:
        """Build from flat leaf names (``{"tp": 2, "lr": 1e-3}``); unknown names are an error.

        ``origins`` says where values that did not come from a flag came from (``{"lr": "model.optim.lr
        (run.yaml)"}``): an error about such a value names that key instead of the flag.
        """
        origins = dict(origins or {})
        sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        top: dict[str, Any] = {}
        fields = {f.name: (owner, f) for owner, f in leaf_fields()}
        for key, value in values.items():
            if key not in fields:
                raise TrainError(f"{source}: unknown option {key!r} (valid: {', '.join(sorted(fields))})")
            owner, f = fields[key]
            (sections[owner] if owner else top)[key] = coerce(f, value, origins.get(key, source))
        if top.get("epochs") is not None and "steps" in top:
            raise TrainError(f"{source}: " + explain("--epochs and --steps are exclusive (give one: epochs size the "
                                                     "run from --data)", origins))
        try:
            built = {name: section_cls(**sections[name]) for name, section_cls in SECTIONS.items()}
            return cls(**top, **built, origins=origins, given=frozenset(values))
        except TrainError as exc:
            raise TrainError(explain(str(exc), origins)) from None

    def to_flat(self) -> dict[str, Any]:
        """Every leaf as a plain value (what ``user_content.pt`` stores)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in SECTIONS and not f.metadata.get("internal")}
        for name in SECTIONS:
            section = getattr(self, name)
            out.update({f.name: getattr(section, f.name) for f in dataclasses.fields(section)})
        return out


SECTIONS: dict[str, type] = {"parallel": ParallelConfig, "optim": OptimConfig, "data": DataConfig,
                             "checkpoint": CheckpointConfig, "moe": MoeConfig}


def leaf_fields() -> list[tuple[str | None, dataclasses.Field[Any]]]:
    """(section name or None for top level, field) for every leaf option, in declaration order."""
    out: list[tuple[str | None, dataclasses.Field[Any]]] = [
        (None, f) for f in dataclasses.fields(TrainConfig) if f.name not in SECTIONS and not f.metadata.get("internal")
    ]
    for name, section_cls in SECTIONS.items():
        out.extend((name, f) for f in dataclasses.fields(section_cls))
    return out


def leaf_owners() -> dict[str, str | None]:
    return {f.name: owner for owner, f in leaf_fields()}


def flag_of(f: dataclasses.Field[Any]) -> str:
    """The CLI flag of a leaf field."""
    return "--" + f.name.replace("_", "-")


def coerce(f: dataclasses.Field[Any], value: Any, source: str) -> Any:
    """A YAML value as the field's type (YAML 1.1 reads ``1e-3`` as a string, for one); paths expanded."""
    kind = str(f.type)
    if f.metadata.get("path") and isinstance(value, str):
        return expand_path(value, source)
    if value is None or isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return value
    try:
        if "float" in kind:
            return float(value)
        if "int" in kind and isinstance(value, str):
            return int(value)
        if "bool" in kind and isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
            return value.lower() in ("true", "yes")
    except ValueError:
        raise TrainError(f"{source}: {f.name} must be a {kind.split(' ')[0]}, got {value!r}") from None
    return value


_VAR = re.compile(r"\$(\w+|\{[^}]*\})")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def expand_path(value: str, source: str) -> str:
    """``~`` and ``$VAR``/``${VAR}`` expanded; a variable that is not set is an error naming it."""
    expanded = os.path.expanduser(os.path.expandvars(value))
    unset = _VAR.search(expanded)
    if unset is not None:
        raise TrainError(f"{source} {value!r}: environment variable {unset.group(1).strip('{}')} is not set")
    return expanded


def explain(message: str, origins: dict[str, str]) -> str:
    """``message`` with the first mention of each flag whose value came from a file replaced by where it came
    from (``--checkpoint-freq needs ...`` -> ``exp_manager.checkpoint_callback_params.every_n_train_steps
    (run.yaml) needs ...``); later mentions stay flags (what the user may type to override it)."""
    if not origins:
        return message
    names = {flag: f.name for _, f in leaf_fields() for flag in (flag_of(f), *f.metadata["aliases"])}
    seen: set[str] = set()

    def name(match: re.Match[str]) -> str:
        flag = match.group(0)
        field_name = names.get(flag)
        if field_name not in origins or flag in seen:
            return flag
        seen.add(flag)
        return origins[field_name]

    return _FLAG.sub(name, message)


def _is_warmup(value: Any) -> bool:
    """A step count (integer-valued, ``1.0`` is one step) or a fraction strictly between 0 and 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return False
    return value < 1 or float(value).is_integer()


def _choice(flag: str, value: Any, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{flag} must be one of {', '.join(choices)}, got {value!r}")
