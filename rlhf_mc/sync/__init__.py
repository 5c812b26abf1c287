"""The weight resharding bridge: the actor's shards -> the rollout engines, between phases (weights.py)."""
