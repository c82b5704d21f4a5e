"""How the work is split over processes: the Mesh (NxD's rank order; tp, pp, dp, cp and ep axes), tp layers with NxD's
names, sequence and context parallelism, ring attention, expert dispatch, FSDP wiring, recompute, gradient reductions.
Imports nothing of nxdtrain above config/.
"""
