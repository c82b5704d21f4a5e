"""The verbs of the Python API, one module each (to_nxd/to_hf/reshard, verify, inspect, to_dcp/from_dcp):
thin, they parse nothing; each opens its source, plans with core, runs the plan with engine, reports.
"""
