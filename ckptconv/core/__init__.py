"""What a model and a layout are, and how tensors map: spec, families, layout, heads, mapping, plan,
and the decoder math (reference). Pure: no files, no threads; imports nothing of ckptconv but errors.
"""
