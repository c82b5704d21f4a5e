"""Running a plan: the executor (bounded memory, workers, atomic resumable writes), ownership of OUT,
finishing a run split into parts, run options, progress, and which launcher started this process.
"""
