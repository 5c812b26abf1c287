"""Numerical ops on sharded tensors: vocab-parallel log-probs and entropy (logprobs.py)."""
