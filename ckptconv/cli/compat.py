"""``ckptconv nxd-compat``: the official ``checkpoint_converter.py`` arguments, for drop-in use.

Differences from the official tool, on purpose: booleans are read as written (``--qkv_linear
False`` is False, where the official parser's ``bool(str)`` makes it True); fused QKV is split
by head counts, not in thirds; ``tp < kv heads`` works; trn2 with ``kv_size_multiplier > 1``
gets the runtime-correct K/V layout unless ``--trn2_kv_layout official``; a tied model's shards
get a copy of the embedding as ``lm_head.weight`` (the official tool writes none; both are read);
when merging, the layout ``ckptconv.json`` records wins over the official defaults (``--hw_backend``
defaults to trn1 only when sharding), and a flag given that contradicts it is refused.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ckptconv.core.layout import Attention
from ckptconv.core.layout_flags import LayoutHints
from ckptconv.engine.options import RunOptions
from ckptconv.errors import ConversionError

if TYPE_CHECKING:
    from ckptconv.commands.api import Result

# The conversions (and torch) are imported when one runs: the parser is built by every `ckptconv` call.

TRUE_WORDS = {"true", "1", "yes", "y", "on"}
FALSE_WORDS = {"false", "0", "no", "n", "off"}


BOOL_FLAGS = {
    "--qkv_linear": "GQAQKVColumnParallelLinear layout (weight_q/k/v)",
    "--fuse_qkv": "one fused weight_qkv per layer (with --qkv_linear)",
    "--coalesce_qkv": "coalesced qkv_proj.weight (multi-head attention only)",
    "--save_xser": "write shards in the xser format",
    "--load_xser": "ignored: xser shards are recognised from their files",
}


def parse_bool(text: str) -> bool:
    """``True/False/1/0/yes/no`` as written (the official parser would make ``False`` True)."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected True/False/1/0/yes/no, got {text!r}")


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--convert_from_full_state", action="store_true", help="HF state dict -> NxD shards")
    mode.add_argument("--convert_to_full_state", action="store_true", help="NxD shards -> one checkpoint.pt")
    parser.add_argument("--input_dir", required=True, help="a state-dict file (from_full_state) or the model/ dir")
    parser.add_argument("--output_dir", required=True, help="output directory (shards under model/, or checkpoint.pt)")
    parser.add_argument("--config", required=True, help="HF config.json")
    # Layout defaults are None: 1/trn1 when sharding; when merging, what ckptconv.json records (or the shards show)
    # wins, and only a flag actually given is checked against it.
    parser.add_argument("--tp_size", type=int, default=None, help="tensor-parallel degree (default 1 when sharding)")
    parser.add_argument("--pp_size", type=int, default=None, help="pipeline-parallel degree (default 1 when sharding)")
    # None: 1 when sharding; read from the shards when merging (the official merge needs neither).
    parser.add_argument("--virtual_pp_size", type=int, default=None,
                        help="virtual pipeline stages per pp rank (default 1 when sharding; read from the shards when merging)")
    parser.add_argument("--kv_size_multiplier", type=int, default=None, help="K/V head replication (default 1)")
    for flag, what in BOOL_FLAGS.items():
        parser.add_argument(flag, type=parse_bool, nargs="?", const=True, default=False, metavar="BOOL",
                            help=f"{what} (True/False as written; the flag alone means True)"
                            if flag != "--load_xser" else what)
    parser.add_argument("--hw_backend", choices=("trn1", "trn2"), default=None,
                        help="head order (default trn1 when sharding; when merging, the recorded or observed one)")
    parser.add_argument("--trn2_kv_layout", choices=("runtime", "official"), default=None,
                        help="ckptconv extension: K/V replica order on trn2 (default: what the runtime expects)")
    parser.add_argument("--n_layers", type=int, default=None, help="ignored (as in the official tool)")
    parser.add_argument("--model_style", choices=("hf", "megatron"), default="hf",
                        help="source key style: hf (megatron is not supported)")
    parser.add_argument("--hf_model_name", default=None,
                        help="not supported here: pass --input_dir and --config, or use ckptconv to-nxd ORG/NAME")
    return parser


def run_compat(args: argparse.Namespace, options: RunOptions) -> Result:
    if args.model_style != "hf":
        raise ConversionError("--model_style megatron is not supported; only hf Llama checkpoints")
    if args.hf_model_name:
        raise ConversionError("--hf_model_name is not supported by nxd-compat; pass --input_dir FILE and --config, "
                              "or convert a hub model with: ckptconv to-nxd ORG/NAME OUT --revision REV")
    if args.qkv_linear and args.coalesce_qkv:
        raise ConversionError("--qkv_linear and --coalesce_qkv exclude each other; choose one")
    attention = Attention.QKV_LINEAR if args.qkv_linear else (Attention.COALESCED if args.coalesce_qkv else Attention.SEPARATE)
    if args.convert_from_full_state:
        from ckptconv.commands.api import to_nxd

        return to_nxd(
            args.input_dir, args.output_dir, tp=args.tp_size or 1, pp=args.pp_size or 1, vpp=args.virtual_pp_size or 1,
            kv_size_multiplier=args.kv_size_multiplier or 1, attention=attention, fuse_qkv=args.fuse_qkv,
            hw_backend=args.hw_backend or "trn1", trn2_kv_layout=args.trn2_kv_layout or "runtime",
            flavour="xser-inline" if args.save_xser else "plain", config=args.config, options=options,
        )
    # The official merge reads coalesced and fused keys by their names; so do we (flags only add facts).
    explicit = args.qkv_linear or args.coalesce_qkv
    hints = LayoutHints(dict(tp=args.tp_size, pp=args.pp_size, vpp=args.virtual_pp_size, kvm=args.kv_size_multiplier,
                             attention=attention if explicit else None, fuse_qkv=args.fuse_qkv or None,
                             hw=args.hw_backend, trn2_kv_layout=args.trn2_kv_layout),
                        override=args.override_recorded_layout, style="compat")
    return to_full_state(args.input_dir, args.output_dir, config=args.config, hints=hints, options=options)


def to_full_state(src: str | Path, out: str | Path, *, config: str | Path, hints: dict[str, object],
                  options: RunOptions) -> Result:
    """What the official ``--convert_to_full_state`` writes: ``<out>/checkpoint.pt`` with HF keys."""
    from ckptconv.commands.api import _convert, _fingerprint
    from ckptconv.core.plan import plan_to_full_state
    from ckptconv.engine.finalize import FinalizeSpec
    from ckptconv.io.nxd import Flavour
    from ckptconv.io.nxd_write import sink_factory
    from ckptconv.sources.nxd import open_nxd

    started = time.monotonic()
    out = Path(out)
    opened = open_nxd(src, config=config, hints=hints, io=options.io, check=options.check)
    ckpt, spec, layout, with_inv_freq, notes = (opened.ckpt, opened.spec, opened.layout, opened.with_inv_freq,
                                                opened.notes)
    with ckpt:
        plan = plan_to_full_state(spec, layout, ckpt.dtypes(), with_inv_freq=with_inv_freq)
        fingerprint = _fingerprint("full", layout.to_json(), sorted(str(p) for p in ckpt.files.values()))
        # The official tool writes checkpoint.pt and nothing else; so do we (no ckptconv.json).
        result = _convert(plan, ckpt, out, sink_factory(Flavour.PLAIN), options, FinalizeSpec(fingerprint), "to-full-state",
                          sources=[Path(src), ckpt.root])
    result.notes[:0] = notes
    result.layout = layout.to_json()
    result.seconds = time.monotonic() - started
    return result
