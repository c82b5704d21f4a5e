"""Mistral, Qwen2 and Qwen3 where only Llama was tested: dp 2 + ZeRO-1, resume, resume at another layout,
``ckptconv reshard`` of a training tag, context parallelism (fp32, tiny models of tests/nxdtrain/harness.py).

Each family trains 4 AdamW steps at tp 2 x pp 2 once (its step-2 tag kept). (a) 2 steps + resume + 2 steps at the
same layout: losses and the step-4 model and optimizer files bitwise those of the uninterrupted run. Its step-2
tag is continued (b) directly at
another layout (Qwen2: tp 4 with kv_size_multiplier 2, so the K/V biases' moments gain replicas; Qwen3 and
Mistral: tp 1), (c) after ``ckptconv reshard`` to tp 1 x dp 2 with ZeRO-1: steps 3-4 and the exported weights
equal the uninterrupted run's within 1e-5. AdamW moments of a bias or a q/k norm placed on the wrong rows would
move those parameters by about lr = 1e-3, a fresh optimizer likewise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptconv.cli.main import main as ckptconv_main
from ckptconv.io.dcp import DcpCheckpoint
from nxdtrain.train import export
from tests.conftest import hf_state, warns_no_tokenizer
from tests.nxdtrain.checkpoint.test_resume import tree_bytes
from tests.nxdtrain.harness import run_world, train_options
from tests.nxdtrain.parallel.test_context import ADAMW
from tests.nxdtrain.test_parity import assert_matches_reference, train_with_and_without_zero1

FAMILIES = ["mistral", "qwen2", "qwen3"]
TOL = 1e-5
CP_TOL = 1e-6


def seq_len(family: str) -> int:
    return 32 if family == "mistral" else 16  # Mistral's rows are longer than its window of 16


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[str, float]:
    assert a.keys() == b.keys()
    return max(((k, float((a[k].float() - b[k].float()).abs().max())) for k in b), key=lambda kv: kv[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_dp2_zero1_trains_like_transformers(tmp_path, nxd_model, reference, family):
    """tp 2 x dp 2 with the AdamW state sharded over dp: losses and exported weights as the transformers class, and
    bitwise those of plain AdamW at dp 2."""
    options = train_options(optimizer="adamw", lr=1e-3, mbs=1, seq_len=seq_len(family))
    src = nxd_model(family, tp=2, pp=1, attention="qkv_linear", fuse_qkv=True)
    runs = train_with_and_without_zero1(tmp_path, src, options)
    (zero_log, zero), (plain_log, plain) = runs[True], runs[False]
    assert sorted(p.name for p in (tmp_path / "zero1/ckpt/step_3/optim").iterdir()) == [
        f"dp_rank_0{d}_tp_rank_0{t}_pp_rank_00.pt" for d in range(2) for t in range(2)]
    assert_matches_reference(zero_log, tmp_path / "zero1/hf", reference(family, **options), "adamw")
    assert [r["loss"] for r in zero_log] == [r["loss"] for r in plain_log]
    assert all(torch.equal(zero[k], plain[k]) for k in plain)


# --------------------------------------------------------------------------------------------
# Resume: the same layout bitwise, another layout (directly, or through `ckptconv reshard`) within 1e-5

SOURCE = dict(tp=2, pp=2, attention="qkv_linear", fuse_qkv=True)
OTHER_LAYOUT = {  # family: (world, layout flags of the resumed run)
    "mistral": (1, dict(tp=1, pp=1)),
    "qwen2": (4, dict(tp=4, pp=1, kv_replicator=2)),
    "qwen3": (2, dict(tp=1, pp=2)),
}


@pytest.fixture(scope="module", params=FAMILIES)
def straight(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, nxd_model: Any) -> dict:
    """4 uninterrupted AdamW steps at tp 2 x pp 2 keeping the tags of steps 2 and 4."""
    family = request.param
    root = tmp_path_factory.mktemp(f"straight-{family}")
    options = train_options(optimizer="adamw", steps=4, decay_steps=4, warmup=2, gbs=4, mbs=1,
                            seq_len=seq_len(family), checkpoint_freq=2, keep=2)
    log = run_world(4, resume=str(nxd_model(family, **SOURCE)), checkpoint_dir=str(root / "ckpt"),
                    log_jsonl=str(root / "log.jsonl"), tp=2, pp=2, **options)
    with warns_no_tokenizer():
        export(root / "ckpt/step_4", root / "hf")
    return {"family": family, "log": log, "root": root, "options": options, "weights": hf_state(root / "hf")}


def _continue(straight: dict, tmp: Path, resume: Path, nproc: int, **layout: Any) -> list[dict]:
    log = run_world(nproc, resume=str(resume), checkpoint_dir=str(tmp / "ckpt"), log_jsonl=str(tmp / "log.jsonl"),
                    **{**straight["options"], **layout})
    assert [r["step"] for r in log] == [3, 4]
    return log


def _assert_continues_within_tol(straight: dict, tmp: Path, log: list[dict]) -> None:
    for mine, theirs in zip(log, straight["log"][2:], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=TOL), (mine, theirs)
        assert mine["lr"] == theirs["lr"]
    with warns_no_tokenizer():
        export(tmp / "ckpt/step_4", tmp / "hf")
    key, worst = _max_diff(hf_state(tmp / "hf"), straight["weights"])
    assert worst <= TOL, f"{straight['family']}: {key} differs from the uninterrupted run by {worst}"


def test_resume_at_the_same_layout_is_bitwise(straight, tmp_path, nxd_model):
    """2 steps, then a resume of that run's checkpoint directory for 2 more: the 4 uninterrupted steps, bitwise."""
    first = run_world(4, resume=str(nxd_model(straight["family"], **SOURCE)), checkpoint_dir=str(tmp_path / "ckpt"),
                      log_jsonl=str(tmp_path / "first.jsonl"), tp=2, pp=2, **{**straight["options"], "steps": 2})
    log = _continue(straight, tmp_path, tmp_path / "ckpt", 4, tp=2, pp=2)
    for key in ("loss", "lr", "grad_norm", "consumed_samples"):
        assert [r[key] for r in first + log] == [r[key] for r in straight["log"]], key
    for part in ("model", "optim"):
        assert tree_bytes(tmp_path / "ckpt/step_4" / part) == tree_bytes(straight["root"] / "ckpt/step_4" / part)


def test_resume_directly_at_another_layout(straight, tmp_path):
    nproc, layout = OTHER_LAYOUT[straight["family"]]
    log = _continue(straight, tmp_path, straight["root"] / "ckpt/step_2", nproc, **layout)
    _assert_continues_within_tol(straight, tmp_path, log)


def test_ckptconv_reshard_of_a_training_tag(straight, tmp_path):
    """`ckptconv reshard` moves the family's weights and AdamW moments to tp 1 x dp 2 with ZeRO-1."""
    out = tmp_path / "tag"
    assert ckptconv_main(["reshard", str(straight["root"] / "ckpt/step_2"), str(out), "--tp", "1", "--pp", "1",
                          "--dp", "2", "--zero1", "--quiet"]) == 0
    assert sorted(p.name for p in (out / "optim").iterdir()) == [
        "dp_rank_00_tp_rank_00_pp_rank_00.pt", "dp_rank_01_tp_rank_00_pp_rank_00.pt"]
    log = _continue(straight, tmp_path, out, 2, tp=1, pp=1, zero1=True)
    _assert_continues_within_tol(straight, tmp_path, log)


def test_to_dcp_of_a_training_tag_names_the_family(straight, tmp_path, capsys):
    """TorchTitan 0.3.0 has no model for Mistral or Qwen2: refused with or without the tag's optimizer state, naming
    the families it has. Qwen3's tag goes into its qwen3 model with the AdamW state (values: tests/test_dcp.py and
    the TorchTitan lane)."""
    names = {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
    family, tag = straight["family"], str(straight["root"] / "ckpt/step_2")
    if family == "qwen3":
        assert ckptconv_main(["to-dcp", tag, str(tmp_path / "dcp"), "--quiet"]) == 0
        keys = DcpCheckpoint(tmp_path / "dcp").keys()
        assert "tok_embeddings.weight" in keys and any(k.startswith("optimizer.state.") for k in keys), keys[:8]
        return
    for flags in ([], ["--weights-only"]):
        assert ckptconv_main(["to-dcp", tag, str(tmp_path / "dcp"), "--quiet", *flags]) == 1
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"ckptconv: error: TorchTitan 0.3.0 has no model for {names[family]} (model_type '{family}'); the "
            "families it has: llama (llama3), qwen3 (qwen3), qwen3_moe (qwen3), deepseek_v3 (deepseek_v3), gpt_oss (gpt_oss)")
        assert not (tmp_path / "dcp").exists()


# --------------------------------------------------------------------------------------------
# Context parallelism: cp 2 trains the model cp 1 trains (Mistral only where its window covers the rows)

CP_CASES = {
    # name: (family, tp, seq_len)
    "qwen2-cp2": ("qwen2", 1, 16),
    "qwen3-tp2-cp2": ("qwen3", 2, 16),
    "mistral-window-covers-rows-cp2": ("mistral", 1, 16),
}


@pytest.mark.parametrize("name", list(CP_CASES))
def test_cp2_equals_cp1(tmp_path, hf_model, nxd_model, name):
    family, tp, rows = CP_CASES[name]
    options = train_options(mbs=2, seq_len=rows, **ADAMW)
    src = nxd_model(family, tp=tp, pp=1, attention="qkv_linear")
    logs, states = [], []
    for cp in (1, 2):
        run = tmp_path / f"cp{cp}"
        logs.append(run_world(tp * cp, resume=str(src), tp=tp, context_parallel=cp, checkpoint_dir=str(run / "ckpt"),
                              log_jsonl=str(run / "log.jsonl"), **options))
        with warns_no_tokenizer():
            export(run / "ckpt", run / "hf")
        states.append(hf_state(run / "hf"))
    losses = [(a["loss"], b["loss"]) for a, b in zip(*logs, strict=True)]
    assert len(losses) == 3 and max(abs(a - b) for a, b in losses) <= CP_TOL, losses
    key, worst = _max_diff(states[1], states[0])
    assert worst <= CP_TOL, f"{key}: cp 2 weights differ from cp 1 by {worst}"
    assert _max_diff(states[0], hf_state(hf_model(family)))[1] > 100 * CP_TOL  # training moved the weights


# --------------------------------------------------------------------------------------------
# A padded vocabulary through a bf16 run: the masters carry the padding, their export strips it


def test_masters_export_of_a_padded_bf16_run(tmp_path, nxd_model):
    """1003 tokens at tp 2 (1004 rows), bf16 with fp32 masters, ZeRO-1 over dp 2: `to-hf --masters --dtype keep`
    gives the masters' 1003 real rows in fp32, `--no-masters` their bf16 rounding (the shards)."""
    from ckptconv.commands.api import RunOptions, to_hf
    from ckptconv.io.nxd_read import load_shard
    from ckptconv.training.nxdtrain_format.state import MASTER, state_key
    from nxdtrain.checkpoint.tags import optim_file

    src = nxd_model("vocab1003", tp=2, pp=1, attention="qkv_linear", fuse_qkv=True)
    run_world(4, resume=str(src), tp=2, zero1=True, checkpoint_dir=str(tmp_path / "ckpt"),
              log_jsonl=str(tmp_path / "log.jsonl"), **train_options(optimizer="adamw", steps=2, precision="bf16"))
    tag = tmp_path / "ckpt/step_2"
    quiet = RunOptions(quiet=True)
    with warns_no_tokenizer():
        to_hf(tag, tmp_path / "masters", masters=True, dtype="keep", options=quiet)
    with warns_no_tokenizer():
        to_hf(tag, tmp_path / "shards", masters=False, dtype="keep", options=quiet)
    masters, shards = hf_state(tmp_path / "masters"), hf_state(tmp_path / "shards")
    embed = "model.embed_tokens.weight"
    assert masters[embed].shape == shards[embed].shape == (1003, 64)
    assert masters[embed].dtype == torch.float32 and shards[embed].dtype == torch.bfloat16
    assert all(torch.equal(masters[k].to(torch.bfloat16), shards[k]) for k in masters)
    assert not torch.equal(masters[embed], shards[embed].float())  # the masters are not the widened shards
    # Rank 1's 502 rows end in the padding row: its master (wherever ZeRO-1 put it) stays zero and is not exported.
    parts = [torch.load(optim_file(tag, tp_rank=1, pp_rank=0, dp_rank=d), weights_only=True) for d in range(2)]
    held = [p[state_key(embed, MASTER)] for p in parts if state_key(embed, MASTER) in p]
    rank1 = torch.cat([h.reshape(-1) for h in held]) if len(held) > 1 else held[0].reshape(-1)
    rows = rank1[:502 * 64].reshape(502, 64)
    assert not rows[501].any() and torch.equal(rows[:501], masters[embed][502:])
    assert load_shard(tag / "model/dp_rank_00_tp_rank_01_pp_rank_00.pt")[embed].shape == (502, 64)
