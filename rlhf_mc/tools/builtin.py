"""The tools that ship: a calculator and a Python interpreter. Like any tool they run in the sandbox
(tools/sandbox.py), which holds their time, memory and network limits; standard library only."""

from __future__ import annotations

import ast
import contextlib
import io
import operator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 1000


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is over {MAX_EXPONENT}")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 12"
    """
    value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


class _Capped(io.StringIO):
    """Keeps the first `limit` characters written to it; the rest is counted, not stored."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.dropped = limit, 0

    def write(self, text: str) -> int:
        room = max(0, self.limit - self.tell())
        self.dropped += max(0, len(text) - room)
        return super().write(text[:room]) + max(0, len(text) - room)


def python(code: str) -> str:
    """Runs Python code and returns what it printed, then the value of its last line if that is an expression.

    Args:
        code: the program
    """
    tree = ast.parse(code)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    out = _Capped(1 << 16)
    scope: dict = {"__name__": "__main__"}
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        exec(compile(tree, "<tool>", "exec"), scope)  # noqa: S102 - it runs in the sandbox
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), scope)  # noqa: S307
            if value is not None:
                print(repr(value))
    text = out.getvalue()
    return text + (f"\n[{out.dropped} more characters not shown]" if out.dropped else "")
