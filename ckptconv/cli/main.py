"""``ckptconv`` command line: parse, make one library call, print. Exit 0 ok, 1 error, 2 usage.

Only what parsing needs is imported at the top: ``--version``, ``--help`` and bad options are
answered without importing torch (a test checks ``sys.modules``); a command imports its library
call when it runs.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from ckptconv.cli.compat import build_parser as build_compat_parser
from ckptconv.cli.compat import run_compat
from ckptconv.cli.diff_args import add_diff_parser, run_diff
from ckptconv.cli.errors import DEBUG_HELP, run_guarded
from ckptconv.cli.every import every_flags, every_said
from ckptconv.cli.layout_args import Parser, add_layout_flags, add_source_flags, overrides_from, source_overrides
from ckptconv.cli.report import reported
from ckptconv.core.layout_flags import OVERRIDE_FLAG, LayoutOverrides
from ckptconv.engine.launcher import detect_part, parse_part
from ckptconv.engine.options import (
    DEFAULT_DCP_FILE_SIZE,
    DEFAULT_WORKERS_RULE,
    DTYPES,
    NXD_PARAM_GROUPS,
    NXD_TRAINERS,
    RunOptions,
)
from ckptconv.errors import ConversionError
from ckptconv.io import digest
from ckptconv.io.direct_io import WRITE_IO_MODES
from ckptconv.io.metadata import add_version_flag
from ckptconv.training.schedules import NXDT_SCHEDULES

if TYPE_CHECKING:
    from ckptconv.engine.run import Result

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """``5GB``, ``512MiB``, ``2G`` or plain bytes -> bytes (G = 10^9, GiB = 2^30)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GB, 512MiB or 1000000, got {text!r}")
    unit = (m.group(2) or "").lower().removesuffix("b")
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"unknown size unit in {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def _run_flags(p: argparse.ArgumentParser) -> None:
    defaults = RunOptions()
    p.add_argument("--workers", type=int, default=defaults.workers, help=f"parallel workers (default: {DEFAULT_WORKERS_RULE})")
    p.add_argument("--max-memory", type=parse_size, default=defaults.max_memory,
                   help="working-memory budget for tensor data (default 2GiB)")
    p.add_argument("--io", choices=("mmap", "read"), default=defaults.io,
                   help="input reads: read (plain reads, default; safe on Lustre/NFS) or mmap")
    p.add_argument("--write-io", choices=WRITE_IO_MODES, default=defaults.write_io,
                   help="output writes: direct (default: large writes skip the page cache with O_DIRECT where the "
                        "filesystem allows it) or buffered")
    p.add_argument("--quiet", action="store_true", help="no progress or warnings on stderr (the result, notes included, still prints)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument("--overwrite", action="store_true", help="replace a different conversion in OUT")
    p.add_argument("--hash", choices=(*digest.ALGORITHMS, "none"), default=defaults.hash,
                   help="per-file digest in ckptconv.json (default blake3; sha256 is ~10x slower without SHA instructions; none: sizes only)")
    p.add_argument("--part", type=parse_part, default=None, metavar="K/N",
                   help="convert the K-th of N disjoint sets of files (default: from srun/torchrun, else all)")


DTYPE_HELP = "cast floating weights to this dtype (default keep; inv_freq keeps its precision)"
JSON_HELP = "print the result as JSON on stdout"
TOKENIZER_HELP = ("directory whose tokenizer files (tokenizer.json, tokenizer_config.json, ...) go with the "
                  "output, replacing the source's (a single .pt/.bin source has none)")
OVERRIDE_HELP = ("read the shards with the layout flags given even where they contradict the layout SRC's ckptconv.json "
                 "records (refused without it); the notes say what was overridden")


def _masters_flag(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--masters", action=argparse.BooleanOptionalAction, default=None,
                   help="weights from the fp32 master weights in a training tag's optim/ (an nxdtrain bf16 run's, or "
                        f"NxD's ZeRO-1 sharded_master_weights) instead of the shards' bf16 copy (default: {default}; "
                        "an NxD tag whose model files hold no tensors is always read from its masters)")


def _revision_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--revision", default=None,
                   help="for a hub id: branch, tag or commit (default main); looked up in the HF cache first")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ckptconv", description=DESCRIPTION)
    add_version_flag(parser)
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to do (COMMAND --help for its flags)")
    for add in (_to_nxd_parser, _to_hf_parser, _reshard_parser, _to_dcp_parser, _from_dcp_parser, _verify_parser,
                _inspect_parser, _finalize_parser, _compat_parser):
        add(sub)
    add_diff_parser(sub, parse_size, JSON_HELP)
    for command in sub.choices.values():  # --debug also after the subcommand
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    for name in ("to-hf", "verify", "nxd-compat", "to-dcp", "reshard"):  # flags that describe an NxD source
        sub.choices[name].add_argument(OVERRIDE_FLAG, action="store_true", help=OVERRIDE_HELP)
    for name in ("to-hf", "reshard", "verify", "inspect", "nxd-compat", "to-dcp", "from-dcp", "diff"):  # read NxD/DCP
        sub.choices[name].add_argument(
            "--no-check", action="store_true",
            help="do not check input files against ckptconv.json (size, digest) and their zip CRC-32s (forensics)")
    return parser


Subparsers = Any  # argparse's _SubParsersAction (private)
# What the tool is (pyproject.toml's description says the same; tests/test_cli_text.py holds both to every family)
DESCRIPTION = ("Hugging Face <-> NxD (neuronx-distributed) tp x pp x ep shards <-> TorchTitan DCP: convert, reshard "
               "and verify Llama, Mistral, Qwen2, Qwen3, Mixtral and Qwen3-MoE checkpoints and their training state; "
               "DeepSeek-V3 and GPT-OSS (FP8, MXFP4) into TorchTitan and back")


def _to_nxd_parser(sub: Subparsers) -> None:
    p = sub.add_parser("to-nxd", help="HF checkpoint -> NxD tp x pp shards")
    p.add_argument("src", help="HF model directory, hub id org/name (see --revision), or one state-dict file "
                               "(.safetensors/.pt/.bin) with --config")
    p.add_argument("out", help="output directory (the shards go to OUT/model/)")
    _revision_flag(p)
    add_layout_flags(p, source_layout=False)  # an HF source has no layout to keep
    p.add_argument("--xser", nargs="?", const="inline", choices=("inline", "split"), default=None,
                   help="xser flavour: inline (official --save_xser) or split (NxD training's)")
    p.add_argument("--config", help="HF config.json (needed for a single state-dict file)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="keep", help=DTYPE_HELP)
    p.add_argument("--tokenizer", metavar="DIR", default=None, help=TOKENIZER_HELP)
    p.add_argument("--verify", nargs="?", const=2, type=int, default=0, metavar="LAYERS",
                   help="after converting, check the shards numerically on LAYERS sampled layers (default 2)")
    _run_flags(p)


def _to_hf_parser(sub: Subparsers) -> None:
    p = sub.add_parser("to-hf", help="NxD shards -> HF safetensors directory")
    p.add_argument("src", help="dir holding model/, a model/ dir, a training tag, or a checkpoint root")
    p.add_argument("out", help="output HF directory (safetensors, config.json, tokenizer files)")
    p.add_argument("--config", help="HF config.json (when SRC has no ckptconv.json)")
    add_layout_flags(p)
    p.add_argument("--max-shard-size", type=parse_size, default=5 * 10**9, help="per safetensors file (default 5GB)")
    p.add_argument("--dtype", choices=("source", *DTYPES), default="source",
                   help="source (default): the dtype the source model had (its config.json), else the shards'; "
                        "keep: the shards' dtype; or cast floating weights to bf16/fp16/fp32")
    p.add_argument("--kv-replicas", choices=("error", "first", "mean"), default="error",
                   help="when copies of a K/V head (or norm) drifted apart (e.g. trained without syncing them): "
                        "fail (default), keep the first, or average")
    p.add_argument("--tokenizer", metavar="DIR", default=None, help=TOKENIZER_HELP)
    p.add_argument("--hf-experts", choices=("per-expert", "fused"), default="per-expert",
                   help="a mixture of experts' HF form: per-expert tensors (default, what transformers writes) or "
                        "fused mlp.experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I] (transformers' in-memory "
                        "form, as newer hub models store it)")
    _masters_flag(p, "when present")
    p.add_argument("--push-to-hub", metavar="ORG/NAME", default=None,
                   help="after a complete export, create the hub repo ORG/NAME if needed and upload OUT to it")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    _run_flags(p)


def _reshard_parser(sub: Subparsers) -> None:
    p = sub.add_parser("reshard", help="NxD shards -> NxD shards of another layout")
    p.add_argument("src", help="NxD shards: a dir holding model/, a model/ dir, a training tag, or a checkpoint root")
    p.add_argument("out", help="output directory (the shards go to OUT/model/)")
    add_layout_flags(p)
    p.add_argument("--xser", nargs="?", const="inline", choices=("inline", "split", "plain"), default=None,
                   help="output flavour: inline, split (xser) or plain (default: the source's)")
    p.add_argument("--config", help="HF config.json (when SRC has no ckptconv.json)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="keep", help=DTYPE_HELP)
    p.add_argument("--kv-replicas", choices=("error", "first"), default="error",
                   help="when copies of a K/V head (or norm) drifted apart: fail (default) or keep the first")
    add_source_flags(p)
    _masters_flag(p, "the shards")
    _training_flags(p)
    _run_flags(p)


def _training_flags(p: argparse.ArgumentParser) -> None:
    """reshard's flags for a training tag's optimizer state."""
    p.add_argument("--dp", type=int, default=None,
                   help="training tag: data-parallel ranks the ZeRO-1 optimizer state is partitioned over "
                        "(default: the tag's)")
    p.add_argument("--zero1", action=argparse.BooleanOptionalAction, default=None,
                   help="training tag: optimizer state partitioned over --dp ranks (ZeRO-1) or one file per shard "
                        "(default: the tag's)")
    p.add_argument("--optimizer-format", choices=("nxdtrain", "nxd"), default="nxdtrain",
                   help="training tag: write the optimizer state in nxdtrain's format 2 (default) or in NxD's own "
                        "(NeuronZero1Optimizer / torch AdamW state dicts, NxD's scheduler.pt and user_content.pt), "
                        "so that NxD resumes it")
    p.add_argument("--nxd-param-groups", choices=NXD_PARAM_GROUPS, default=None,
                   help="with --optimizer-format nxd: the param groups of the NxD run that loads the tag: bias-norm "
                        "(NxD's Llama example, default), bias-LayerNorm (other NxD/NxDT examples), bias (NxDT's "
                        "hf models with do_layer_norm_weight_decay false: norms decayed) or one")
    p.add_argument("--drop-masters", action="store_true",
                   help="with --optimizer-format nxd --no-zero1: accept dropping a bf16 model's fp32 masters and "
                        "rounding its moments (NxD keeps no fp32 state without ZeRO-1); at ep > 1: accept dropping "
                        "the source's masters (NxD's expert-parallel ZeRO-1 files hold none)")
    p.add_argument("--nxd-trainer", choices=NXD_TRAINERS, default=None,
                   help="with --optimizer-format nxd: whose side files: nxd-example (NxD's example trainers: "
                        "scheduler.pt, user_content.pt with total_steps) or nxdt (neuronx-distributed-training: "
                        "lightning's checkpoint dict in user_content.pt, OUT named <name>--step=N-consumed_samples="
                        "X.ckpt); default: the source's own, else nxd-example")
    p.add_argument("--weights-only", action="store_true",
                   help="training tag: write the shards only (no optimizer state, step or schedule)")


TAG_SCHEDULES = ("linear", "cosine", "constant", *NXDT_SCHEDULES)  # nxdtrain's --schedule choices


def _to_dcp_parser(sub: Subparsers) -> None:
    p = sub.add_parser("to-dcp", help="HF or NxD checkpoint -> TorchTitan DCP (model; a training tag's AdamW state too)")
    p.add_argument("src", help="HF model directory or hub id org/name, a converted NxD dir, a training tag, "
                               "or a checkpoint root")
    p.add_argument("out", help="output DCP directory (load it in TorchTitan with checkpoint.initial_load_path=OUT)")
    _revision_flag(p)
    p.add_argument("--config", help="HF config.json (a state-dict file, or NxD shards without ckptconv.json)")
    add_layout_flags(p)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="keep", help=DTYPE_HELP)
    p.add_argument("--max-file-size", type=parse_size, default=DEFAULT_DCP_FILE_SIZE,
                   help="per .distcp data file (default 1GB: several files are written in parallel)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory whose tokenizer files go into OUT/hf/, the generated config's HF_ASSETS_PATH "
                        "(TorchTitan needs one; default: the source's, said when it has none)")
    p.add_argument("--kv-replicas", choices=("error", "first"), default="error",
                   help="NxD source: when copies of a K/V head (or norm) differ: fail (default) or keep the first")
    p.add_argument("--weights-only", action="store_true",
                   help="training tag: write the model only (no AdamW state, lr schedule or step)")
    _masters_flag(p, "when present")
    p.add_argument("--drop-mtp", action="store_true",
                   help="DeepSeek-V3: leave out the multi-token-prediction layers (num_nextn_predict_layers; "
                        "carried by default into TorchTitan's mtp_layers)")
    g = p.add_argument_group("a schedule the tag does not record (NxDT's LinearAnnealingWithWarmUp saves only its "
                             "peak lr; nxdtrain's names; one that differs from what the tag records is refused)")
    g.add_argument("--schedule", choices=TAG_SCHEDULES, default=None, help="the run's learning-rate schedule")
    g.add_argument("--lr", type=float, default=None, help="the run's peak learning rate")
    g.add_argument("--min-lr", type=float, default=None, help="the learning rate at the end of the decay")
    g.add_argument("--warmup", type=int, default=None, help="warmup steps")
    g.add_argument("--decay-steps", type=int, default=None, help="the step at which the decay ends (NxDT: max_steps)")
    _run_flags(p)


def _from_dcp_parser(sub: Subparsers) -> None:
    p = sub.add_parser("from-dcp", help="TorchTitan DCP -> HF safetensors, NxD shards, or an nxdtrain tag")
    p.add_argument("src", help="a TorchTitan checkpoint: a step-N directory, or its checkpoint folder (newest step)")
    p.add_argument("out", help="output directory (HF files, or NxD shards under OUT/model/)")
    p.add_argument("--to", choices=("hf", "nxd"), default="hf", help="what to write (default hf)")
    p.add_argument("--config", help="the model's HF config.json (TorchTitan checkpoints record none)")
    add_layout_flags(p)
    p.add_argument("--xser", nargs="?", const="inline", choices=("inline", "split"), default=None,
                   help="--to nxd: xser flavour: inline (official --save_xser) or split (NxD training's)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="keep", help=DTYPE_HELP)
    p.add_argument("--max-shard-size", type=parse_size, default=5 * 10**9,
                   help="--to hf: per safetensors file (default 5GB)")
    p.add_argument("--weights-only", action="store_true",
                   help="--to nxd of a full checkpoint: the shards only, not an nxdtrain training tag")
    p.add_argument("--consumed-samples", type=int, default=None, metavar="N",
                   help="--to nxd of a full checkpoint: the tag's data position (nxdtrain continues at row N; "
                        "default 0: TorchTitan's data loader position is not carried)")
    p.add_argument("--drop-expert-bias", action="store_true",
                   help="Qwen3-MoE: write the model without the routing bias TorchTitan's load balancing trained "
                        "(expert_bias_E; HF has none; without this flag a non-zero bias is refused)")
    every_flags(p, "step-N")
    _run_flags(p)


def _verify_parser(sub: Subparsers) -> None:
    p = sub.add_parser("verify", help="check that NxD shards (or a TorchTitan DCP) compute what the HF model computes")
    p.add_argument("hf_dir", help="the HF model directory, or hub id org/name (see --revision)")
    p.add_argument("nxd_dir", help="the NxD shards to check (a converted dir, a tag or a checkpoint root), or a DCP "
                                   "directory or TorchTitan checkpoint root")
    _revision_flag(p)
    p.add_argument("--layers", default="all", help="'all' or a number of layers to sample evenly (default all)")
    p.add_argument("--tol", type=float, default=None, help="relative tolerance (default 1e-4; looser after a cast)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random test inputs (default 0)")
    p.add_argument("--files", action="store_true", help="also check every file's size and digest against ckptconv.json")
    p.add_argument("--config", help="HF config.json (when NXD_DIR has no ckptconv.json)")
    add_layout_flags(p)
    _masters_flag(p, "the shards")
    p.add_argument("--quiet", action="store_true", help="no progress bar of the layers checked (shown on a terminal)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def _inspect_parser(sub: Subparsers) -> None:
    p = sub.add_parser("inspect", help="describe an HF, NxD or DCP checkpoint")
    p.add_argument("path", help="an HF or NxD directory, a training tag or root, a DCP directory or TorchTitan "
                                "checkpoint root, or hub id org/name")
    _revision_flag(p)
    p.add_argument("--config", help="HF config.json (when PATH has none)")
    _masters_flag(p, "the shards")
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def _finalize_parser(sub: Subparsers) -> None:
    p = sub.add_parser("finalize", help="finish a conversion split over several processes (--part)")
    p.add_argument("out", help="the OUT directory the parts wrote to")
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def _compat_parser(sub: Subparsers) -> None:
    p = sub.add_parser("nxd-compat", help="the official checkpoint_converter.py flags (drop-in)")
    build_compat_parser(p)
    _run_flags(p)


def _options(args: argparse.Namespace) -> RunOptions:
    return RunOptions(workers=args.workers, max_memory=args.max_memory, io=args.io, write_io=args.write_io,
                          quiet=args.quiet or args.json, overwrite=args.overwrite, part=detect_part(args.part),
                          hash=args.hash, check=not getattr(args, "no_check", False))


def _flavour(value: str | None) -> str:
    return {None: "plain", "plain": "plain", "inline": "xser-inline", "split": "xser-split"}[value]


def _flags(args: argparse.Namespace) -> LayoutOverrides:
    """The layout flags given, describing the source where the command reads NxD shards."""
    return overrides_from(args, override=getattr(args, "override_recorded_layout", False))


def run(args: argparse.Namespace) -> Any:
    return COMMANDS[args.command](args)


def _run_to_nxd(args: argparse.Namespace) -> Any:
    layout, options = _flags(args), _options(args)  # bad options fail first
    from ckptconv.commands.api import to_nxd

    return to_nxd(args.src, args.out, layout=layout, flavour=_flavour(args.xser), config=args.config,
                  dtype=args.dtype, verify_layers=args.verify, revision=args.revision, tokenizer=args.tokenizer,
                  options=options)


def _run_to_hf(args: argparse.Namespace) -> Any:
    if args.private and not args.push_to_hub:
        raise ConversionError("--private needs --push-to-hub ORG/NAME")
    hints, options = _flags(args), _options(args)
    from ckptconv.commands.api import to_hf

    result = to_hf(args.src, args.out, config=args.config, hints=hints, max_shard_size=args.max_shard_size,
                   dtype=args.dtype, kv_replicas=args.kv_replicas, tokenizer=args.tokenizer,
                   masters=args.masters, hf_experts=args.hf_experts, options=options)
    return _push(result, args) if args.push_to_hub else result


def _run_reshard(args: argparse.Namespace) -> Any:
    layout, options = overrides_from(args), _options(args)  # not given: the source's
    from ckptconv.commands.api import reshard

    return reshard(
        args.src, args.out, layout=layout, flavour=None if args.xser is None else _flavour(args.xser),
        config=args.config, dtype=args.dtype, kv_replicas=args.kv_replicas, masters=args.masters,
        dp=args.dp, zero1=args.zero1, weights_only=args.weights_only, optimizer_format=args.optimizer_format,
        nxd_param_groups=args.nxd_param_groups, drop_masters=args.drop_masters, nxd_trainer=args.nxd_trainer,
        options=options, hints=source_overrides(args, override=args.override_recorded_layout),
    )


def _run_to_dcp(args: argparse.Namespace) -> Any:
    hints, options = _flags(args), _options(args)
    from ckptconv.commands.dcp import to_dcp
    from ckptconv.titan.state import ScheduleFlags

    schedule = ScheduleFlags(args.schedule, args.lr, args.min_lr, args.warmup, args.decay_steps)
    return to_dcp(args.src, args.out, config=args.config, hints=hints, revision=args.revision, schedule=schedule,
                  dtype=args.dtype, max_file_size=args.max_file_size, kv_replicas=args.kv_replicas,
                  weights_only=args.weights_only, masters=args.masters, drop_mtp=args.drop_mtp,
                  tokenizer=args.tokenizer, options=options)


def _run_from_dcp(args: argparse.Namespace) -> Any:
    layout, options = overrides_from(args), _options(args)
    if args.to == "hf":  # refused before torch is imported (from_dcp says the same)
        layout.refuse_given("pass --to nxd to write NxD shards of that layout")
    say = every_said(args, "ckptconv")
    from ckptconv.commands.dcp import from_dcp, from_dcp_every

    kwargs = dict(to=args.to, config=args.config, layout=layout, flavour=None if args.xser is None else
                  _flavour(args.xser), dtype=args.dtype, max_shard_size=args.max_shard_size,
                  weights_only=args.weights_only, consumed_samples=args.consumed_samples,
                  drop_expert_bias=args.drop_expert_bias, options=options)
    if args.every:
        return from_dcp_every(args.src, args.out, watch=args.watch, say=say, **kwargs).to_json()
    return from_dcp(args.src, args.out, **kwargs)


def _run_verify(args: argparse.Namespace) -> Any:
    layers = args.layers if args.layers == "all" else _positive_int("--layers", args.layers)
    hints = _flags(args)
    from ckptconv.commands.verify import verify

    return verify(args.hf_dir, args.nxd_dir, layers=layers, tol=args.tol, seed=args.seed, config=args.config,
                  hints=hints, files=args.files, revision=args.revision, check=not args.no_check,
                  masters=args.masters, progress=not (args.quiet or args.json) and sys.stderr.isatty())


def _run_inspect(args: argparse.Namespace) -> Any:
    from ckptconv.commands.inspect import inspect

    return inspect(args.path, config=args.config, revision=args.revision, check=not args.no_check,
                   masters=args.masters)


def _run_finalize(args: argparse.Namespace) -> Any:
    from ckptconv.engine.finalize import finalize

    files = finalize(args.out)
    return {"out": args.out, "files": len(files), "bytes": sum(r.size for r in files.values()), "complete": True}


COMMANDS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "to-nxd": _run_to_nxd, "to-hf": _run_to_hf, "reshard": _run_reshard, "to-dcp": _run_to_dcp,
    "from-dcp": _run_from_dcp, "verify": _run_verify, "inspect": _run_inspect, "finalize": _run_finalize,
    "nxd-compat": lambda args: run_compat(args, _options(args)), "diff": run_diff,
}


def check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot say alone, as a usage error (exit 2): to-nxd without a layout writes one unsharded
    file, most likely by mistake, so it needs --tp or --pp."""
    if args.command == "to-nxd" and args.tp is None and args.pp is None:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices["to-nxd"].error("to-nxd needs the layout to write: give --tp and --pp (--tp 1 --pp 1 for one unsharded file)")


# Each command's local inputs (argument, may it be a hub id, what the library says when it is missing), checked
# before the command imports its library (and torch): a typo in a path is answered at once.
_SOURCES = {"to-nxd": [("src", True, "no such file or directory")], "to-hf": [("src", False, "no such directory")],
            "reshard": [("src", False, "no such directory")], "to-dcp": [("src", True, "no such file or directory")],
            "from-dcp": [("src", False, "no such directory")], "inspect": [("path", True, "no such file or directory")],
            "verify": [("nxd_dir", False, "no such directory"), ("hf_dir", True, "no such file or directory")],
            "diff": [("a", False, "no such file or directory"), ("b", False, "no such file or directory")]}


# The library each conversion imports (and with it torch)
_LIBRARIES = {"to-nxd": "ckptconv.commands.api", "to-hf": "ckptconv.commands.api", "reshard": "ckptconv.commands.api",
              "to-dcp": "ckptconv.commands.dcp", "from-dcp": "ckptconv.commands.dcp"}


def check_sources(args: argparse.Namespace) -> None:
    """A conversion's SRC that does not exist (and is no hub id where one is taken) is refused here, as the
    library would refuse it, without importing torch first."""
    from pathlib import Path

    from ckptconv.core.hub_id import is_hub_id

    for attr, hub, missing in _SOURCES.get(args.command, []):
        src = getattr(args, attr)
        if not Path(src).exists() and not (hub and is_hub_id(src)):
            raise ConversionError(f"{src}: {missing}")


def import_quietly(module: str | None) -> None:
    """Import ``module`` with the cyclic collector paused: importing torch alone triggered several full collections
    (0.3-1.3 s of start-up) that found nothing. What the import made is frozen (never cyclic garbage, not traversed
    again); the collector is back on for the conversion itself, whose memory stays bounded only if cycles are
    collected."""
    if module is None:
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        importlib.import_module(module)
        gc.freeze()
    finally:
        if enabled:
            gc.enable()


def _push(result: Result, args: argparse.Namespace) -> dict[str, Any]:
    """Upload a finished export; a part that did not finish OUT pushes nothing (the last part does)."""
    data = result.to_json()
    if not result.finalized:
        data["pushed"] = None
        data["notes"].append(f"not pushed to {args.push_to_hub}: OUT is not complete yet; the part that finishes it pushes")
        return data
    from ckptconv.sources.hub import push

    pushed = push(result.out, args.push_to_hub, private=args.private)
    data["pushed"] = pushed
    data["notes"].append(f"pushed {len(pushed['files'])} files to {pushed['url']}")
    return data


def _positive_int(flag: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConversionError(f"{flag} must be 'all' or a positive integer, got {text!r}") from None
    if value < 1:
        raise ConversionError(f"{flag} must be 'all' or a positive integer, got {text!r}")
    return value


_EXIT_STATUS: list[int] = []


def exit_without_teardown() -> None:
    """The process's last exit handler (registered before torch's, so it runs after them and after the interpreter
    has joined its threads): with the command's output flushed, end the process without tearing down every module
    object torch made (~0.1-0.3 s of a conversion's start-up that nothing reads). Only for the process the command
    is (:func:`console`: the console script, ``python -m ckptconv.cli``), never for :func:`main` called by a
    script, whose exit status is the script's own."""
    if not _EXIT_STATUS or "torch" not in sys.modules:
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return  # a closed or broken stream: the interpreter's own exit reports it, as before
    os._exit(_EXIT_STATUS[-1])


def _no_exit_handlers_yet() -> bool:
    """No exit handler was registered before the CLI's (the console script's case): ending with os._exit then skips
    nobody's handler. A script that registered its own first keeps the interpreter's normal exit."""
    count = getattr(atexit, "_ncallbacks", None)
    return count is not None and count() == 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_usage(parser, args)
    as_json = getattr(args, "json", False)
    return run_guarded("ckptconv", lambda: _main(args), as_json=as_json, debug=args.debug)


def console() -> NoReturn:
    """The ``ckptconv`` console script and ``python -m ckptconv.cli``: :func:`main` as the whole process, whose exit
    status is main's, ended without tearing torch's modules down (:func:`exit_without_teardown`)."""
    if _no_exit_handlers_yet():
        atexit.register(exit_without_teardown)
    status = main()
    _EXIT_STATUS.append(status)
    sys.exit(status)


def _main(args: argparse.Namespace) -> int:
    def call() -> Any:
        check_sources(args)
        import_quietly(_LIBRARIES.get(args.command))
        return run(args)

    result = reported("ckptconv", call, as_json=getattr(args, "json", False), quiet=getattr(args, "quiet", False))
    if isinstance(result, dict) and result.get("ok") is False:
        # diff's differences are its answer; a trained tag has no conversion fault to report
        verdict = "diff" if args.command == "diff" else "verify" if "trained" in result else "verify failed"
        for problem in result["problems"]:
            print(f"ckptconv: {verdict}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    console()
