"""HF <-> Megatron: config translation, the weight mapping, sharded loading and streaming export."""
