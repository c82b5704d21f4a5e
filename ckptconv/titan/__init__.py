"""TorchTitan: its parameter names and row order per family, a training tag's optimizer state and schedule
as TorchTitan's DCP values, and the plans into and out of its DCP layout.
"""
