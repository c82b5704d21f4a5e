"""How the work is split over processes: the world and its groups in NxD's rank order, tp layers with NxD's
names, sequence and context parallelism, ring attention, the pipeline schedule, recompute, gradient reductions.
"""
