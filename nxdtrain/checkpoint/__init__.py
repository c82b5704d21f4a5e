"""Checkpoints: tags in NxD's layout and the rules for resuming from a path, one rank's state restored
from a tag of any layout, NxD's own tags, the run record a resume must keep, and the first-loss load check.
"""
