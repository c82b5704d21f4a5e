"""Running a plan: the executor (bounded memory, workers, atomic resumable writes), ownership of OUT,
finishing a run split into parts, run options, progress, and which launcher started this process.

The names below are what the trainer (nxdtrain) uses of this room: its entry point (``outdir``, the
ownership protocol of every directory we write, as one namespace).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptconv.hall import lazy_exports

if TYPE_CHECKING:
    from ckptconv.engine import outdir
    from ckptconv.engine.execute import read_tensor
    from ckptconv.engine.launcher import detect_launch, local_world_size
    from ckptconv.engine.options import NXD_PARAM_GROUPS, usable_cpus
    from ckptconv.engine.outdir import TMP_DIR
    from ckptconv.engine.snapshots import export_every, stop_on_interrupt
    from ckptconv.engine.tags import (
        RECORD_KEY,
        TAG_ENTRIES,
        claim_tag,
        clear_tag,
        complete_as_tag,
        file_records,
        finish_tag,
        remove_tag,
        run_record,
        save_torch,
        seal,
        tag_writes,
    )

__getattr__ = lazy_exports(__name__, __file__)
