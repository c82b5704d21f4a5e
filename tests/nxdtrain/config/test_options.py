"""Options: the pinned flag set, YAML (ours and NxDT-shaped), precedence, one-line errors."""

from __future__ import annotations

import pytest

from nxdtrain.cli import build_parser, load_config
from nxdtrain.config.options import TrainConfig
from nxdtrain.errors import TrainError

RUN_FLAGS = {
    "--config", "--steps", "--epochs", "--tensorboard", "--seed", "--precision", "--nproc", "--log-jsonl", "--export-hf", "--dist-timeout",
    "--device", "--log-every",
    "--tp", "--pp", "--kv-replicator", "--kv-size-multiplier", "--qkv-linear", "--no-qkv-linear", "--fuse-qkv",
    "--no-fuse-qkv", "--pp-schedule", "--zero1", "--no-zero1", "--sequence-parallel", "--no-sequence-parallel",
    "--shard-params", "--no-shard-params", "--hybrid-shard", "--offload-activations", "--no-offload-activations",
    "--activation-checkpointing", "--activations-checkpoint-granularity", "--recompute-modules",
    "--activations-checkpoint-recompute", "--context-parallel",
    "--context-parallel-size", "--ring-attention", "--no-ring-attention", "--ep", "--expert-model-parallel-size",
    "--optimizer", "--lr", "--min-lr", "--warmup", "--schedule", "--decay-steps", "--weight-decay", "--norm-weight-decay",
    "--no-norm-weight-decay", "--beta1",
    "--beta2", "--eps", "--clip-grad",
    "--data", "--seq-len", "--gbs", "--mbs", "--shuffle", "--no-shuffle",
    "--resume", "--weights-only", "--no-weights-only", "--hf-config", "--checkpoint-dir", "--checkpoint-freq", "--keep", "--async-save", "--no-async-save", "--xser",
    "--no-xser", "--optimizer-format", "--nxd-param-groups", "--no-checkpoint", "--init", "--eval-data", "--eval-every", "--eval-batches",
    "--long-rows", "--pad", "--no-pad", "--override-schedule", "--no-override-schedule", "--allow-high-loss", "--no-allow-high-loss",
    "--capacity-factor", "--moe-top-k", "--normalize-top-k-affinities", "--no-normalize-top-k-affinities",
    "--router-aux-loss-coef", "--output-router-logits", "--no-output-router-logits", "--aux-loss-scale",
    "--num-experts", "--override-moe", "--no-override-moe",
}
EXPORT_FLAGS = {"--tokenizer", "--quiet", "--json"}
EVERY_FLAGS = {"--every", "--watch"}  # from-dcp's of the same name (issue 43)


def subparser(command: str):
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices[command]  # type: ignore[attr-defined]


def test_flag_set_is_pinned():
    """Scripts depend on these names: a rename must be deliberate and show up here."""
    assert {s for a in subparser("run")._actions for s in a.option_strings} - {"-h", "--help"} == RUN_FLAGS
    assert [a.dest for a in subparser("export")._actions if not a.option_strings] == ["src", "out"]
    # export's flags are ckptconv to-hf's of the same name (issue 44)
    exported = {s for a in subparser("export")._actions for s in a.option_strings} - {"-h", "--help"}
    assert exported == EXPORT_FLAGS | EVERY_FLAGS
    from ckptconv.cli.main import build_parser as ckptconv_parser

    verbs = next(a for a in ckptconv_parser()._actions if a.dest == "command").choices  # type: ignore[attr-defined]
    assert EXPORT_FLAGS <= {s for a in verbs["to-hf"]._actions for s in a.option_strings}
    assert EVERY_FLAGS <= {s for a in verbs["from-dcp"]._actions for s in a.option_strings}


def test_yaml_nxdt_keys_then_flags(tmp_path, capsys):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(
        "lr: 1e-3\n"           # YAML 1.1 reads this as a string; the config makes it a float
        "distributed_strategy: {tensor_model_parallel_size: 2, pipeline_model_parallel_size: 2, kv_replicator: 2,"
        " zero1: true, sequence_parallel: true}\n"
        "data: {micro_batch_size: 2, global_batch_size: 16, seq_length: 512, train_dir: /data/train.jsonl}\n"
        "model:\n  fuse_qkv: true\n  weight_init_only: true\n"
        "  activations_checkpoint_granularity: selective\n  activations_checkpoint_recompute: [CoreAttention]\n"
        "  optim: {name: adamw_fp32OptState, weight_decay: 0.01, betas: [0.9, 0.98],"
        " sched: {name: LinearAnnealingWithWarmUp, warmup_steps: 10, max_steps: 40}}\n"
        "exp_manager: {resume_from_checkpoint: /fsx/llama-nxd, checkpoint_callback_params: {every_n_train_steps: 25,"
        " save_top_k: 3}}\n"
        "precision: {type: mixed_precision, master_weights: true}\n"
        "trainer: {max_steps: 40, gradient_clip_val: 0.5}\n"
    )
    args = build_parser().parse_args(["run", "--config", str(yaml_file), "--steps", "7", "--checkpoint-dir", "ck"])
    cfg = load_config(args)
    assert (cfg.steps, cfg.optim.lr, cfg.optim.clip_grad) == (7, 1e-3, 0.5)  # the flag beats trainer.max_steps
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.kv_replicator, cfg.parallel.zero1) == (2, 2, 2, True)
    assert (cfg.parallel.fuse_qkv, cfg.checkpoint.weights_only, cfg.checkpoint.resume) == (True, True, "/fsx/llama-nxd")
    assert (cfg.data.mbs, cfg.data.gbs, cfg.data.seq_len, cfg.data.data) == (2, 16, 512, "/data/train.jsonl")
    assert (cfg.optim.optimizer, cfg.optim.schedule, cfg.optim.warmup, cfg.optim.decay_steps) == (
        "adamw", "LinearAnnealingWithWarmUp", 10, 40)  # NxDT's schedule, as the file names it
    assert (cfg.optim.beta1, cfg.optim.beta2, cfg.optim.weight_decay) == (0.9, 0.98, 0.01)
    assert (cfg.checkpoint.checkpoint_freq, cfg.checkpoint.keep, cfg.precision) == (25, 3, "bf16")
    assert (cfg.parallel.sequence_parallel, cfg.parallel.activation_checkpointing) == (True, "selective")
    assert capsys.readouterr().err.strip() == (f"nxdtrain: {yaml_file}: NxDT keys that do not apply to nxdtrain, "
                                               "ignored: precision.master_weights")


@pytest.mark.parametrize("granularity,expected", [("full", "full"), ("null", "none"), ("Selective", "selective")])
def test_yaml_nxdt_checkpoint_granularity(tmp_path, granularity, expected):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(f"model: {{activations_checkpoint_granularity: {granularity}}}\n")
    args = build_parser().parse_args(["run", "--config", str(yaml_file), "--resume", "x", "--data", "synthetic"])
    assert load_config(args).parallel.activation_checkpointing == expected


def test_yaml_nxdt_recompute_other_modules_is_an_error(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("model: {activations_checkpoint_recompute: [CoreAttention, MLP]}\n")
    with pytest.raises(TrainError) as err:
        load_config(build_parser().parse_args(["run", "--config", str(yaml_file), "--resume", "x", "--data", "synthetic"]))
    assert str(err.value) == (f"--config {yaml_file}: model.activations_checkpoint_recompute ['CoreAttention', 'MLP']: "
                              "MLP is none of NxDT's modules nxdtrain recomputes: CoreAttention, LlamaMLP, "
                              "ActivationMultiplyMLP, LlamaRMSNorm, LlamaDecoderLayer")


def test_activation_checkpointing_flag_checks_its_value():
    with pytest.raises(TrainError) as err:
        TrainConfig.from_flat({"resume": "x", "data": "synthetic", "activation_checkpointing": "layers"})
    assert str(err.value) == "--activation-checkpointing must be one of none, selective, full, got 'layers'"


@pytest.mark.parametrize("options,message", [
    ({"resume": None}, "--resume PATH is required: a converted NxD directory, a checkpoint root, a tag, or auto"),
    ({"data": None}, "--data is required: a save_to_disk dataset dir, a .jsonl/.json(.gz) file, or a directory or "
                     "glob of those (an NxDT YAML's data.train_dir); --data synthetic trains on random tokens"),
    ({"gbs": 6, "mbs": 4}, "--gbs 6 must be a multiple of --mbs 4"),
    ({"fuse_qkv": True, "qkv_linear": False}, "--fuse-qkv needs --qkv-linear; drop --no-qkv-linear"),
    ({"optimizer": "adam"}, "--optimizer must be one of adamw, sgd, got 'adam'"),
    ({"min_lr": 1.0}, "--min-lr must be in [0, --lr 0.0003], got 1.0"),
    ({"export_hf": "out"}, "--export-hf needs --checkpoint-dir (the export reads the final checkpoint)"),
    ({"lr": "fast"}, "test: lr must be a float, got 'fast'"),
    ({"learning_rate": 1.0}, "test: unknown option 'learning_rate' (valid: "),
])
def test_errors_name_the_flag(options, message):
    with pytest.raises(TrainError) as info:
        TrainConfig.from_flat({"resume": "/ckpt", "data": "synthetic", **options}, source="test")
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


# Every leaf's default, as scripts rely on it (data: none since --data synthetic must be asked for).
DEFAULTS = {
    "steps": 1000, "epochs": None, "seed": 1234, "precision": "auto", "nproc": None, "log_jsonl": None,
    "tensorboard": None, "export_hf": None, "dist_timeout": 1800.0, "device": "auto", "log_every": 1, "tp": None, "pp": None,
    "kv_replicator": None, "qkv_linear": None, "fuse_qkv": None, "pp_schedule": "1f1b", "zero1": False,
    "shard_params": False, "hybrid_shard": None, "offload_activations": False,
    "sequence_parallel": False, "activation_checkpointing": "none", "recompute_modules": None,
    "ep": None, "context_parallel": 1, "ring_attention": True,
    "optimizer": "adamw", "lr": 0.0003, "min_lr": None, "warmup": 0, "schedule": "cosine", "decay_steps": None,
    "weight_decay": 0.0, "norm_weight_decay": False, "beta1": 0.9, "beta2": 0.95, "eps": 1e-08, "clip_grad": 1.0, "data": None, "seq_len": 1024,
    "long_rows": "cut", "pad": False, "gbs": 8, "mbs": 1, "shuffle": True, "eval_data": None, "eval_every": 0,
    "eval_batches": None, "resume": None, "init": None, "weights_only": False, "hf_config": None, "checkpoint_dir": None,
    "checkpoint_freq": 0, "keep": 2, "async_save": False, "xser": False, "no_checkpoint": False, "optimizer_format": "nxdtrain",
    "nxd_param_groups": None, "override_schedule": False, "allow_high_loss": False,
    "capacity_factor": None, "moe_top_k": None, "normalize_top_k_affinities": None, "router_aux_loss_coef": None,
    "output_router_logits": True, "aux_loss_scale": "transformers", "num_experts": None, "override_moe": False,
}
# Where a newcomer looks for each job's flags in `nxdtrain run --help`.
SECTION_OF = {
    "--resume": "model and layout", "--tp": "model and layout", "--pp": "model and layout",
    "--init": "model and layout", "--data": "data", "--seq-len": "data", "--gbs": "data", "--eval-data": "data",
    "--steps": "optimizer and schedule", "--lr": "optimizer and schedule", "--schedule": "optimizer and schedule",
    "--zero1": "parallelism", "--shard-params": "parallelism", "--context-parallel": "parallelism", "--activation-checkpointing": "parallelism",
    "--checkpoint-dir": "checkpoints", "--no-checkpoint": "checkpoints", "--keep": "checkpoints",
    "--export-hf": "checkpoints", "--log-jsonl": "logging", "--tensorboard": "logging",
    "--nproc": "device and launch", "--device": "device and launch", "--precision": "device and launch",
}


def test_defaults_are_pinned():
    from nxdtrain.config.options import leaf_fields

    assert {f.name: f.default for _, f in leaf_fields()} == DEFAULTS


def test_help_groups_every_flag_by_job_and_says_what_is_required():
    from nxdtrain.config.options import GROUPS, REQUIRED_USAGE, flag_of, leaf_fields

    run = subparser("run")
    sections = {g.title: {s for a in g._group_actions for s in a.option_strings}
                for g in run._action_groups if g.title in GROUPS}
    assert list(sections) == list(GROUPS)  # one section per job, in that order
    assert set().union(*sections.values()) == RUN_FLAGS - {"--config"}
    assert sum(len(flags) for flags in sections.values()) == len(RUN_FLAGS) - 1  # each flag in exactly one
    for flag, title in SECTION_OF.items():
        assert flag in sections[title], flag
    text = run.format_help()
    assert text.startswith(f"usage: nxdtrain run {REQUIRED_USAGE}\n")
    assert REQUIRED_USAGE == "--resume PATH|auto --data PATH|synthetic (--checkpoint-dir DIR | --no-checkpoint)"
    required = [flag_of(f) for _, f in leaf_fields() if f.metadata["required"]]
    assert sorted(required) == ["--checkpoint-dir", "--data", "--resume"]
    assert all(flag in REQUIRED_USAGE for flag in required)
    for title, flag in (("model and layout", "--resume"), ("data", "--data"), ("checkpoints", "--checkpoint-dir")):
        group = next(g for g in run._action_groups if g.title == title)
        assert group._group_actions[0].option_strings[0] == flag  # the required flag first in its section
        assert "Required: " + flag in group.description
    assert "Required: --data PATH, or --data synthetic for random tokens" in " ".join(text.split())


def test_tp_pp_help_says_another_layout_is_resharded():
    actions = {a.dest: a for a in subparser("run")._actions}
    for name in ("tp", "pp"):
        help_ = actions[name].help
        assert "must equal" not in help_
        assert f"a --resume saved at another {name} is resharded on load" in help_
