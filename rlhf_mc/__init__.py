"""rlhf_mc: RL post-training for LLMs on Megatron-Core (training), SGLang (rollouts) and Ray (processes)."""

__version__ = "0.1.0"
