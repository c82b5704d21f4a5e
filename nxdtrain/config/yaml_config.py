"""``--config FILE.yaml``: our option names, or an NxDT (neuronx-distributed-training) YAML as users have it.

Top-level keys are our option names (``seq_len: 2048``, the flags' names with ``_``) or NxDT's: its sections
(``trainer``, ``exp_manager``, ``distributed_strategy``, ``data``, ``model``, ``precision``, ...) and top-level
keys (``name``, ``seed``, ``compiler_flags``, ...). The file is read as NxDT reads it:

* with OmegaConf (:mod:`nxdtrain.config.yaml_load`): ``${a.b.c}``, ``${.sibling}``, ``${multiply:...}`` and
  ``${oc.env:VAR[,default]}`` mean what they mean in NxDT; in paths ``~``, ``$VAR`` and ``${VAR}`` (not a key of
  the file) are expanded as a shell would; every key of NxDT's example configs: docs/nxdt-configs.md;
* NxDT keys that mean something here become options (:data:`NXDT_KEYS`, and ``exp_manager`` below); NxDT keys
  that do not apply (the model's shape comes from the checkpoint's config.json, compiler settings, ...) are
  listed once on stderr; any other key is an error: all of them in one line, each with the nearest known key;
* ``exp_manager``: ``log_dir`` is ``explicit_log_dir``, else ``exp_dir/name`` (``exp_dir`` null:
  ``./nemo_experiments``; ``name`` null: ``default``): NeMo's layout, without the per-run version folder NeMo
  adds when ``resume_if_exists`` is off. Checkpoints go to ``log_dir/checkpoints`` (unless
  ``create_checkpoint_callback: false``), TensorBoard to ``log_dir`` with ``create_tensorboard_logger: true``;
  ``resume_if_exists: true`` is ``--resume auto`` with ``resume_from_checkpoint`` as ``--init``, otherwise
  ``resume_from_checkpoint`` is ``--resume``. Unlike NeMo, a completed tag in the checkpoint directory wins
  over ``resume_from_checkpoint``: a requeued job continues instead of starting over.

Flags beat the file; a flag also replaces what the file derived for the same purpose (``--resume`` drops the
file's ``--init``, see :data:`REPLACES`). Values are checked by :class:`~nxdtrain.config.options.TrainConfig`; an error
about a value from the file names its key (``origins``).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nxdtrain.config.nxdt_moe import MOE_KEYS, nxdt_moe
from nxdtrain.config.options import AUTO, NXDT_SCHEDULES, RECOMPUTE_MODULES, leaf_owners
from nxdtrain.config.yaml_load import load_tree
from nxdtrain.errors import TrainError

# NxDT's nested keys -> our flat names (translated by _nxdt_value where the value differs).
NXDT_KEYS: dict[tuple[str, ...], str] = {
    ("trainer", "max_steps"): "steps",
    ("trainer", "max_epochs"): "epochs",
    ("trainer", "gradient_clip_val"): "clip_grad",
    ("trainer", "log_every_n_steps"): "log_every",
    ("distributed_strategy", "tensor_model_parallel_size"): "tp",
    ("distributed_strategy", "pipeline_model_parallel_size"): "pp",
    ("distributed_strategy", "kv_replicator"): "kv_replicator",
    ("distributed_strategy", "zero1"): "zero1",
    ("distributed_strategy", "sequence_parallel"): "sequence_parallel",
    ("distributed_strategy", "context_parallel_size"): "context_parallel",
    ("distributed_strategy", "expert_model_parallel_size"): "ep",
    # NxDT has no parameter sharding: SMP v2's parameter names, in NxDT's section (docs/nxdt-configs.md)
    ("distributed_strategy", "hybrid_shard_degree"): "hybrid_shard",
    ("distributed_strategy", "sm_activation_offloading"): "offload_activations",
    ("model", "fusions", "ring_attention"): "ring_attention",
    ("distributed_strategy", "virtual_pipeline_model_parallel_size"): "vpp",
    ("data", "micro_batch_size"): "mbs",
    ("data", "global_batch_size"): "gbs",
    ("data", "seq_length"): "seq_len",
    ("model", "encoder_seq_length"): "seq_len",  # where NxDT's HF Llama configs give the sequence length
    ("data", "train_dir"): "data",
    ("model", "qkv_linear"): "qkv_linear",
    ("model", "fuse_qkv"): "fuse_qkv",
    ("model", "weight_init_only"): "weights_only",
    ("model", "optim", "name"): "optimizer",
    ("model", "optim", "lr"): "lr",
    ("model", "optim", "weight_decay"): "weight_decay",
    ("model", "optim", "eps"): "eps",
    ("model", "optim", "betas"): "betas",
    ("model", "optim", "sched", "name"): "schedule",
    ("model", "optim", "sched", "warmup_steps"): "warmup",
    ("model", "optim", "sched", "max_steps"): "decay_steps",
    ("model", "optim", "sched", "min_lr"): "min_lr",
    ("model", "optim", "sched", "constant_steps"): "constant_steps",
    ("model", "do_layer_norm_weight_decay"): "do_layer_norm_weight_decay",
    ("exp_manager", "save_xser"): "xser",
    ("exp_manager", "checkpoint_callback_params", "every_n_train_steps"): "checkpoint_freq",
    ("exp_manager", "checkpoint_callback_params", "save_top_k"): "keep",
    ("exp_manager", "async_checkpointing"): "async_save",
    ("precision", "type"): "precision",
}
# exp_manager keys read together (_exp_manager); evaluation keys likewise (_evaluation).
EXP_MANAGER = ("exp_dir", "explicit_log_dir", "name", "create_tensorboard_logger", "create_checkpoint_callback",
               "resume_if_exists", "resume_ignore_no_checkpoint", "resume_from_checkpoint")
EVALUATION = {("data", "val_dir"), ("trainer", "val_check_interval"), ("trainer", "limit_val_batches")}
# What NxDT recomputes is decided by these together (_Reader.recompute; llama_model.py of NxDT).
RECOMPUTE_KEYS = {("model", "activations_checkpoint_granularity"), ("model", "activations_checkpoint_recompute"),
                  ("model", "activations_checkpoint_recompute_mlp"), ("model", "fusions", "flash_attention")}
# Alignment (NxDT's SFT, DPO, ORPO, LoRA): a different loss and data; refused in one line.
ALIGNMENT_TREES = (("model_alignment_strategy",), ("data", "alignment_strategy"))

# NxDT keys that do not apply to nxdtrain (noted, not errors). The model's shape is the checkpoint's.
NXDT_IGNORED: dict[str, tuple[str, ...]] = {
    "": ("name", "model_source", "compiler_flags", "compiler_cache_url", "aync_exec_max_inflight_requests",
         "bucket_size_collectives", "neuron_rt_exec_timeout", "neuron_experimental_compress_rg"),
    "trainer": ("devices", "num_nodes", "check_val_every_n_epoch", "num_sanity_val_steps", "limit_test_batches",
                "lnc", "sequential_move_factor", "vnc"),
    "exp_manager": ("log_local_rank_0_only", "log_parameter_norm", "log_gradient_norm", "load_xser", "save_bf16",
                    "enable_recovery_time_instrumentation", "ckpt_ptl_version"),
    "exp_manager.checkpoint_callback_params": ("monitor", "mode", "save_last", "filename", "model_parallel_size",
                                               "use_master_weights_in_ckpt"),
    "distributed_strategy": ("token_shuffle_group_size",),
    "data": ("data_impl", "data_prefix", "dataloader_type", "dev_choose_samples", "eod_mask_loss",
             "index_mapping_dir", "no_seqlen_plus_one_input_tokens", "num_workers", "packing",
             "pad_samples_to_global_batch_size", "reset_attention_mask", "reset_position_ids", "skip_warmup",
             "splits_string", "use_sft_style_data_module", "validation_drop_last"),
    "model": ("model_config", "max_position_embeddings", "num_layers", "hidden_size", "num_attention_heads",
              "num_kv_heads", "ffn_hidden_size", "kv_channels", "rope_theta", "init_method_std", "layernorm_epsilon",
              "make_vocab_size_divisible_by", "activation", "normalization", "position_embedding_type",
              "rotary_percentage", "share_embeddings_and_output_weights", "has_bias", "hidden_dropout",
              "attention_dropout", "ffn_dropout", "apply_query_key_layer_scaling", "persist_layer_norm",
              "transformer_block_type", "use_cpu_initialization", "use_scaled_init_method",
              "pipeline_cuts", "sliding_window_size", "transpose_nki_inputs"),
    "model.optim": ("capturable",),
    "precision": ("master_weights", "fp32_grad_acc", "fp32_grads_cc", "xla_use_bf16", "xla_downcast_bf16",
                  "neuron_rt_stochastic_rounding_en", "parallel_layers_reduce_dtype"),
}
# Subtrees of NxDT features nxdtrain does not have: every key under them is noted, none is an error.
NXDT_IGNORED_TREES = {("model", "fusions"), ("data", "tokenizer")}
NXDT_SECTIONS = frozenset(path[0] for path in NXDT_KEYS) | {"model_alignment_strategy"}
# NxDT's HF models (hf_models/base_model.py -> utils/model_utils.py) build two param groups themselves: names with
# "bias" (and "norm" with do_layer_norm_weight_decay) at weight decay 0, the rest at this, whatever model.optim says.
NXDT_HF_WEIGHT_DECAY = 0.01
NXDT_OPTIMIZERS = {"adamw": "adamw", "adamw_fp32optstate": "adamw", "sgd": "sgd"}  # nxdtrain steps fp32 state
# NxDT's precision.type (its base.py): fp32; or bf16 weights with fp32 masters and fp32 gradient accumulation, which
# NxD turns on with ZeRO-1 only. Stochastic rounding (…SR) and manual have no nxdtrain equivalent.
NXDT_PRECISIONS = {"fp32": "fp32", "mixed_precision": "bf16", "autocast": "bf16"}

# A flag replaces what the file derived for the same purpose: (flag's option, file's options it drops).
REPLACES: dict[str, tuple[str, ...]] = {"resume": ("init",), "checkpoint_dir": ("no_checkpoint",),
                                        "no_checkpoint": ("checkpoint_dir",), "steps": ("epochs",),
                                        "epochs": ("steps",)}


@dataclass
class YamlOptions:
    """What a ``--config`` file says: flat option values, where each came from, and notes for stderr."""

    values: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)  # option -> "KEY (FILE)"
    notes: list[str] = field(default_factory=list)

    def under(self, flags: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """These values with ``flags`` on top (:data:`REPLACES` applied), and the origins still true; notes
        where the directories exp_manager implies are used."""
        values = dict(self.values)
        for name in flags:
            for dropped in REPLACES.get(name, ()):
                if name == "resume" and flags[name] == AUTO:
                    continue  # --resume auto keeps the file's --init
                values.pop(dropped, None)
        origins = {k: v for k, v in self.origins.items() if k in values and k not in flags}
        made = [f"{what} in {values[name]}" for name, what in (("checkpoint_dir", "checkpoints"),
                                                                ("tensorboard", "TensorBoard"))
                if origins.get(name, "").startswith("exp_manager.")]
        if made:
            self.notes.append(f"{', '.join(made)} (NxDT's exp_manager layout: exp_dir/name/checkpoints)")
        return {**values, **flags}, origins


def read_yaml(path: str | Path) -> YamlOptions:
    """Read ``path`` (see the module docstring); raise TrainError naming the file and key."""
    path = Path(path)
    tree = load_tree(path)
    if tree is None:
        return YamlOptions()
    if not isinstance(tree, dict):
        raise TrainError(f"--config {path}: expected a mapping of options, got {type(tree).__name__}")
    return _Reader(path, tree).read()


# --------------------------------------------------------------------------------------------
# Keys


def _leaves(tree: dict[str, Any], prefix: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
    out = []
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, dict) and path not in NXDT_KEYS:
            out.extend(_leaves(value, path))
        else:
            out.append((path, value))
    return out


def _known(section: str) -> list[str]:
    """Every key NxDT has directly under ``section`` ('' for the top level), for the nearest-key hint."""
    depth = 0 if not section else section.count(".") + 1
    prefix = tuple(section.split(".")) if section else ()
    keys = {p[depth] for p in (*NXDT_KEYS, *EVALUATION, *NXDT_IGNORED_TREES) if p[:depth] == prefix and len(p) > depth}
    keys.update(NXDT_IGNORED.get(section, ()))
    if section == "model.moe":
        keys.update(MOE_KEYS)
    elif section == "model":
        keys.add("moe")
    if section == "exp_manager":
        keys.update(EXP_MANAGER)
    if not section:
        keys.update(NXDT_SECTIONS)
    return sorted(keys)


class _Reader:
    def __init__(self, path: Path, tree: dict[str, Any]) -> None:
        self.path, self.tree = path, tree
        self.out = YamlOptions()
        self.ignored: list[str] = []
        self.unknown: list[str] = []
        self.found_evaluation: dict[tuple[str, ...], Any] = {}
        self.found_recompute: dict[str, Any] = {}
        self.found_moe: dict[str, Any] = {}

    def read(self) -> YamlOptions:
        self.refuse_alignment()
        owners = leaf_owners()
        for key, value in self.tree.items():
            if key in NXDT_SECTIONS and isinstance(value, dict):  # `data:`/`precision:` are options of ours too
                self.section(key, value)

            elif key in owners:
                self.set(key, value, str(key))
            elif key in NXDT_IGNORED[""]:
                self.ignored.append(str(key))
            else:
                self.unknown.append(_nearest(str(key), [*owners, *_known("")]))
        self.evaluation(self.found_evaluation)
        self.recompute(self.found_recompute)
        self.moe()
        self.nxdt_checks()
        if self.unknown:
            raise TrainError(f"--config {self.path}: unknown keys {'; '.join(self.unknown)} (top-level keys are "
                             f"nxdtrain run's option names, or NxDT's: {', '.join(_known(''))})")
        if self.ignored:
            self.out.notes.insert(0, f"{self.path}: NxDT keys that do not apply to nxdtrain, ignored: "
                                     f"{', '.join(self.ignored)}")
        return self.out

    def refuse_alignment(self) -> None:
        """NxDT's SFT/DPO/ORPO/LoRA configs, before anything else in them is looked at."""
        for tree in ALIGNMENT_TREES:
            node: Any = self.tree
            for part in tree:
                node = node.get(part) if isinstance(node, dict) else None
            found = [p for p, _ in _leaves(node, tree)] if isinstance(node, dict) else []
            if found or (node is not None and not isinstance(node, dict)):
                key = ".".join(found[0] if found else tree)
                raise TrainError(f"--config {self.path}: {key}: NxDT's alignment training (SFT, DPO, ORPO, LoRA) is "
                                 "not supported; nxdtrain continues causal-LM pretraining only")
        if ((self.tree.get("data") or {}) if isinstance(self.tree.get("data"), dict) else {}).get(
                "use_sft_style_data_module"):
            raise TrainError(f"--config {self.path}: data.use_sft_style_data_module: NxDT's alignment training (SFT, "
                             "DPO, ORPO, LoRA) is not supported; nxdtrain continues causal-LM pretraining only")

    def set(self, name: str, value: Any, key: str) -> None:
        origin = f"{key} ({self.path.name})"
        if name in self.out.values and self.out.values[name] != value:
            raise TrainError(f"--config {self.path}: {key} {value!r} and {self.out.origins[name]} "
                             f"{self.out.values[name]!r} set the same option differently; keep one")
        self.out.values[name] = value
        self.out.origins.setdefault(name, origin)

    def section(self, name: str, tree: dict[str, Any]) -> None:
        exp: dict[str, Any] = {}
        for path, value in _leaves(tree, (name,)):
            dotted = ".".join(path)
            if path in NXDT_KEYS:
                for option, translated in self.translate(NXDT_KEYS[path], value, dotted).items():
                    self.set(option, translated, dotted)
            elif path[0] == "exp_manager" and len(path) == 2 and path[1] in EXP_MANAGER:
                exp[path[1]] = value
            elif path in EVALUATION:
                self.found_evaluation[path] = value
            elif path in RECOMPUTE_KEYS:
                self.found_recompute[path[-1]] = value
            elif path[:2] == ("model", "moe") and len(path) == 3 and path[2] in MOE_KEYS:
                self.found_moe[path[2]] = value
            elif any(path[:len(t)] == t for t in NXDT_IGNORED_TREES) or path[-1] in NXDT_IGNORED.get(
                    ".".join(path[:-1]), ()):
                self.ignored.append(dotted)
            else:
                section = ".".join(path[:-1])
                self.unknown.append(_nearest(dotted, [f"{section}.{k}" for k in _known(section)]))
        if name == "exp_manager":
            self.exp_manager(exp)

    def translate(self, option: str, value: Any, key: str) -> dict[str, Any]:
        """One NxDT value as our option(s); {} when it only needs checking or a note."""
        where = f"--config {self.path}: {key}"
        if option == "betas":
            if not (isinstance(value, (list, tuple)) and len(value) == 2):
                raise TrainError(f"{where} must be a list of two numbers, got {value!r}")
            return {"beta1": float(value[0]), "beta2": float(value[1])}
        if option == "optimizer":
            if str(value).lower() not in NXDT_OPTIMIZERS:
                raise TrainError(f"{where} {value!r}: nxdtrain has NxDT's adamw and adamw_fp32OptState (both: AdamW "
                                 "with fp32 state and fp32 master weights), and sgd")
            return {"optimizer": NXDT_OPTIMIZERS[str(value).lower()]}
        if option == "schedule":
            if value not in NXDT_SCHEDULES:
                raise TrainError(f"{where} {value!r}: nxdtrain has NxDT's {' and '.join(NXDT_SCHEDULES)} (or its own "
                                 "cosine, linear, constant: --schedule)")
            return {"schedule": value}
        if option == "constant_steps":
            if value not in (0, None):
                raise TrainError(f"{where} {value!r}: nxdtrain's CosineAnnealing has no constant phase; set it to 0")
            return {}
        if option == "vpp":
            if value not in (1, None):
                raise TrainError(f"{where} {value!r}: nxdtrain trains with one model chunk per pipeline stage; set 1")
            return {}
        if option == "weight_decay":  # NxDT's hf models give the decayed group its own 0.01 (utils/model_utils.py
            if value != NXDT_HF_WEIGHT_DECAY:  # get_param_groups_by_weight_decay), which beats the optimizer's value
                self.out.notes.append(f"{key} {value}: NxDT's HF models decay with {NXDT_HF_WEIGHT_DECAY} whatever "
                                      "this key says (their param groups set it); nxdtrain trains as NxDT did "
                                      "(--weight-decay overrides)")
            return {"weight_decay": NXDT_HF_WEIGHT_DECAY}
        if option == "do_layer_norm_weight_decay":  # NxDT's hf models: true puts names with "norm" in the
            return {"norm_weight_decay": not value}  # no-decay group (hf_models/base_model.py), false decays them
        if option == "epochs":
            return {} if value in (None, -1) else {"epochs": value}  # -1: PyTorch Lightning's "until max_steps"
        if option == "hybrid_shard":  # SMP v2: 0 is "the script's own FSDP setup", 1 shards nothing
            if value == 0:
                raise TrainError(f"{where} 0: SMP's 'the training script's own FSDP setup' has no nxdtrain meaning; "
                                 "give the sharding degree N (2 .. dp; dp shards fully), or 1 for none")
            return {} if value == 1 else {"hybrid_shard": value}
        if option == "precision":
            if value not in NXDT_PRECISIONS:
                raise TrainError(f"{where} {value!r}: nxdtrain has NxDT's {', '.join(NXDT_PRECISIONS)} (bf16 weights "
                                 "with fp32 master weights), not stochastic rounding or manual precision")
            return {"precision": NXDT_PRECISIONS[value]}
        return {option: value}

    def recompute(self, found: dict[str, Any]) -> None:
        """What NxDT's llama_model.py recomputes: ``selective`` the modules of the list (NxDT 2.20, before the list:
        CoreAttention, and LlamaMLP too with ``activations_checkpoint_recompute_mlp`` from ``encoder_seq_length``
        8192), ``full`` every layer, no granularity: CoreAttention where ``fusions.flash_attention`` is false."""
        if not found:
            return
        granularity = found.get("activations_checkpoint_granularity")
        granularity, key = granularity and str(granularity).lower(), "model.activations_checkpoint_granularity"
        mlp = "activations_checkpoint_recompute_mlp"
        if "activations_checkpoint_recompute" in found:
            names, names_key = found["activations_checkpoint_recompute"], "model.activations_checkpoint_recompute"
            listed = [names] if isinstance(names, str) else list(names or [])
            unknown = [str(n) for n in listed if n not in RECOMPUTE_MODULES]
            if unknown:
                raise TrainError(f"--config {self.path}: {names_key} {names!r}: {', '.join(unknown)} is none of NxDT's "
                                 f"modules nxdtrain recomputes: {', '.join(RECOMPUTE_MODULES)}")
            if mlp in found:
                self.ignored.append(f"model.{mlp}")  # NxDT reads the list instead since 2.21
        else:
            seq = (self.tree.get("model") or {}).get("encoder_seq_length") or 0
            names = ["CoreAttention", "LlamaMLP"] if found.get(mlp) and seq >= 8192 else ["CoreAttention"]
            names_key = f"model.{mlp}" if mlp in found else key
        if granularity is None and found.get("flash_attention") is False:
            granularity, names, key = "selective", ["CoreAttention"], "model.fusions.flash_attention"
            names_key = key
        elif "flash_attention" in found:
            self.ignored.append("model.fusions.flash_attention")
        names = [names] if isinstance(names, str) else list(names or [])
        if granularity is None or (granularity == "selective" and not names):  # NxDT wraps no module
            self.set("activation_checkpointing", "none", key)
            return
        self.set("activation_checkpointing", granularity, key)
        if granularity == "selective":
            self.set("recompute_modules", ",".join(map(str, names)), names_key)

    def moe(self) -> None:
        """``model.moe`` as NxDT's Mixtral reads it (nxdtrain.config.nxdt_moe)."""
        model = self.tree.get("model")
        if not isinstance(model, dict) or not isinstance(model.get("moe"), dict):
            return
        values, notes = nxdt_moe(self.found_moe, f"--config {self.path}")
        for option, (value, key) in values.items():
            self.set(option, value, key)
        self.out.notes.extend(notes)

    def nxdt_checks(self) -> None:
        """Keys NxDT reads together, where nxdtrain cannot do what NxDT does with their combination."""
        sections: dict[str, dict[str, Any]] = {k: v if isinstance(v := self.tree.get(k), dict) else {} for k in
                                               ("trainer", "model", "precision", "distributed_strategy")}
        sched = (sections["model"].get("optim") or {}).get("sched") or {}
        steps = sections["trainer"].get("max_steps")
        if "max_steps" in sched and steps is not None and sched["max_steps"] != steps:
            raise TrainError(f"--config {self.path}: model.optim.sched.max_steps {sched['max_steps']!r}: NxDT decays "
                             f"over trainer.max_steps ({steps!r}) whatever this says; set it to ${{trainer.max_steps}}")
        kind = sections["precision"].get("type")
        if kind in ("mixed_precision", "autocast") and not sections["distributed_strategy"].get("zero1", True):
            raise TrainError(f"--config {self.path}: precision.type {kind} with distributed_strategy.zero1 false: NxD "
                             "keeps fp32 master weights only with ZeRO-1, so NxDT steps the bf16 weights themselves, "
                             "which nxdtrain does not; set zero1: true (or precision.type fp32)")

    def exp_manager(self, exp: dict[str, Any]) -> None:
        """NeMo's exp_manager directories and resume rule as options (module docstring)."""
        if exp.get("explicit_log_dir"):
            log_dir, key = str(exp["explicit_log_dir"]), "exp_manager.explicit_log_dir"
        else:
            log_dir = os.path.join(str(exp.get("exp_dir") or "nemo_experiments"), str(exp.get("name") or "default"))
            key = "exp_manager.exp_dir" if exp.get("exp_dir") else "exp_manager.name"
        if exp.get("create_checkpoint_callback", True):
            self.set("checkpoint_dir", os.path.join(log_dir, "checkpoints"), key)
        else:
            self.set("no_checkpoint", True, "exp_manager.create_checkpoint_callback")
        if exp.get("create_tensorboard_logger"):
            self.set("tensorboard", log_dir, "exp_manager.create_tensorboard_logger")
        start = exp.get("resume_from_checkpoint")
        if exp.get("resume_if_exists"):
            self.set("resume", AUTO, "exp_manager.resume_if_exists")
            if start:
                self.set("init", start, "exp_manager.resume_from_checkpoint")
        elif start:
            self.set("resume", start, "exp_manager.resume_from_checkpoint")

    def evaluation(self, found: dict[tuple[str, ...], Any]) -> None:
        """data.val_dir every trainer.val_check_interval steps, on trainer.limit_val_batches batches."""
        if not found:
            return
        val_dir = found.get(("data", "val_dir"))
        every, limit = found.get(("trainer", "val_check_interval")), found.get(("trainer", "limit_val_batches"))
        if not val_dir or limit in (0, 0.0):  # NxDT's recipes turn validation off this way
            self.ignored.extend(".".join(p) for p in found)
            return
        self.set("eval_data", val_dir, "data.val_dir")
        if isinstance(every, float) and not every.is_integer():
            raise TrainError(f"--config {self.path}: trainer.val_check_interval {every!r}: nxdtrain evaluates every N "
                             "steps (a whole number)")
        if every is not None:
            self.set("eval_every", int(every), "trainer.val_check_interval")
        if limit is not None and limit != 1.0:
            if isinstance(limit, float) and not limit.is_integer():
                raise TrainError(f"--config {self.path}: trainer.limit_val_batches {limit!r}: give a number of "
                                 "batches (a fraction of the validation set is not supported)")
            self.set("eval_batches", int(limit), "trainer.limit_val_batches")


# Other trainers' names for our options (Hugging Face TrainingArguments, torchtitan, NeMo): the nearest key of a
# name that looks nothing like ours.
SYNONYMS = {"learning_rate": "lr", "max_steps": "steps", "num_train_epochs": "epochs", "warmup_steps": "warmup",
            "micro_batch_size": "mbs", "per_device_train_batch_size": "mbs", "global_batch_size": "gbs",
            "batch_size": "gbs", "seq_length": "seq_len", "max_seq_length": "seq_len", "max_grad_norm": "clip_grad",
            "gradient_clip_val": "clip_grad", "lr_scheduler_type": "schedule", "output_dir": "checkpoint_dir",
            "save_steps": "checkpoint_freq", "save_total_limit": "keep", "logging_steps": "log_every",
            "eval_steps": "eval_every", "resume_from_checkpoint": "resume", "train_dir": "data", "dataset": "data",
            "tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp", "bf16": "precision"}


def _nearest(key: str, candidates: list[str]) -> str:
    """``key (nearest: K)``: a synonym of ours, else the candidate most alike (a top-level key is also compared
    with the last part of NxDT's nested keys: ``global_batch`` is nearest to ``data.global_batch_size``)."""
    if "." not in key and SYNONYMS.get(key) in candidates:
        return f"{key} (nearest: {SYNONYMS[key]})"
    pool = {c: c for c in candidates}
    if "." not in key:
        pool.update({".".join(p): p[-1] for p in (*NXDT_KEYS, *EVALUATION)})
    if not pool:
        return f"{key} (no near key)"
    score, best = max((difflib.SequenceMatcher(None, key, compared).ratio(), name) for name, compared in pool.items())
    return f"{key} (nearest: {best})" if score >= 0.6 else f"{key} (no near key)"
