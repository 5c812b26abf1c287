"""Rule rewards: the final answer of a math response (GSM8K "#### 42", LaTeX \\boxed{42}, or the last number),
normalized and compared with the ground truth; and a format check."""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer: after the last "####", else inside the last \\boxed{}, else the last number."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize(answer: str) -> str:
    """Strips $, units-free commas, trailing periods and spaces; numbers in canonical form (1,000.50 -> 1000.5,
    3/6 -> 1/2)."""
    s = answer.strip().strip("$").rstrip(".").replace(",", "").replace(" ", "")
    s = re.sub(r"^\\text\{(.*)\}$", r"\1", s)
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return s
    return str(value.numerator) if value.denominator == 1 else str(value)


def math_reward(response: str, answer: str, prompt: str = "") -> float:
    """1.0 when the response's final answer equals the ground truth after normalization, else 0.0."""
    predicted = extract_answer(response)
    truth = extract_answer(answer) if ("####" in answer or "\\boxed" in answer) else answer
    return float(predicted is not None and truth is not None and normalize(predicted) == normalize(truth))


def format_reward(response: str, answer: str = "", prompt: str = "", pattern: str = r"(?s).*####\s*\S+\s*$"
                  ) -> float:
    """1.0 when the whole response matches `pattern` (default: it ends with "#### <answer>")."""
    return float(re.fullmatch(pattern, response.strip()) is not None)


def math_and_format_reward(response: str, answer: str, prompt: str = "", format_weight: float = 0.1) -> float:
    """math_reward plus format_weight x format_reward (the format alone earns a little)."""
    return math_reward(response, answer) + format_weight * format_reward(response)


BUILTIN = {"math": math_reward, "format": format_reward, "math_and_format": math_and_format_reward}
