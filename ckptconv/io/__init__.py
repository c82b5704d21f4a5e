"""Every on-disk format, read and written: HF safetensors/.bin, NxD's torch zip and xser, DCP, ckptconv.json,
digests, checked reads, atomic writes. A leaf over the pure core.

The names below are what the trainer (nxdtrain) uses of this room: its entry point.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptconv.hall import lazy_exports

if TYPE_CHECKING:
    from ckptconv.io.atomic import place, remove_path
    from ckptconv.io.checked import CheckedFiles, check_whole_file
    from ckptconv.io.digest import DEFAULT, record_files
    from ckptconv.io.hf import CONFIG, is_hf_dir
    from ckptconv.io.metadata import METADATA_FILE, Metadata, add_version_flag, read_metadata, write_metadata
    from ckptconv.io.nxd import Flavour, resolve_checkpoint
    from ckptconv.io.nxd_read import NxdCheckpoint, load_shard
    from ckptconv.io.nxd_write import save_shard
    from ckptconv.io.tags import (
        CHECKPOINT_MARKER,
        DONE_MARKER,
        OPTIM_DIR,
        SCHEDULER_FILE,
        TAG_MARKERS,
        USER_CONTENT_FILE,
        completed_tags,
        is_step_tag,
        newest_tag,
        tag_name,
        tag_step,
        write_markers,
    )
    from ckptconv.io.torch_save import Extent, plan_object, write_share
    from ckptconv.io.torchzip import TensorMeta, TorchZipWriter, ZipLayout, plan_zip
    from ckptconv.io.transpose import transposed
    from ckptconv.io.write_digest import WriteDigests, recording

__getattr__ = lazy_exports(__name__, __file__)
