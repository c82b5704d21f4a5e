"""NxDT's example configs as NxDT reads them: OmegaConf's interpolation forms, every key of NxDT's hf_llama* examples
acted on, listed as not applying, or refused; do_layer_norm_weight_decay exactly as NxDT's hf models group AdamW; the
recompute module names; and files in NxDT's key structure (fixtures/nxdt/, our values) trained end to end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from nxdtrain.config.options import OptimConfig
from nxdtrain.errors import TrainError
from nxdtrain.optim import Optimizer
from tests.nxdtrain.config.test_yaml_config import config, error

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "fixtures" / "nxdt"
PATH_KEYS = ("exp_dir", "resume_from_checkpoint", "train_dir", "model_config")


# --------------------------------------------------------------------------------------------
# Interpolation: OmegaConf's


def test_every_interpolation_form_of_nxdt_examples(tmp_path, monkeypatch):
    monkeypatch.setenv("NXDT_TEST_DATA", "/fsx/rows")
    cfg = config(tmp_path, "resume: /x\n"
                           "trainer: {max_steps: 30}\n"
                           "distributed_strategy: {tensor_model_parallel_size: 4, pipeline_model_parallel_size: 2}\n"
                           "exp_manager: {checkpoint_callback_params: {every_n_train_steps: '${multiply:"
                           "${distributed_strategy.tensor_model_parallel_size}, "
                           "${distributed_strategy.pipeline_model_parallel_size}}'}}\n"
                           "data: {train_dir: '${oc.env:NXDT_TEST_DATA}', seq_length: '${model.encoder_seq_length}'}\n"
                           "model:\n  encoder_seq_length: 64\n  max_position_embeddings: ${.encoder_seq_length}\n"
                           "  optim: {lr: 3e-4, sched: {name: CosineAnnealing, max_steps: '${trainer.max_steps}'}}\n",
                 "--checkpoint-dir", str(tmp_path / "ck"))
    assert (cfg.checkpoint.checkpoint_freq, cfg.data.data, cfg.data.seq_len) == (8, "/fsx/rows", 64)
    assert (cfg.optim.lr, cfg.optim.decay_steps, cfg.steps) == (3e-4, 30, 30)  # 3e-4: a float, as OmegaConf reads it


def test_a_relative_interpolation_is_a_sibling(tmp_path):
    cfg = config(tmp_path, "resume: /x\ndata: {seq_length: '${model.encoder_seq_length}', train_dir: synthetic}\n"
                           "model: {encoder_seq_length: 128, max_position_embeddings: '${.encoder_seq_length}',"
                           " optim: {lr: 0.002, sched: {name: CosineAnnealing, min_lr: '${..lr}'}}}\n")
    assert (cfg.data.seq_len, cfg.optim.min_lr) == (128, 0.002)  # ${..lr}: the parent's lr
    message = error(tmp_path, "resume: /x\ndata: synthetic\nmodel: {max_position_embeddings: '${.encoder_seq_len}',"
                              " encoder_seq_length: 16}\n")
    assert message == (f"--config {tmp_path / 'run.yaml'}: model.max_position_embeddings: '${{.encoder_seq_len}}' refers "
                       "to .encoder_seq_len, which the file does not have")


def test_no_resolver_but_nxdts_runs_anything(tmp_path):
    message = error(tmp_path, "resume: /x\ndata: synthetic\nseed: '${eval:1+1}'\n")
    assert message.startswith(f"--config {tmp_path / 'run.yaml'}: seed: '${{eval:1+1}}' Unsupported interpolation type "
                              "eval")


# --------------------------------------------------------------------------------------------
# Every key of NxDT's hf_llama* example configs (Release 2.20 to 2.26), by what nxdtrain does with it

ACTED = ["trainer.max_steps", "trainer.max_epochs", "trainer.gradient_clip_val", "trainer.log_every_n_steps",
         "trainer.val_check_interval", "trainer.limit_val_batches", "data.val_dir",
         "exp_manager.exp_dir", "exp_manager.name", "exp_manager.explicit_log_dir",
         "exp_manager.create_tensorboard_logger", "exp_manager.create_checkpoint_callback",
         "exp_manager.resume_if_exists", "exp_manager.resume_ignore_no_checkpoint", "exp_manager.resume_from_checkpoint",
         "exp_manager.save_xser", "exp_manager.checkpoint_callback_params.every_n_train_steps",
         "exp_manager.checkpoint_callback_params.save_top_k", "exp_manager.async_checkpointing",
         "distributed_strategy.tensor_model_parallel_size", "distributed_strategy.pipeline_model_parallel_size",
         "distributed_strategy.virtual_pipeline_model_parallel_size", "distributed_strategy.context_parallel_size",
         "distributed_strategy.zero1", "distributed_strategy.sequence_parallel", "distributed_strategy.kv_replicator",
         "data.micro_batch_size", "data.global_batch_size", "data.seq_length", "data.train_dir",
         "model.encoder_seq_length", "model.qkv_linear", "model.fuse_qkv", "model.weight_init_only",
         "model.activations_checkpoint_granularity", "model.activations_checkpoint_recompute",
         "model.activations_checkpoint_recompute_mlp", "model.fusions.ring_attention", "model.fusions.flash_attention",
         "model.do_layer_norm_weight_decay", "model.optim.name", "model.optim.lr", "model.optim.weight_decay",
         "model.optim.betas", "model.optim.sched.name", "model.optim.sched.warmup_steps",
         "model.optim.sched.max_steps", "model.optim.sched.min_lr", "model.optim.sched.constant_steps",
         "precision.type", "seed"]
NOT_APPLYING = ["name", "model_source", "compiler_flags", "compiler_cache_url", "aync_exec_max_inflight_requests",
                "bucket_size_collectives", "neuron_rt_exec_timeout", "neuron_experimental_compress_rg",
                "trainer.devices", "trainer.num_nodes", "trainer.check_val_every_n_epoch", "trainer.num_sanity_val_steps",
                "trainer.limit_test_batches", "trainer.lnc", "trainer.sequential_move_factor", "trainer.vnc",
                "exp_manager.log_local_rank_0_only", "exp_manager.log_parameter_norm", "exp_manager.log_gradient_norm",
                "exp_manager.load_xser", "exp_manager.save_bf16",
                "exp_manager.enable_recovery_time_instrumentation", "exp_manager.ckpt_ptl_version",
                "exp_manager.checkpoint_callback_params.monitor", "exp_manager.checkpoint_callback_params.mode",
                "exp_manager.checkpoint_callback_params.save_last", "exp_manager.checkpoint_callback_params.filename",
                "exp_manager.checkpoint_callback_params.model_parallel_size",
                "exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt",
                "data.dev_choose_samples", "data.tokenizer.type", "data.packing",
                "model.model_config", "model.max_position_embeddings", "model.num_layers", "model.hidden_size",
                "model.rope_theta", "model.use_cpu_initialization", "model.pipeline_cuts", "model.transpose_nki_inputs",
                "model.fusions.softmax", "model.optim.capturable", "precision.master_weights", "precision.fp32_grad_acc",
                "precision.xla_use_bf16", "precision.xla_downcast_bf16", "precision.neuron_rt_stochastic_rounding_en",
                "precision.parallel_layers_reduce_dtype"]
ALIGNMENT = ["model_alignment_strategy.dpo.kl_beta", "model_alignment_strategy.dpo.loss_type",
             "model_alignment_strategy.dpo.max_prompt_length", "model_alignment_strategy.dpo.max_dpo_prompt_length",
             "model_alignment_strategy.dpo.precompute_ref_log_probs", "model_alignment_strategy.dpo.truncation_mode",
             "model_alignment_strategy.orpo.beta", "model_alignment_strategy.orpo.max_prompt_length",
             "model_alignment_strategy.orpo.truncation_mode", "model_alignment_strategy.sft.packing",
             "model_alignment_strategy.peft.lora_rank", "model_alignment_strategy.peft.lora_alpha",
             "model_alignment_strategy.peft.lora_dropout", "model_alignment_strategy.peft.lora_bias",
             "model_alignment_strategy.peft.lora_verbose", "model_alignment_strategy.peft.target_modules",
             "model_alignment_strategy.peft.load_lora_from_ckpt", "model_alignment_strategy.peft.save_lora_base",
             "model_alignment_strategy.peft.merge_lora", "model_alignment_strategy.peft.merge_sharded_lora",
             "model_alignment_strategy.peft.save_lora_config_adapter", "data.alignment_strategy.dpo.kl_beta",
             "data.alignment_strategy.sft.packing", "data.use_sft_style_data_module"]


def _yaml(dotted: str, value: str) -> str:
    parts = dotted.split(".")
    return "".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(parts[:-1])) + f"{'  ' * (len(parts) - 1)}{parts[-1]}: {value}\n"


def _file_with(key: str) -> str:
    """A run's file holding ``key`` (and data: a data.* key goes beside train_dir)."""
    if key.startswith("data."):
        return "resume: /x\n" + _yaml(key, "1") + "  train_dir: synthetic\n"
    return "resume: /x\ndata: synthetic\n" + _yaml(key, "1")


@pytest.mark.parametrize("key", NOT_APPLYING)
def test_a_key_that_does_not_apply_is_listed_once(tmp_path, capsys, key):
    config(tmp_path, _file_with(key))
    err = capsys.readouterr().err
    assert err.count("NxDT keys that do not apply to nxdtrain, ignored:") == 1 and key in err


@pytest.mark.parametrize("key", ALIGNMENT)
def test_alignment_configs_are_refused_in_one_line(tmp_path, key):
    assert error(tmp_path, _file_with(key)) == (
        f"--config {tmp_path / 'run.yaml'}: {key}: NxDT's alignment training (SFT, DPO, ORPO, LoRA) is not supported; "
        "nxdtrain continues causal-LM pretraining only")


def test_the_acted_keys_are_nxdtrains_own():
    from nxdtrain.config.yaml_config import EVALUATION, EXP_MANAGER, NXDT_KEYS, RECOMPUTE_KEYS
    known = {".".join(k) for k in (*NXDT_KEYS, *EVALUATION, *RECOMPUTE_KEYS)} | {f"exp_manager.{k}" for k in EXP_MANAGER}
    assert [k for k in ACTED if k not in known and k != "seed"] == []


# --------------------------------------------------------------------------------------------
# What the math keys do


@pytest.mark.parametrize("value,decays", [("true", False), ("false", True)])
def test_do_layer_norm_weight_decay_groups_as_nxdts_hf_models(tmp_path, value, decays):
    """NxDT's hf models (hf_models/base_model.py): true adds 'norm' to the no-decay names, false decays them."""
    cfg = config(tmp_path, f"resume: /x\ndata: synthetic\nmodel: {{do_layer_norm_weight_decay: {value}}}\n")
    assert cfg.optim.norm_weight_decay is decays


def test_weight_decay_is_the_0_01_nxdts_hf_models_give_their_decayed_group(tmp_path, capsys):
    """NxDT's hf models build their param groups with weight_decay 0.01 (utils/model_utils.py), which beats
    model.optim.weight_decay; said once when the file says otherwise; --weight-decay still overrides."""
    text = "resume: /x\ndata: synthetic\nmodel: {optim: {name: adamw, lr: 0.001, weight_decay: 0.1}}\n"
    assert config(tmp_path, text).optim.weight_decay == 0.01
    assert "model.optim.weight_decay 0.1: NxDT's HF models decay with 0.01 whatever this key says" in capsys.readouterr().err
    assert config(tmp_path, text, "--weight-decay", "0.1").optim.weight_decay == 0.1
    capsys.readouterr()
    same = "resume: /x\ndata: synthetic\nmodel: {optim: {name: adamw, lr: 0.001, weight_decay: 0.01}}\n"
    assert config(tmp_path, same).optim.weight_decay == 0.01
    assert "whatever this key says" not in capsys.readouterr().err


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.proj = nn.Parameter(torch.randn(4, 3, generator=g))
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.rand(3, generator=g) + 0.5)
        self.down = nn.Parameter(torch.randn(3, 4, generator=g))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.rand(4, generator=g) + 0.5)


@pytest.mark.parametrize("norm_weight_decay", [True, False])
def test_norm_weight_decay_is_torch_adamw_with_the_norms_in_the_decayed_group(norm_weight_decay):
    model, reference = _Tiny(), _Tiny()
    cfg = OptimConfig(lr=0.05, weight_decay=0.3, beta1=0.8, beta2=0.9, norm_weight_decay=norm_weight_decay)
    ours = Optimizer(model, cfg, initial={})
    ref = dict(reference.named_parameters())
    norms = [ref["input_layernorm.weight"], ref["norm.weight"]]
    groups = ([{"params": [ref["proj"], ref["down"], *norms], "weight_decay": 0.3}] if norm_weight_decay else
              [{"params": [ref["proj"], ref["down"]], "weight_decay": 0.3}, {"params": norms, "weight_decay": 0.0}])
    torch_adamw = torch.optim.AdamW(groups, lr=0.05, betas=(0.8, 0.9), eps=1e-8)
    g = torch.Generator().manual_seed(9)
    for _ in range(2):
        grads = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
            ref[name].grad = grads[name].clone()
        ours.step(0.05)
        torch_adamw.step()
    for name, p in model.named_parameters():
        assert torch.equal(p, ref[name]), name
    untouched = _Tiny()
    # the norms moved by decay only where asked: without it they equal torch's AdamW with no decay on them (above),
    # and the two choices differ
    assert not torch.equal(untouched.norm.weight, model.norm.weight)


def test_nxdts_grouping_with_the_key_false_is_a_param_group_rule():
    """NxD's format by rule ``bias`` (NxDT's groups with do_layer_norm_weight_decay false), written and read back."""
    from ckptconv.training.nxd_format.ranks import index_names
    from ckptconv.training.nxd_format.write import nxd_groups

    names = ["model.layers.0.mlp.w", "model.layers.0.input_layernorm.weight", "model.norm.weight", "lm_head.weight"]
    assert nxd_groups(names, "bias") == [names, []]
    shapes = {names[0]: (4, 3), names[1]: (3,), names[2]: (3,), names[3]: (5, 3)}
    order, naming = index_names(names, shapes, [4, 0], [shapes[n] for n in names], "t")
    assert order == names  # bias-LayerNorm names a Llama's groups the same way: either is this grouping
    assert naming in ("names containing 'bias' in the no-decay group",
                      "names containing 'bias' or 'LayerNorm' in the no-decay group")


def test_norm_weight_decay_refuses_biases():
    model = nn.Linear(3, 2)
    with pytest.raises(TrainError, match=r"^--norm-weight-decay: the model has biases \(bias, \.\.\.\), which NxDT "):
        Optimizer(model, OptimConfig(weight_decay=0.1, norm_weight_decay=True), initial={})


@pytest.mark.parametrize("text,modules", [
    ("activations_checkpoint_granularity: selective, activations_checkpoint_recompute: [CoreAttention, LlamaMLP]",
     ("CoreAttention", "LlamaMLP")),
    ("activations_checkpoint_granularity: selective, activations_checkpoint_recompute: [LlamaRMSNorm, "
     "ActivationMultiplyMLP]", ("LlamaRMSNorm", "ActivationMultiplyMLP")),
    ("activations_checkpoint_granularity: selective, activations_checkpoint_recompute: null", ()),
    ("activations_checkpoint_granularity: selective, activations_checkpoint_recompute_mlp: true, "
     "encoder_seq_length: 8192", ("CoreAttention", "LlamaMLP")),
    ("activations_checkpoint_granularity: selective, activations_checkpoint_recompute_mlp: true, "
     "encoder_seq_length: 4096", ("CoreAttention",)),
    ("activations_checkpoint_granularity: null, fusions: {flash_attention: false}", ("CoreAttention",)),
    ("activations_checkpoint_granularity: null, fusions: {flash_attention: true}", ()),
])
def test_what_nxdt_recomputes(tmp_path, text, modules):
    cfg = config(tmp_path, f"resume: /x\ndata: synthetic\nmodel: {{{text}}}\n")
    assert cfg.parallel.modules() == modules
    assert cfg.parallel.activation_checkpointing == ("selective" if modules else "none")


@pytest.mark.parametrize("kind,message", [
    ("bf16SR", "precision.type 'bf16SR': nxdtrain has NxDT's fp32, mixed_precision, autocast (bf16 weights with fp32 "
               "master weights), not stochastic rounding or manual precision"),
    ("manual", "precision.type 'manual': nxdtrain has NxDT's fp32, mixed_precision, autocast (bf16 weights with fp32 "
               "master weights), not stochastic rounding or manual precision"),
])
def test_precision_types_nxdtrain_does_not_have(tmp_path, kind, message):
    assert error(tmp_path, f"resume: /x\ndata: synthetic\nprecision: {{type: {kind}}}\n") == (
        f"--config {tmp_path / 'run.yaml'}: {message}")


def test_combinations_nxdt_reads_differently_are_refused(tmp_path):
    path = tmp_path / "run.yaml"
    assert error(tmp_path, "resume: /x\ndata: synthetic\ntrainer: {max_steps: 10}\n"
                           "model: {optim: {sched: {max_steps: 20}}}\n") == (
        f"--config {path}: model.optim.sched.max_steps 20: NxDT decays over trainer.max_steps (10) whatever this says; "
        "set it to ${trainer.max_steps}")
    assert error(tmp_path, "resume: /x\ndata: synthetic\nprecision: {type: mixed_precision}\n"
                           "distributed_strategy: {zero1: false}\n").startswith(
        f"--config {path}: precision.type mixed_precision with distributed_strategy.zero1 false: NxD keeps fp32 master")
    for name, ours in (("adamw", "adamw"), ("adamw_fp32OptState", "adamw")):
        assert config(tmp_path, f"resume: /x\ndata: synthetic\nmodel: {{optim: {{name: {name}}}}}\n").optim.optimizer == ours
    assert "nxdtrain has NxDT's adamw and adamw_fp32OptState" in error(
        tmp_path, "resume: /x\ndata: synthetic\nmodel: {optim: {name: adamw_x}}\n")


# --------------------------------------------------------------------------------------------
# Files in NxDT's key structure, trained with only their paths changed


def _edited(tmp_path: Path, fixture: Path, paths: dict[str, object]) -> Path:
    text = fixture.read_text()
    for key, value in paths.items():
        text, count = re.subn(rf"^(\s*{key}: ).*$", rf"\g<1>{value}", text, flags=re.M)
        assert count == 1, key
    assert sum(a != b for a, b in zip(fixture.read_text().splitlines(), text.splitlines(), strict=True)) == len(paths)
    edited = tmp_path / fixture.name
    edited.write_text(text)
    return edited


@pytest.mark.parametrize("fixture,recompute,norms", [
    ("hf_llama3_8B_trn2.yaml", "LlamaRMSNorm,ActivationMultiplyMLP", True),
    ("hf_llama3_70B_nxdt220.yaml", "CoreAttention,LlamaMLP", False),
])
def test_nxdt_structured_files_train_with_only_their_paths_changed(tmp_path, nxd_model, hf_model, fixture, recompute,
                                                                   norms):
    import datasets

    src = nxd_model("gqa2", tp=2, pp=1, attention="qkv_linear", fuse_qkv=True)
    rows = [[(3 * r + t) % 128 for t in range(16)] for r in range(16)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "tokenized"))
    edited = _edited(tmp_path, FIXTURES / fixture, {
        "exp_dir": tmp_path / "runs", "resume_from_checkpoint": src, "train_dir": tmp_path / "tokenized",
        "model_config": hf_model("gqa2") / "config.json"})
    argv = [sys.executable, "-m", "nxdtrain.cli", "run", "--config", str(edited), "--nproc", "2", "--tp", "2",
            "--pp", "1", "--kv-replicator", "1", "--gbs", "4", "--seq-len", "16", "--steps", "2"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "do_layer_norm_weight_decay" not in run.stderr and "unknown keys" not in run.stderr
    tags = sorted((tmp_path / "runs").glob("*/checkpoints/step_2"))
    assert len(tags) == 1
    options = torch.load(tags[0] / "user_content.pt", weights_only=True)
    record = options["run"]
    assert record["norm_weight_decay"] is norms
    flat = options["options"]
    assert (flat["recompute_modules"], flat["activation_checkpointing"]) == (recompute, "selective")
    # a changed choice on resume is refused like a changed schedule
    flag = "--no-norm-weight-decay" if norms else "--norm-weight-decay"
    again = subprocess.run([*argv[:-1], "3", flag], capture_output=True, text=True, timeout=600)
    assert again.returncode != 0
    assert (f"weight decay on norm weights {norms} -> {not norms}; resume with the recorded values "
            "(--norm-weight-decay/--no-norm-weight-decay (NxDT: model.do_layer_norm_weight_decay))") in again.stderr
    assert json.loads((tags[0] / "ckptconv.json").read_text())
