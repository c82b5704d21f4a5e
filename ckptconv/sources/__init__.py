"""Where a conversion reads from: NxD shards opened and checked (layout recorded or inferred), the fp32
masters of a training tag as its weights, and Hugging Face Hub ids resolved to local folders.
"""
