"""An NxDT YAML's ``model.moe`` as NxDT's HF Mixtral reads it (issue 41; NxDT 2.26's HFMixtralModule._get_model and
training_orchestrator.py, /work/notes/41-nxd-moe.md): every key of NxDT's two Mixtral examples in files of ours
(fixtures/nxdt/hf_mixtral_*.yaml), each key's effect, the keys NxDT defaults, and what is refused in one line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptconv.core.model_spec import ModelSpec
from nxdtrain.errors import TrainError
from nxdtrain.model.capacity import run_routing
from nxdtrain.model.moe import aux_loss
from tests.nxdtrain.config.test_yaml_config import config, error

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "nxdt"
# NxDT's HFMixtralModule defaults where model.moe lacks the key (not config.json's values)
MOE_KEYS = ("num_experts", "frequency", "dropout", "capacity_factor", "dropless", "routing_algorithm", "top_k",
            "output_router_logits", "router_aux_loss_coef", "normalize_top_k_affinities")


def spec(**config) -> ModelSpec:
    return ModelSpec.from_config({"model_type": "mixtral", "hidden_size": 16, "intermediate_size": 24,
                                  "num_local_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 64, **config})


def moe_file(tmp_path: Path, body: str, *flags: str):
    return config(tmp_path, f"resume: /x\ndata: synthetic\nmodel:\n  moe:\n{body}", *flags)


FULL = ("    num_experts: 4\n    top_k: 2\n    capacity_factor: 1.0\n    dropless: false\n"
        "    router_aux_loss_coef: 0.02\n")


@pytest.mark.parametrize("name", ["hf_mixtral_capacity.yaml", "hf_mixtral_dropless.yaml"])
def test_every_moe_key_of_nxdts_mixtral_examples_is_read(name, capsys):
    from nxdtrain.config.yaml_config import read_yaml

    text = (FIXTURES / name).read_text()
    assert all(re.search(rf"^    {k}: ", text, re.M) for k in MOE_KEYS)
    read = read_yaml(FIXTURES / name)
    dropless = "dropless" in name
    assert {k: read.values[k] for k in ("num_experts", "moe_top_k", "normalize_top_k_affinities",
                                        "router_aux_loss_coef", "output_router_logits", "aux_loss_scale",
                                        "capacity_factor")} == {
        "num_experts": 4, "moe_top_k": 2, "normalize_top_k_affinities": True, "router_aux_loss_coef": 0.01,
        "output_router_logits": True, "aux_loss_scale": "nxd", "capacity_factor": 0.0 if dropless else 1.5}
    assert not any("model.moe" in note for note in read.notes)  # acted on, none ignored


def test_absent_keys_take_nxdts_defaults_not_config_json(tmp_path):
    cfg = moe_file(tmp_path, "    num_experts: 4\n    top_k: 2\n    capacity_factor: 1.0\n")
    assert (cfg.moe.router_aux_loss_coef, cfg.moe.normalize_top_k_affinities, cfg.moe.output_router_logits) == (
        0.02, True, True)
    # top_k absent: NxDT's 1, which NxD refuses with its normalization on (validate_routed_experts_configs)
    cfg = moe_file(tmp_path, "    num_experts: 4\n    capacity_factor: 1.0\n")
    with pytest.raises(TrainError, match=r"^model.moe \(normalize_top_k_affinities absent: NxDT.s default True\) \(run.yaml\) with top_k 1: NxD refuses"):
        run_routing(spec(), cfg)
    # num_experts absent: NxDT's 1, not the checkpoint's 4
    cfg = moe_file(tmp_path, "    top_k: 2\n    capacity_factor: 1.0\n")
    with pytest.raises(TrainError) as info:
        run_routing(spec(), cfg)
    assert str(info.value) == ("model.moe (num_experts absent: NxDT's default 1) (run.yaml) 1: the checkpoint's config.json "
                               "has 4 experts; set it to 4")


def test_num_experts_not_the_checkpoints_is_refused_naming_both(tmp_path):
    cfg = moe_file(tmp_path, FULL.replace("num_experts: 4", "num_experts: 8"))
    with pytest.raises(TrainError, match=r"^model.moe.num_experts \(run.yaml\) .*config.json has 4 experts; set it "
                                         r"to 4$"):
        run_routing(spec(), cfg)


def test_top_k_differs_from_config_json_said_once(tmp_path):
    routing, notes = run_routing(spec(num_local_experts=4), moe_file(tmp_path, FULL.replace("top_k: 2", "top_k: 3")))
    assert routing is not None and routing.top_k == 3
    assert [n for n in notes if "num_experts_per_tok" in n] == [
        "model.moe.top_k (run.yaml) 3: each token goes to 3 experts (config.json's num_experts_per_tok: 2)"]


def test_router_aux_loss_coef_differs_from_config_json_said_once(tmp_path):
    routing, notes = run_routing(spec(router_aux_loss_coef=0.001), moe_file(tmp_path, FULL))
    assert routing is not None and routing.coef == 0.02
    assert "model.moe.router_aux_loss_coef (run.yaml) 0.02 (config.json's router_aux_loss_coef: 0.001)" in notes


def test_normalize_false_keeps_the_raw_probabilities(tmp_path):
    routing, notes = run_routing(spec(), moe_file(tmp_path, FULL + "    normalize_top_k_affinities: false\n"))
    assert routing is not None and routing.normalize is False
    assert any("not renormalized" in n for n in notes)


def test_output_router_logits_false_trains_without_aux_loss(tmp_path):
    from nxdtrain.config.options import DataConfig

    cfg = moe_file(tmp_path, FULL + "    output_router_logits: false\n")
    routing, _ = run_routing(spec(), cfg)
    assert aux_loss(spec(), DataConfig(data="synthetic"), inject=True, routing=routing) is None


def test_nxdt_file_uses_nxds_aux_loss_said_and_others_keep_transformers(tmp_path):
    """NxD's load_balancing_loss_func is transformers' / top_k: only an NxDT file's model.moe switches to it."""
    from nxdtrain.config.options import DataConfig

    routing, notes = run_routing(spec(), moe_file(tmp_path, FULL))
    nxd = aux_loss(spec(), DataConfig(data="synthetic"), inject=True, routing=routing)
    plain = aux_loss(spec(), DataConfig(data="synthetic"), inject=True, routing=run_routing(spec(), config(
        tmp_path, "resume: /x\ndata: synthetic\n"))[0])
    assert nxd is not None and plain is not None and (nxd.scale, plain.scale) == (0.5, 1.0)
    assert any("NxD's load_balancing_loss_func, transformers' / top_k (2)" in n for n in notes)
    # transformers' own definition, for the record: E * sum_e C_e P_e / R^2 (the value step_aux logs at scale 1)
    torch.manual_seed(0)
    logits = torch.randn(10, 4)
    import transformers.models.mixtral.modeling_mixtral as mixtral
    ref = mixtral.load_balancing_loss_func((logits,), 4, 2)
    probs = torch.softmax(logits, -1)
    counts = torch.bincount(torch.topk(probs, 2).indices.reshape(-1), minlength=4).float()
    assert torch.allclose(4 * (counts * probs.sum(0)).sum() / 10 ** 2 / 2, ref / 2)


def test_frequency_not_1_is_refused_in_one_line(tmp_path):
    assert error(tmp_path, "resume: /x\ndata: synthetic\nmodel:\n  moe:\n" + FULL + "    frequency: 2\n") == (
        f"--config {tmp_path / 'run.yaml'}: model.moe.frequency 2: NxDT's Mixtral makes only layers 0, 2, ... sparse "
        "and the others dense MLPs, which an HF Mixtral checkpoint does not have; nxdtrain trains frequency 1 "
        "(every layer sparse)")


def test_dropout_and_routing_algorithm_are_said_as_nxdt_ignores_them(tmp_path, capsys):
    moe_file(tmp_path, FULL + "    dropout: 0.1\n    routing_algorithm: sinkhorn\n")
    err = capsys.readouterr().err
    assert "model.moe.dropout 0.1: NxDT's HF Mixtral writes it to attention_dropout, which its attention never reads" in err
    assert "model.moe.routing_algorithm sinkhorn: NxDT's HF Mixtral always routes top-k" in err


def test_dropless_and_capacity_as_nxdts_orchestrator(tmp_path, capsys):
    cfg = moe_file(tmp_path, FULL.replace("dropless: false", "dropless: true"))
    assert cfg.moe.capacity_factor == 0.0
    assert "with dropless true: NxDT sets it to 0.0" in capsys.readouterr().err
    message = error(tmp_path, "resume: /x\ndata: synthetic\nmodel:\n  moe:\n" + FULL.replace("1.0", "0.0"))
    assert message.endswith("model.moe.capacity_factor 0.0 with dropless false: NxDT's dropping needs a capacity "
                            "factor > 0 (or dropless: true)")


def test_unknown_moe_key_names_the_nearest(tmp_path):
    assert "model.moe.capacity_factr (nearest: model.moe.capacity_factor)" in error(
        tmp_path, "resume: /x\ndata: synthetic\nmodel:\n  moe:\n" + FULL + "    capacity_factr: 1\n")


def test_moe_option_on_a_dense_model_is_refused(tmp_path):
    dense = ModelSpec.from_config({"model_type": "llama", "hidden_size": 16, "intermediate_size": 24,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                                   "vocab_size": 64})
    with pytest.raises(TrainError, match="^--capacity-factor: an MoE option, and the checkpoint has no experts$"):
        run_routing(dense, config(tmp_path, "resume: /x\ndata: synthetic\n", "--capacity-factor", "1"))


@pytest.mark.slow
def test_nxdt_mixtral_file_trains_with_only_its_paths_changed_and_resume_keeps_the_factor(tmp_path):
    import datasets

    from tests.nxdtrain.harness import convert
    from tests.nxdtrain.moe_reference import make_moe

    hf = make_moe(tmp_path / "hf", "mixtral")
    src = convert(hf, tmp_path / "nxd")
    rows = [[(3 * r + t) % 64 for t in range(16)] for r in range(32)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "tokenized"))
    text = (FIXTURES / "hf_mixtral_capacity.yaml").read_text()
    for key, value in {"exp_dir": tmp_path / "runs", "resume_from_checkpoint": src,
                       "train_dir": tmp_path / "tokenized", "model_config": hf / "config.json"}.items():
        text, count = re.subn(rf"^(\s*{key}: ).*$", rf"\g<1>{value}", text, flags=re.M)
        assert count == 1
    edited = tmp_path / "run.yaml"
    edited.write_text(text)
    argv = [sys.executable, "-m", "nxdtrain.cli", "run", "--config", str(edited), "--nproc", "2",
            "--gbs", "4", "--decay-steps", "10", "--steps", "2", "--precision", "fp32"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "model.moe.capacity_factor (run.yaml) 1.5: each expert takes at most" in run.stderr
    tag = next((tmp_path / "runs").glob("*/checkpoints/step_2"))
    record = torch.load(tag / "user_content.pt", weights_only=True)["run"]["moe"]
    assert record == {"capacity_factor": 1.5, "top_k": 2, "normalize": True, "aux_coef": 0.01, "aux_scale": "nxd"}
    again = subprocess.run([*argv[:-4], "--steps", "3", "--precision", "fp32", "--capacity-factor", "1.0"],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode != 0
    assert "--capacity-factor 1.5 -> 1.0; resume with the recorded values, or pass --override-moe" in again.stderr
    ok = subprocess.run([*argv[:-4], "--steps", "3", "--precision", "fp32", "--capacity-factor", "1.0",
                         "--override-moe"], capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr
    assert "--override-moe: the routing changes at this resume: --capacity-factor 1.5 -> 1.0" in ok.stderr
