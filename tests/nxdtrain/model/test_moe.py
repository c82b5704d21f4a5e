"""nxdtrain trains Mixtral and Qwen3-MoE like their transformers classes (issue 30): the sparse block on NxD's
stacked experts, the router's aux loss, expert parallelism carved out of dp with all-to-all dispatch.

3 SGD steps (AdamW where named) of fp32 tiny models, 2 micro-batches per dp rank: the logged cross-entropy and
aux loss within 1e-5 of the reference's, the exported weights within 1e-5 (AdamW 1e-4)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nxdtrain.config.options import TrainConfig
from nxdtrain.train import export
from tests.conftest import warns_no_tokenizer
from tests.nxdtrain.harness import convert, run_world, train_options
from tests.nxdtrain.moe_reference import make_moe, train_moe_reference

LOSS_TOL = 1e-5
WEIGHT_TOL = {"sgd": 1e-5, "adamw": 1e-4}
REF_KEYS = ("optimizer", "lr", "min_lr", "warmup", "schedule", "decay_steps", "weight_decay", "clip_grad", "data",
            "seq_len", "gbs", "mbs", "steps", "seed", "shuffle")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """``moe(family, coef)``: (HF dir, NxD dir at tp1 ep1, reference(options))."""
    root = tmp_path_factory.mktemp("moe-train")
    made: dict[Any, Any] = {}

    def get(family: str, coef: float = 0.02) -> tuple[Path, Path, Any]:
        if (family, coef) not in made:
            hf = make_moe(root / f"{family}-{coef}", family, coef=coef)
            refs: dict[str, Any] = {}

            def reference(**options: Any) -> Any:
                key = repr(sorted((k, v) for k, v in options.items() if k in REF_KEYS))
                if key not in refs:
                    cfg = TrainConfig.from_flat({k: v for k, v in options.items() if k in REF_KEYS} | {"resume": "x"})
                    refs[key] = train_moe_reference(hf, cfg, root / f"ref-{family}-{coef}-{len(made)}-{len(refs)}")
                return refs[key]

            made[(family, coef)] = (hf, convert(hf, root / f"{family}-{coef}-nxd"), reference)
        return made[(family, coef)]

    return get


def run_and_compare(tmp_path: Path, moe: Any, family: str, *, tp: int, pp: int, ep: int, dp: int,
                    optimizer: str = "sgd", coef: float = 0.02, **extra: Any) -> list[dict[str, Any]]:
    hf, src, reference = moe(family, coef)
    options = train_options(optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 1e-3, gbs=4, mbs=max(1, 2 // dp),
                            seq_len=16)
    log = run_world(tp * pp * dp, resume=str(src), tp=tp, pp=pp, ep=ep, checkpoint_dir=str(tmp_path / "ckpt"),
                    log_jsonl=str(tmp_path / "log.jsonl"), **options, **extra)
    ref_losses, ref_aux, ref_state = reference(**options)
    losses, aux = [row["loss"] for row in log], [row["aux_loss"] for row in log]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) <= LOSS_TOL, (losses, ref_losses)
    assert max(abs(a - b) for a, b in zip(aux, ref_aux, strict=True)) <= LOSS_TOL, (aux, ref_aux)
    with warns_no_tokenizer():
        export(tmp_path / "ckpt", tmp_path / "hf")
    from tests.conftest import hf_state

    got = hf_state(tmp_path / "hf")
    assert set(got) == set(ref_state)
    worst = max((got[k] - ref_state[k]).abs().max().item() for k in got)
    assert worst <= WEIGHT_TOL[optimizer], f"exported weights differ from the reference by {worst}"
    return log


def test_mixtral_tp2_ep2_matches_transformers(tmp_path, moe):
    """4 processes: tp 2 x dp 2, the dp ranks the two ep ranks (experts 0-1 and 2-3), tokens exchanged."""
    run_and_compare(tmp_path, moe, "mixtral", tp=2, pp=1, ep=2, dp=2)


CASES = {
    # name: (family, tp, pp, ep, dp, optimizer, coef, extra)
    "qwen3-tp2-ep2": ("qwen3_moe", 2, 1, 2, 2, "sgd", 0.02, {}),
    "mixtral-pp2-ep2": ("mixtral", 1, 2, 2, 2, "sgd", 0.02, {}),
    "qwen3-pp2-ep2": ("qwen3_moe", 1, 2, 2, 2, "sgd", 0.02, {}),
    "mixtral-tp2-pp2-ep1": ("mixtral", 2, 2, 1, 1, "sgd", 0.02, {}),
    "qwen3-tp2-pp2-ep1": ("qwen3_moe", 2, 2, 1, 1, "sgd", 0.02, {}),
    "mixtral-tp2-ep2-adamw": ("mixtral", 2, 1, 2, 2, "adamw", 0.02, {}),
    "qwen3-tp2-pp2-ep1-adamw": ("qwen3_moe", 2, 2, 1, 1, "adamw", 0.02, {}),
    "mixtral-tp2-ep2-coef0": ("mixtral", 2, 1, 2, 2, "sgd", 0.0, {}),
    "qwen3-pp2-ep2-coef0": ("qwen3_moe", 1, 2, 2, 2, "sgd", 0.0, {}),
    "mixtral-tp2-ep2-sp-full": ("mixtral", 2, 1, 2, 2, "sgd", 0.02,
                                dict(sequence_parallel=True, activation_checkpointing="full")),
    "qwen3-tp2-pp2-sp-full": ("qwen3_moe", 2, 2, 1, 1, "sgd", 0.02,
                              dict(sequence_parallel=True, activation_checkpointing="full")),
    # ZeRO-1: non-expert state over dp 4, each ep rank's experts over its 2 expert-data-parallel ranks
    "mixtral-ep2-dp4-zero1-adamw": ("mixtral", 1, 1, 2, 4, "adamw", 0.02, dict(zero1=True)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_moe_layouts_match_transformers(tmp_path, moe, name):
    family, tp, pp, ep, dp, optimizer, coef, extra = CASES[name]
    run_and_compare(tmp_path, moe, family, tp=tp, pp=pp, ep=ep, dp=dp, optimizer=optimizer, coef=coef, **extra)


# --------------------------------------------------------------------------------------------
# The ep dispatch against transformers' block, and experts on the wrong ep rank


def _block_worker(out_dir: str) -> None:
    """One of 2 ep ranks: transformers' MixtralSparseMoeBlock and ours on this rank's tokens; the output and each
    local expert's gradient (over both ranks' tokens) compared, with the experts in place and with each rank
    holding the other's."""
    import json

    import torch.distributed as dist
    import transformers

    from ckptconv.core.model_spec import ModelSpec
    from nxdtrain.model.moe import SparseMLP
    from nxdtrain.parallel.dist import detect_env, init_world
    from nxdtrain.parallel.experts import EpGroup
    from nxdtrain.parallel.layers import TpGroup

    env = detect_env()
    init_world(env, 60.0, "cpu")
    rank = dist.get_rank()
    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4,
                                        num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    ref = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p))
    xs = [torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(10 + r)) for r in range(2)]
    gs = [torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(20 + r)) for r in range(2)]
    ref_out = [ref(x) for x in xs]
    sum((o * g).sum() for o, g in zip(ref_out, gs, strict=True)).backward()

    spec = ModelSpec.from_config({"model_type": "mixtral", **config.to_dict()})
    ep = EpGroup(2, rank, dist.new_group([0, 1]))
    gate_up, down = ref.experts.gate_up_proj, ref.experts.down_proj  # [E, 2I, H] (gate rows first), [E, H, I]

    def relative(got: torch.Tensor, want: torch.Tensor) -> float:  # values in the hundreds: fp32 rounding is 1e-5
        return ((got - want).abs().max() / want.abs().max()).item()

    result = {}
    for case, owner in (("in-place", rank), ("swapped", 1 - rank)):
        block = SparseMLP(spec, 0, TpGroup(), ep, dtype=torch.float32)
        experts = list(range(2 * owner, 2 * owner + 2))
        with torch.no_grad():
            block.router.linear_router.weight.copy_(ref.gate.weight)
            block.expert_mlps.mlp_op.gate_up_proj.weight.copy_(gate_up[experts].transpose(1, 2))
            block.expert_mlps.mlp_op.down_proj.weight.copy_(down[experts].transpose(1, 2))
        out = block(xs[rank])
        (out * gs[rank]).sum().backward()
        op = block.expert_mlps.mlp_op
        result[case] = {
            "forward": relative(out, ref_out[rank]),
            "gate_up_grad": relative(op.gate_up_proj.weight.grad, gate_up.grad[experts].transpose(1, 2)),
            "down_grad": relative(op.down_proj.weight.grad, down.grad[experts].transpose(1, 2)),
        }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_ep_dispatch_matches_transformers_block_and_catches_swapped_experts(tmp_path):
    import json

    from nxdtrain.cli import PRELOAD
    from nxdtrain.parallel.dist import spawn

    assert spawn(_block_worker, (str(tmp_path),), 2, timeout_s=120, preload=PRELOAD) == 0
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert max(v for r in results for v in r["in-place"].values()) < 1e-6, results
    # tokens reach the experts' numbers on the wrong rank: the output is another function
    assert min(r["swapped"]["forward"] for r in results) > 1e-2, results


REFUSALS = {
    # options, world, the one line
    "ep-not-dividing-dp": (dict(ep=2, tp=2), 2, r"^--ep 2 must divide the data-parallel size 1 \(expert parallelism "
                                                r"is carved out of dp\)$"),
    "ep-not-dividing-experts": (dict(ep=3), 3, r"this run's layout: --ep 3 must divide the number of experts \(4\)$"),
    "nxd-optimizer-format-with-ep": (dict(ep=2, optimizer_format="nxd", schedule="CosineAnnealing"), 2, r"^--optimizer-format nxd with --ep 2 needs --zero1: "
                                                                              r"NxD's expert-parallel optimizer files"),
    "shard-params": (dict(shard_params=True), 2, r"^--shard-params / --hybrid-shard with a Mixtral model: FSDP would"),
    "context-parallel": (dict(context_parallel=2), 2, r"^--context-parallel 2 with a Mixtral model: the router's aux "
                                                      r"loss counts a micro-batch's whole sequence"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_what_moe_training_cannot_do_is_refused_before_any_process(moe, name):
    from nxdtrain.errors import TrainError
    from nxdtrain.train import prepare

    options, world, message = REFUSALS[name]
    _, src, _ = moe("mixtral")
    config = TrainConfig.from_flat({**train_options(gbs=4, mbs=1), "resume": str(src), "no_checkpoint": True,
                                    **options})
    with pytest.raises(TrainError, match=message):
        prepare(config, world)


def test_router_jitter_is_refused_before_any_process(tmp_path):
    """config.json's router_jitter_noise (nxdtrain's router has none) is refused by prepare, in one line."""
    import json

    from nxdtrain.errors import TrainError
    from nxdtrain.train import prepare

    hf = make_moe(tmp_path / "hf", "mixtral")
    (hf / "config.json").write_text(json.dumps(json.loads((hf / "config.json").read_text())
                                               | {"router_jitter_noise": 0.1}))
    config = TrainConfig.from_flat({**train_options(gbs=4, mbs=1), "resume": str(convert(hf, tmp_path / "nxd")),
                                    "no_checkpoint": True})
    with pytest.raises(TrainError, match=r"^config\.json: router_jitter_noise 0\.1: nxdtrain's router has no "
                                         r"jitter \(0 works\)$"):
        prepare(config, 2)


def test_nxdt_expert_model_parallel_size_is_ep(tmp_path):
    from nxdtrain.cli import build_parser, load_config

    path = tmp_path / "run.yaml"
    path.write_text("distributed_strategy:\n  tensor_model_parallel_size: 2\n  expert_model_parallel_size: 2\n"
                    "data:\n  train_dir: synthetic\n")
    config = load_config(build_parser().parse_args(["run", "--config", str(path), "--resume", "/x"]))
    assert (config.parallel.tp, config.parallel.ep) == (2, 2)
