"""Issue 47's MoE rows: each conversion of a mixture of experts against the same conversion of a dense model of the same
bytes and ``cp -r`` of the same bytes, in one run (``benchmarks/run.py --moe-cost [--repeat N] [--before DIR]``).

Models (bf16, synthetic weights, one layer, vocabulary 1024), each beside a dense twin whose MLP has the experts'
bytes (intermediate = experts x expert intermediate) and the same attention:

* ``mixtral``: Mixtral-8x7B's hidden 4096, expert intermediate 14336, 32 / 8 heads, 2 experts (0.75 GB): to-nxd at
  tp 4 x ep 2 (dense: tp 4), to-hf of those shards. Its training tag (reshard with the AdamW state) has experts of a
  quarter of that intermediate (3584; 1.9 GB with fp32 masters and moments): tp 2 x ep 2 -> tp 1 x ep 2.
* ``qwen3_moe``: Qwen3-30B-A3B's hidden 2048, expert intermediate 768, 32 / 4 heads of 128, 64 experts top-8
  (0.65 GB): to-nxd at tp 2 x ep 4, to-hf, to-dcp and from-dcp (TorchTitan's qwen3; Mixtral has no TorchTitan
  model); its tag has 16 experts (1.4 GB): tp 2 x ep 2 -> tp 1 x ep 2.

Each command also runs on a tiny model of the same family and layout (its start-up); the figures are marginal
(command minus start-up), as in ``training_rows.py``: marginal CPU s/GB of the source, marginal wall against ``cp -r``
of the source run right before, peak RSS; the MoE row's ratio to its dense twin's marginal CPU. Warm page cache,
``sync`` after each command; with ``--before DIR`` every MoE command runs from that tree too, with
``--torch-transpose`` from this tree with ``CKPTCONV_NATIVE=0`` (torch's transpose instead of the native kernel,
``ckptconv.io.transpose``), alternating which goes first (the dense twins run from this tree only: the change is in
the expert paths).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from measure import du, measure
from synth import write_config
from training_rows import REPO, Row, tree_env

MIXTRAL = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=4096, intermediate_size=14336,
               num_local_experts=2, num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8,
               rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=False,
               torch_dtype="bfloat16", vocab_size=1024, num_hidden_layers=1)
QWEN3_MOE = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                 intermediate_size=6144, moe_intermediate_size=768, num_experts=64, num_experts_per_tok=8,
                 num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                 max_position_embeddings=32768, tie_word_embeddings=False, torch_dtype="bfloat16", vocab_size=1024,
                 num_hidden_layers=1, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=96, num_attention_heads=8,
            num_key_value_heads=4, head_dim=16, vocab_size=64)


def dense_twin(config: dict) -> dict:
    """The dense model whose MLP holds the experts' bytes: Llama for Mixtral, Qwen3 for Qwen3-MoE."""
    experts = config.get("num_local_experts") or config["num_experts"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    drop = {"num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
            "decoder_sparse_step", "mlp_only_layers"}
    base = {k: v for k, v in config.items() if k not in drop}
    kind = ("llama", "LlamaForCausalLM") if config["model_type"] == "mixtral" else ("qwen3", "Qwen3ForCausalLM")
    return {**base, "model_type": kind[0], "architectures": [kind[1]], "intermediate_size": experts * inter}


def tiny(config: dict) -> dict:
    experts = {"num_local_experts": 4} if "num_local_experts" in config else {"num_experts": 8}
    return {**config, **TINY, **(experts if config["model_type"] in ("mixtral", "qwen3_moe") else {})}


def with_experts(config: dict, experts: int, inter: int) -> dict:
    key = "num_local_experts" if config["model_type"] == "mixtral" else "num_experts"
    size = "intermediate_size" if config["model_type"] == "mixtral" else "moe_intermediate_size"
    return {**config, key: experts, size: inter, "num_experts_per_tok": min(config["num_experts_per_tok"], experts)}


# family: (weights model, tag model, to-nxd layout, tag layout -> reshard layout, whether TorchTitan has it)
FAMILIES = {
    "mixtral": (MIXTRAL, with_experts(MIXTRAL, 2, 3584), ["--tp", "4", "--ep", "2"], (2, 2), ["--tp", "1"], False),
    "qwen3_moe": (QWEN3_MOE, with_experts(QWEN3_MOE, 16, 768), ["--tp", "2", "--ep", "4"], (2, 2), ["--tp", "1"],
                  True),
}


def _ckptconv(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "ckptconv.cli", *argv, "--quiet"], check=True, env=tree_env(REPO),
                   stdout=subprocess.DEVNULL)


def _layout(args: list[str], config: dict) -> list[str]:
    """``args`` without ``--ep`` for a dense model."""
    if "model_type" in config and config["model_type"] in ("mixtral", "qwen3_moe"):
        return args
    out = list(args)
    if "--ep" in out:
        i = out.index("--ep")
        del out[i:i + 2]
    return out


def build(out: Path) -> dict[tuple[str, str, str], Path]:
    """Sources by (family, model kind: moe / dense, size: big / tiny) and what: hf, nxd, tag, dcp."""
    paths: dict[tuple[str, str, str], Path] = {}
    for family, (weights, tagged, layout, (tag_tp, tag_ep), _, titan) in FAMILIES.items():
        for kind in ("moe", "dense"):
            for size in ("big", "tiny"):
                config = weights if size == "big" else tiny(weights)
                tag_config = tagged if size == "big" else tiny(tagged)
                if kind == "dense":
                    config, tag_config = dense_twin(config), dense_twin(tag_config)
                work = out / f"moe-cost-{family}-{kind}-{size}"
                paths[(family, kind, size)] = work
                if (work / "done").is_file():
                    continue
                shutil.rmtree(work, ignore_errors=True)
                print(f"building {work.name} ...", flush=True)
                write_config(work / "hf", config)
                _ckptconv("to-nxd", str(work / "hf"), str(work / "nxd"), *_layout(layout, config))
                if titan:
                    _ckptconv("to-dcp", str(work / "hf"), str(work / "dcp"))
                write_config(work / "tag-hf", tag_config)
                ep = ["--ep", str(tag_ep)] if kind == "moe" else []
                _ckptconv("to-nxd", str(work / "tag-hf"), str(work / "tag"), "--tp", str(tag_tp), *ep)
                shutil.rmtree(work / "tag-hf")
                subprocess.run([sys.executable, "-c", f"from moe_cost import add_optimizer; from pathlib import Path; "
                                f"add_optimizer(Path({str(work / 'tag')!r}), {tag_tp}, {tag_ep if kind == 'moe' else 1})"],
                               check=True, cwd=Path(__file__).parent, env=tree_env(REPO))
                (work / "done").write_text("")
    return paths


def add_optimizer(tag: Path, tp: int, ep: int) -> None:
    """Turn converted shards into an nxdtrain format-2 tag: bf16 weights with fp32 masters and AdamW moments, one
    optimizer file per (dp = ep rank, tp rank), as tests/moe_tags.py lays it out (docs/nxd-optimizer-format.md)."""
    from reshard_optim import ADAMW

    from ckptconv.core.families.moe import NXD_DOWN, NXD_GATE_UP
    from ckptconv.io.digest import record_files
    from ckptconv.io.metadata import read_metadata, write_metadata
    from ckptconv.io.nxd_read import load_shard
    from ckptconv.io.tags import write_markers
    from ckptconv.training.nxdtrain_format.state import MASTER, SCHEDULER_FILE, USER_CONTENT_FILE, state_key

    def expert(key: str) -> bool:
        return key.endswith(NXD_GATE_UP) or key.endswith(NXD_DOWN)

    (tag / "optim").mkdir()
    name = "dp_rank_00_ep_rank_{e:02d}_tp_rank_{s:02d}_pp_rank_00.pt" if ep > 1 else "dp_rank_00_tp_rank_{s:02d}_pp_rank_00.pt"
    for s in range(tp):
        dense = {k: v for k, v in load_shard(tag / "model" / name.format(e=0, s=s)).items()
                 if not expert(k) and not k.endswith("inv_freq")}
        for d in range(ep):
            experts = {k: v for k, v in load_shard(tag / "model" / name.format(e=d, s=s)).items() if expert(k)}
            owned = {**(dense if d == 0 else {}), **experts}
            flat: dict[str, object] = {"format": 2, "names": list(dense) + list(experts), "zero1": False,
                                       "zero_size": 1, "dp_rank": d, "owned": list(owned),
                                       "param_groups": [{**ADAMW, "weight_decay": 0.1}, {**ADAMW, "weight_decay": 0.0}]}
            if ep > 1:
                flat.update(ep=ep, ep_rank=d)
            for key, weight in owned.items():
                w = weight.float()
                flat[state_key(key, "step")] = torch.tensor(100.0)
                flat[state_key(key, "exp_avg")] = w * 1e-3
                flat[state_key(key, "exp_avg_sq")] = w * w * 1e-6
                flat[state_key(key, MASTER)] = w
            torch.save(flat, tag / "optim" / f"dp_rank_{d:02d}_tp_rank_{s:02d}_pp_rank_00.pt")
            del flat, owned, experts
    torch.save({"step": 100, "schedule": "cosine", "lr": 1e-4, "min_lr": 1e-5, "warmup": 10, "decay_steps": 1000},
               tag / SCHEDULER_FILE)
    torch.save({"step": 100, "consumed_samples": 400, "rng": [], "options": {"tp": tp, "pp": 1, "ep": ep}},
               tag / USER_CONTENT_FILE)
    meta = read_metadata(tag)
    assert meta is not None
    extra = sorted((tag / "optim").iterdir()) + [tag / SCHEDULER_FILE, tag / USER_CONTENT_FILE]
    meta.files.update({rel: rec.to_json() for rel, rec in record_files(extra, tag, "blake3").items()})
    write_metadata(tag, meta)
    write_markers(tag)


def commands(family: str) -> list[tuple[str, str, list[str]]]:
    """(verb label, source, argv with SRC / OUT) of a family."""
    _, _, layout, _, reshard, titan = FAMILIES[family]
    rows = [("to-nxd " + " ".join(layout), "hf", ["to-nxd", "SRC", "OUT", *layout]),
            ("to-hf", "nxd", ["to-hf", "SRC", "OUT"]),
            ("reshard with AdamW state " + " ".join(reshard), "tag", ["reshard", "SRC", "OUT", *reshard])]
    if titan:
        rows += [("to-dcp", "hf", ["to-dcp", "SRC", "OUT"]), ("from-dcp --to hf", "dcp", ["from-dcp", "SRC", "OUT",
                                                                                          "--to", "hf"])]
    return rows


def moe_cost_rows(out: Path, repeat: int, before: Path | None, torch_transpose: bool = False) -> str:
    out = out.resolve()
    paths = build(out)
    # (label, source tree, environment): CKPTCONV_NATIVE=0 is the tree's own code on torch's transpose
    trees = [("after", REPO, tree_env(REPO))] + ([("before", before, tree_env(before))] if before else [])
    trees += [("torch transpose", REPO, {**tree_env(REPO), "CKPTCONV_NATIVE": "0"})] if torch_transpose else []
    rows: dict[tuple[str, str, str, str], Row] = {}
    target, copy = out / "moe-cost-out", out / "moe-cost-cp"
    for i in range(repeat):
        for family in FAMILIES:
            for label, what, argv in commands(family):
                for kind in ("moe", "dense"):
                    src = paths[(family, kind, "big")] / what
                    command = f"{family} {kind}: {label}"
                    shutil.rmtree(copy, ignore_errors=True)
                    baseline = measure(["cp", "-r", str(src), str(copy)])
                    shutil.rmtree(copy)
                    order = trees if i % 2 == 0 else trees[::-1]
                    for tree, _, env in order if kind == "moe" else [t for t in order if t[0] == "after"]:
                        row = rows.setdefault((family, label, kind, tree), Row(command, tree, du(src) / 1e9))
                        row.cp.append(baseline)
                        args = argv if kind == "moe" else _layout(argv, {})
                        for size, runs in (("tiny", row.startup), ("big", row.runs)):
                            source = paths[(family, kind, size)] / what
                            shutil.rmtree(target, ignore_errors=True)
                            line = [str(source) if a == "SRC" else str(target) if a == "OUT" else a for a in args]
                            runs.append(measure([sys.executable, "-m", "ckptconv.cli", *line, "--quiet"], env,
                                                cwd=out))
                            shutil.rmtree(target)
                        r, c = row.runs[-1], row.cp[-1]
                        s = row.startup[-1]
                        print(f"{command} [{tree}]: {r.wall:.1f} s (start-up {s.wall:.1f}), cp -r {c.wall:.1f} s; "
                              f"CPU {r.cpu:.1f} s (start-up {s.cpu:.1f}), peak RSS {r.rss / 2**20:.0f} MiB", flush=True)
    return table(rows)


def _cpu_per_gb(row: Row) -> float:
    med = statistics.median
    return (med(r.cpu for r in row.runs) - med(r.cpu for r in row.startup)) / row.gb


def table(rows: dict[tuple[str, str, str, str], Row]) -> str:
    lines = ["| command | tree | runs | wall s (start-up) | cp -r s | marginal ratio to cp (range) | "
             "marginal CPU s/GB (cp's) | peak RSS | MoE CPU / dense CPU |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (family, label, kind, _), row in rows.items():
        dense = rows.get((family, label, "dense", "after"))
        ratio = f"{_cpu_per_gb(row) / _cpu_per_gb(dense):.2f}x" if kind == "moe" and dense else ""
        lines.append(row.line() + f" {ratio} |")
    return "\n".join(lines) + "\n"
