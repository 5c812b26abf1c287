"""Rollout engines behind one interface (base.py); SGLang servers launched and supervised here (sglang_engine.py)."""
