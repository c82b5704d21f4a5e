"""The ckptconv command line: argument parsing, the official converter's flags (nxd-compat), one-line errors
and result reports. Imports only what parsing needs, so --help and usage errors never load torch.

The names below are what the trainer (nxdtrain) uses of this room: its entry point.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptconv.hall import lazy_exports

if TYPE_CHECKING:
    from ckptconv.cli.errors import DEBUG_ENV, DEBUG_HELP, debug_requested, describe, run_guarded, warnings_as_notes
    from ckptconv.cli.every import every_flags, every_said
    from ckptconv.cli.layout_args import Parser
    from ckptconv.cli.report import key_values, reported

__getattr__ = lazy_exports(__name__, __file__)
