"""``ckptconv nxd-compat``: the official ``checkpoint_converter.py`` arguments, for drop-in use.

Differences from the official tool, on purpose: booleans are read as written (``--qkv_linear
False`` is False, where the official parser's ``bool(str)`` makes it True); fused QKV is split
by head counts, not in thirds; ``tp < kv heads`` works; trn2 with ``kv_size_multiplier > 1``
gets the runtime-correct K/V layout unless ``--trn2_kv_layout official``; a tied model's shards
get a copy of the embedding as ``lm_head.weight`` (the official tool writes none; both are read);
when merging, the layout ``ckptconv.json`` records wins over the official defaults (``--hw_backend``
defaults to trn1 only when sharding), and a flag given that contradicts it is refused; when sharding,
``--kv_size_multiplier`` not given is what tp needs (the official tool's default 1 is invalid for tp > kv
heads). The layout flags are generated from :class:`ckptconv.core.layout_flags.LayoutOverrides`.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ckptconv.cli.layout_args import add_layout_flags, overrides_from, parse_bool
from ckptconv.engine.options import RunOptions
from ckptconv.errors import ConversionError

if TYPE_CHECKING:
    from ckptconv.engine.run import Result

# The conversions (and torch) are imported when one runs: the parser is built by every `ckptconv` call.

__all__ = ["build_parser", "parse_bool", "run_compat"]

XSER_FLAGS = {
    "--save_xser": "write shards in the xser format",
    "--load_xser": "ignored: xser shards are recognised from their files",
}


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--convert_from_full_state", action="store_true", help="HF state dict -> NxD shards")
    mode.add_argument("--convert_to_full_state", action="store_true", help="NxD shards -> one checkpoint.pt")
    parser.add_argument("--input_dir", required=True, help="a state-dict file (from_full_state) or the model/ dir")
    parser.add_argument("--output_dir", required=True, help="output directory (shards under model/, or checkpoint.pt)")
    parser.add_argument("--config", required=True, help="HF config.json")
    # Layout defaults are None: tp 1 x pp 1 when sharding (the kv multiplier: what tp needs); when merging, what
    # ckptconv.json records (or the shards show) wins, and only a flag actually given is checked against it.
    add_layout_flags(parser, style="compat")
    parser.add_argument("--save_xser", type=parse_bool, nargs="?", const=True, default=False, metavar="BOOL",
                        help=XSER_FLAGS["--save_xser"] + " (True/False as written; the flag alone means True)")
    parser.add_argument("--load_xser", type=parse_bool, nargs="?", const=True, default=False, metavar="BOOL",
                        help=XSER_FLAGS["--load_xser"])
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
    # The official merge reads coalesced and fused keys by their names; so do we (flags only add facts).
    flags = overrides_from(args, style="compat", override=args.override_recorded_layout)
    if args.convert_from_full_state:
        from ckptconv.commands.api import to_nxd

        return to_nxd(args.input_dir, args.output_dir, layout=flags,
                      flavour="xser-inline" if args.save_xser else "plain", config=args.config, options=options)
    from ckptconv.commands.full_state import to_full_state

    return to_full_state(args.input_dir, args.output_dir, config=args.config, hints=flags, options=options)
