"""Tools the policy calls in multi-turn rollouts: the calls parsed from its text (parsers.py), run in sandboxed
processes (executor.py, sandbox.py), and the tools that ship (builtin.py)."""
