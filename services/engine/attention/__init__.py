"""Attention over the paged KV cache: the backend contract, its metadata, the reference and Triton paths."""
