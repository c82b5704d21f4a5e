"""The expert-parallel arithmetic, once for both packages (the converter's placement of optimizer state, NxD's
optimizer files read and written, nxdtrain's mesh and saves): NxD's expert mesh ``[PP, DP_exp, EP, TP]`` carves the
ep ranks out of the dp ranks, ``dp_rank = dp_exp_rank * ep + ep_rank``.

    >>> [optimizer_ep_rank(d, 2) for d in range(4)], [expert_data_rank(d, 2) for d in range(4)]
    ([0, 1, 0, 1], [0, 0, 1, 1])
    >>> expert_dp_groups(4, 2)
    ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
"""

from __future__ import annotations

from ckptconv.errors import ConversionError


def optimizer_ep_rank(dp_rank: int, ep: int) -> int:
    """The ep rank of dp rank ``dp_rank`` (whose experts its optimizer file holds); 0 without expert parallelism."""
    return dp_rank % ep


def expert_data_rank(dp_rank: int, ep: int) -> int:
    """The rank of dp rank ``dp_rank`` in its ep rank's expert-data-parallel group (its ZeRO-1 chunk of the experts)."""
    return dp_rank // ep


def ep_fits(dp: int, ep: int) -> bool:
    """Whether ``ep`` ep ranks can be carved out of ``dp`` dp ranks (NxD's ``initialize_model_parallel`` refuses the
    world otherwise)."""
    return dp % ep == 0


def expert_dp_groups(dp: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(ep groups, expert-data-parallel groups) as dp ranks: an ep group, the ep ranks of one dp_exp rank; an
    expert-data-parallel group, the dp_exp ranks of one ep rank (over which its experts' gradients are summed and
    their optimizer state ZeRO-1-partitioned)."""
    outer = dp // ep
    return ([[d * ep + e for e in range(ep)] for d in range(outer)],
            [[d * ep + e for d in range(outer)] for e in range(ep)])


def check_zero1_ep(dp: int, ep: int) -> None:
    """ZeRO-1 at ep > 1 partitions each ep rank's experts over its dp / ep expert-data-parallel ranks: dp must be a
    multiple of ep (NxD's ``initialize_model_parallel`` refuses the world otherwise)."""
    if ep > 1 and not ep_fits(dp, ep):
        raise ConversionError(f"--dp {dp} with ZeRO-1 at ep {ep}: dp must be a multiple of ep (each ep rank's "
                              f"experts are ZeRO-1-partitioned over dp / ep ranks)")
