"""Score shaping that depends on the response, not on its text's correctness."""

from __future__ import annotations


def overlong_penalty(length: int, max_length: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment (verl's DAPO reward manager): 0 up to max_length - buffer tokens, then
    falling linearly to -penalty at max_length tokens. buffer 0: none."""
    if buffer == 0:
        return 0.0
    return min(0.0, -(length - (max_length - buffer)) / buffer * penalty)
