"""Training data: rows from datasets folders, jsonl or synthetic, checked before any process starts;
packing raw text into rows (data pack); how many steps an epoch is.
"""
