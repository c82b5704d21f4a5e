"""Training state: optimizer formats (nxdtrain's, NxD's own, read and written), how they ride a plan,
training positions and schedules, the side files each trainer resumes from, and a tag reshard split into parts.

The names below are what the trainer (nxdtrain) uses of this room: its entry point.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptconv import lazy_exports

if TYPE_CHECKING:
    from ckptconv.training.nxd_optimizer import NxdOptimizer
    from ckptconv.training.nxd_optimizer_ranks import OptimFormat
    from ckptconv.training.nxd_optimizer_write import DEFAULT_RULE, NXD_OPTIMIZER_KEY, NXDTRAIN_KEY
    from ckptconv.training.nxd_tag_optimizer import NxdTagOptimizer
    from ckptconv.training.optim_placement import expert_dp_groups, optimizer_ep_rank, shard_ranks
    from ckptconv.training.position import nxd_position
    from ckptconv.training.schedules import NXDT_SCHEDULES, lr_at, nxdt_lr
    from ckptconv.training.state import FORMAT as OPTIMIZER_FORMAT
    from ckptconv.training.state import (
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
    from ckptconv.training.tag_files import RECORD_KEY, run_record

__getattr__ = lazy_exports(__name__, __file__)
