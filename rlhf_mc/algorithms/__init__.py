"""Advantage estimators, policy/value losses, KL estimators and loss aggregation: pure functions (core.py)."""
