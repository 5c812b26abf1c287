"""Per-rank work on the models: log-prob forwards, the reference swap (policy.py)."""
