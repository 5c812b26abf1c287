"""Batches, prompt datasets, THD packing and micro-batching."""
