"""Arithmetic tasks whose answers need several reasoning tokens.

addition:  "a+b=" with multi-digit operands. The demonstration works column by column,
           least significant digit first, writing each digit with its carry
           ("7+5=12,3+4+1=8:" ...), then the answer after ":". Reward 1 for the exact
           answer after the last ":", else 0.
countdown: reach a target from three numbers with + - * (each used once, any order);
           reward 1 for a valid expression that evaluates to the target.
"""

from __future__ import annotations

import ast
import operator
import re


from quads_jax.rl.tasks import Problem, Task


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate_arithmetic(expr: str, *, max_abs: int = 10**12, max_nodes: int = 64) -> int:
    """The value of an integer expression of + - * and parentheses, parsed, never ``eval``-ed.

    ValueError for anything else (powers, division, names, calls), for more than
    ``max_nodes`` syntax nodes, and for an intermediate value beyond ``max_abs``: model output
    cannot make the reward hang or allocate (``9**9**9`` is refused, not computed)."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expr!r}") from e
    if sum(1 for _ in ast.walk(tree)) > max_nodes:
        raise ValueError(f"expression too long: more than {max_nodes} nodes")

    def ev(n):
        if isinstance(n, ast.Constant) and type(n.value) is int:
            v = n.value
        elif isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            v = _OPS[type(n.op)](ev(n.left), ev(n.right))
        elif isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            v = -ev(n.operand)
        else:
            raise ValueError(f"unsupported syntax in {expr!r}: {type(n).__name__}")
        if abs(v) > max_abs:
            raise ValueError(f"value beyond {max_abs} in {expr!r}")
        return v

    return ev(tree.body)


def _answer_after_colon(text: str) -> str:
    return text.rsplit(":", 1)[-1].strip() if ":" in text else ""


class Addition(Task):
    name = "addition"

    def __init__(self, digits: int = 2):
        self.digits = digits

    def sample(self, rng):
        hi = 10**self.digits
        a, b = int(rng.integers(0, hi)), int(rng.integers(0, hi))
        steps, carry = [], 0
        da, db = str(a).zfill(self.digits)[::-1], str(b).zfill(self.digits)[::-1]
        for x, y in zip(da, db):
            s = int(x) + int(y) + carry
            steps.append(f"{x}+{y}+{carry}={s}")
            carry = s // 10
        ans = str(a + b)
        return Problem(prompt=f"{a}+{b}=", answer=ans, demo=",".join(steps) + ":" + ans)

    def reward(self, problem, completion):
        return float(_answer_after_colon(completion) == problem.answer)


class Countdown(Task):
    name = "countdown"

    def sample(self, rng):
        while True:
            nums = [int(v) for v in rng.integers(1, 10, 3)]
            a, b, c = nums
            ops = [rng.choice(["+", "-", "*"]) for _ in range(2)]
            expr = f"({a}{ops[0]}{b}){ops[1]}{c}"
            target = evaluate_arithmetic(expr)
            if 0 < target < 100:
                return Problem(prompt=f"{a},{b},{c}:{target}=", answer=str(target), demo=expr)

    def reward(self, problem, completion):
        expr = completion.strip()
        if not re.fullmatch(r"[0-9+\-*() ]{1,32}", expr):
            return 0.0
        nums = sorted(re.findall(r"\d+", expr))
        want = sorted(problem.prompt.split(":")[0].split(","))
        if nums != want:
            return 0.0
        try:
            return float(evaluate_arithmetic(expr) == int(problem.answer))
        except ValueError:
            return 0.0
