"""Training state, a room per optimizer format (``nxdtrain_format/``: nxdtrain's; ``nxd_format/``: NxD's own, read
and written, its side files and training position), the expert-parallel arithmetic both packages use (``ep``),
learning-rate schedules, and a training tag's reshard split into parts.

The names below are what the trainer (nxdtrain) uses of this room: its entry point.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptconv.hall import lazy_exports

if TYPE_CHECKING:
    from ckptconv.engine.tags import RECORD_KEY, run_record
    from ckptconv.training.ep import check_zero1_ep, ep_fits, expert_data_rank, expert_dp_groups, optimizer_ep_rank
    from ckptconv.training.nxd_format.as_source import NxdTagOptimizer
    from ckptconv.training.nxd_format.position import nxd_position
    from ckptconv.training.nxd_format.ranks import OptimFormat
    from ckptconv.training.nxd_format.read import NxdOptimizer
    from ckptconv.training.nxd_format.write import DEFAULT_RULE, NXD_OPTIMIZER_KEY, NXDTRAIN_KEY
    from ckptconv.training.nxdtrain_format.state import FORMAT as OPTIMIZER_FORMAT
    from ckptconv.training.nxdtrain_format.state import (
        MASTER,
        OPTIM_DIR,
        SCHEDULER_FILE,
        USER_CONTENT_FILE,
        Hyper,
        OptimizerSource,
        TagOptimizer,
        TagReader,
        describe_zero1,
        is_training_tag,
        optimizer_file,
        plain_group,
        stage_shapes,
        state_key,
        state_tensors,
    )
    from ckptconv.training.schedules import NXDT_SCHEDULES, lr_at, nxdt_lr

__getattr__ = lazy_exports(__name__, __file__)
