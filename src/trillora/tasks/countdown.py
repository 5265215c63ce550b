"""Generated Countdown: reach the target with each given number used exactly once.

Prompt `3 5 7>22:`; a correct completion is an expression such as `3*5+7`.
"""

from __future__ import annotations

import ast
import random
from collections import Counter
from dataclasses import dataclass

from .base import Problem, Task, first_line

_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def evaluate(expression: str) -> tuple[int, list[int]] | None:
    """(value, numbers used) of an expression of integers, + - * and parentheses; None if anything else."""
    if len(expression) > 64:
        return None
    try:
        tree = ast.parse(expression, mode="eval").body
    except SyntaxError:
        return None
    used: list[int] = []

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return node.value
        raise ValueError("not allowed")

    try:
        return walk(tree), used
    except ValueError:
        return None


@dataclass
class CountdownTask(Task):
    reward_is_ours = True
    count: int = 3
    max_number: int = 9
    name: str = "countdown"

    def sample(self, rng: random.Random) -> Problem:
        nums = [rng.randint(1, self.max_number) for _ in range(self.count)]
        order = nums[:]
        rng.shuffle(order)
        expr = str(order[0])
        for n in order[1:]:
            expr = f"{expr}{rng.choice('+-*')}{n}"
        target = evaluate(expr)[0]
        return Problem(
            prompt=f"{' '.join(map(str, nums))}>{target}:", answer=expr, data={"numbers": nums, "target": target}
        )

    def reward(self, problem: Problem, completion: str) -> float:
        result = evaluate(first_line(completion))
        if result is None:
            return 0.0
        value, used = result
        return float(value == problem.data["target"] and Counter(used) == Counter(problem.data["numbers"]))
