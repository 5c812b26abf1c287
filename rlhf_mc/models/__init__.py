"""Megatron-Core models for the current rank: config -> TransformerConfig + layer spec -> GPTModel chunks."""
