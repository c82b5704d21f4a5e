"""The ckptconv command line: argument parsing, the official converter's flags (nxd-compat), one-line errors
and result reports. Imports only what parsing needs, so --help and usage errors never load torch.
"""
