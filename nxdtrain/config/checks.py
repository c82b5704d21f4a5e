"""What a run's option values refuse, checked before any process starts: plain values (:func:`is_int`) and what
``--shard-params`` / ``--hybrid-shard N`` / ``--offload-activations`` refuse.

Plain arithmetic on the options (no torch), so that :mod:`nxdtrain.config.options` and ``prepare`` refuse a run in
one line.

    >>> is_int(2), is_int(True), is_int(2.0)
    (True, False, False)
    >>> shard_degree(shard_params=True, hybrid_shard=None, dp=4), shard_degree(shard_params=False, hybrid_shard=2, dp=4)
    (4, 2)
    >>> sharding_limits(shard_params=True, hybrid_shard=None, zero1=False, pp=2, cp=1)[:36]
    '--shard-params with --pp 2: FSDP2 is'
"""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    """An integer, not a bool (YAML's ``true`` is no count of ranks or steps)."""
    return isinstance(value, int) and not isinstance(value, bool)


# Why XLA is refused, in one place (config for --device xla, prepare for --device auto resolving to xla).
XLA_WHY = ("torch's FSDP2 (fully_shard) keeps parameters as DTensors and overlaps their all-gathers and "
           "reduce-scatters on CUDA streams; torch-xla runs neither (it has its own XLA FSDP, which nxdtrain does "
           "not use); use --zero1 to shard the optimizer state on xla, or train with --shard-params on --device "
           "cpu/cuda")


def flag(*, shard_params: bool, hybrid_shard: int | None) -> str:
    """The flag the user gave, for messages."""
    return f"--hybrid-shard {hybrid_shard}" if hybrid_shard is not None else "--shard-params"


def sharding_limits(*, shard_params: bool, hybrid_shard: int | None, zero1: bool, pp: int, cp: int) -> str | None:
    """Why these options cannot shard parameters (one line), or None (also None when nothing is sharded)."""
    if not shard_params and hybrid_shard is None:
        return None
    given = flag(shard_params=shard_params, hybrid_shard=hybrid_shard)
    if shard_params and hybrid_shard is not None:
        return (f"--shard-params and --hybrid-shard {hybrid_shard} exclude each other: --shard-params shards over "
                "all dp ranks, --hybrid-shard N over groups of N; give one")
    if hybrid_shard is not None and (not is_int(hybrid_shard) or hybrid_shard < 2):
        return f"--hybrid-shard must be an integer >= 2 (ranks per sharding group), got {hybrid_shard!r}"
    if zero1:
        return (f"{given} with --zero1: the optimizer state is sharded already (with the parameters and gradients); "
                "drop --zero1")
    if pp > 1:
        return (f"{given} with --pp {pp}: FSDP2 is not wired into nxdtrain's pipeline schedules (the tied "
                "embedding's first/last-stage sum and the stage exchange run on unsharded tensors); use --pp 1, or "
                "--zero1 with --pp")
    if cp > 1:
        return (f"{given} with --context-parallel {cp}: nxdtrain's FSDP mesh is the dp dimension only and the "
                "gradients of a cp replica are summed over dp x cp; use --context-parallel 1, or --zero1")
    return None


def shard_degree(*, shard_params: bool, hybrid_shard: int | None, dp: int) -> int | None:
    """How many dp ranks share one copy of the parameters (None: not sharded)."""
    if hybrid_shard is not None:
        return hybrid_shard
    return dp if shard_params else None


def check_degree(*, hybrid_shard: int | None, dp: int) -> str | None:
    """Why the sharding degree does not fit ``dp`` data-parallel ranks (one line), or None."""
    if hybrid_shard is None:
        return None
    if hybrid_shard > dp or dp % hybrid_shard:
        return (f"--hybrid-shard {hybrid_shard} must divide the data-parallel size {dp} (world / (tp x pp x cp)); "
                f"use a divisor of {dp} (--shard-params: all {dp})")
    return None


def xla_refusal(*, shard_flag: str | None, offload: bool) -> str | None:
    """Why a sharded (``shard_flag``: the flag given) or offloading run cannot use ``--device xla``, or None."""
    if shard_flag is not None:
        return f"{shard_flag} with --device xla: {XLA_WHY}"
    if offload:
        return ("--offload-activations with --device xla: save_on_cpu copies every saved activation to the host "
                "inside the step, which cuts the step's one XLA graph into many; drop --offload-activations "
                "(--activation-checkpointing saves memory on xla)")
    return None
