"""Tools for the tests, in a module of their own: the sandbox imports it, and whatever it imports counts against
every call's memory limit (a test module would bring pytest and torch)."""

from __future__ import annotations

import time


def interval(seconds: float) -> str:
    """Sleeps, and says when it ran.

    Args:
        seconds: how long
    """
    start = time.time()
    time.sleep(seconds)
    return f"{start} {time.time()}"
