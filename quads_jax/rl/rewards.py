"""Verifiable rewards by name, and a pool that scores completions off the critical path.

    fn = get_reward("math_verify")            # or "exact_match", "boxed_match", "pkg.module:function"
    fn(completion_text, answer) -> float
    pool = RewardPool("math_verify", workers=4)
    fut = pool.submit(completions, answers)   # returns at once; the GPU keeps working
    rewards = fut.result()                    # np.float32 [n]

A reward function takes (completion, answer) and returns a float; it must not raise on
model output (a completion that cannot be scored gets 0). ``math_verify`` uses the
``math-verify`` package (HF's answer verifier: boxed answers, LaTeX, fractions, sets).
A user's function is named by import path, ``module:function``.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import re
from typing import Callable, Sequence

import numpy as np

RewardFn = Callable[[str, str], float]


def _normalize(s: str) -> str:
    return re.sub(r"\s+", " ", s.strip())


def exact_match(completion: str, answer: str) -> float:
    """1 when the completion, whitespace-normalized, is the answer."""
    return float(_normalize(completion) == _normalize(answer))


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (balanced braces), or None."""
    i = text.rfind("\\boxed")
    if i < 0:
        return None
    j = text.find("{", i)
    if j < 0:
        return None
    depth = 0
    for k in range(j, len(text)):
        depth += {"{": 1, "}": -1}.get(text[k], 0)
        if depth == 0:
            return text[j + 1:k]
    return None


def boxed_match(completion: str, answer: str) -> float:
    """1 when the last ``\\boxed{}`` of the completion equals the answer as text."""
    got = last_boxed(completion)
    return float(got is not None and _normalize(got) == _normalize(last_boxed(answer) or answer))


def math_verify(completion: str, answer: str) -> float:
    """1 when ``math-verify`` finds the completion's final answer equal to the reference."""
    from math_verify import parse, verify

    try:
        gold = parse(answer if "\\boxed" in answer or "$" in answer else f"${answer}$")
        pred = parse(completion)
        return float(bool(pred) and verify(gold, pred))
    except Exception:  # noqa: BLE001 - unparsable model output scores 0, never fails the step
        return 0.0


REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "boxed_match": boxed_match, "math_verify": math_verify}


def get_reward(spec: str | RewardFn) -> RewardFn:
    """A registered reward by name, a ``module:function`` import path, or a callable."""
    if callable(spec):
        return spec
    if spec in REWARDS:
        return REWARDS[spec]
    if isinstance(spec, str) and ":" in spec:
        mod, _, name = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward={spec!r}: cannot import {name} from {mod} ({e})") from None
        if not callable(fn):
            raise ValueError(f"reward={spec!r}: {name} is not callable")
        return fn
    raise ValueError(f"reward={spec!r}: expected one of {sorted(REWARDS)} or an import path 'module:function'")


def _score(fn, completions, answers):
    out = np.zeros(len(completions), np.float32)
    for i, (c, a) in enumerate(zip(completions, answers)):
        try:
            out[i] = float(fn(c, a))
        except Exception:  # noqa: BLE001 - a reward that raises on one completion scores it 0
            out[i] = 0.0
    return out


class RewardPool:
    """Scores batches of completions in worker threads (``processes=True``: worker processes,
    for rewards that hold the GIL, e.g. sympy; the function must then be importable)."""

    def __init__(self, reward: str | RewardFn, *, workers: int = 4, processes: bool = False):
        self.fn = get_reward(reward)
        self.workers = max(1, int(workers))
        ex = concurrent.futures.ProcessPoolExecutor if processes else concurrent.futures.ThreadPoolExecutor
        self._ex = ex(self.workers)

    def submit(self, completions: Sequence[str], answers: Sequence[str]) -> concurrent.futures.Future:
        """A future of np.float32 rewards [n], scored in ``workers`` chunks."""
        if len(completions) != len(answers):
            raise ValueError(f"completions ({len(completions)}) and answers ({len(answers)}) differ in length")
        n = len(completions)
        step = max(1, -(-n // self.workers))
        parts = [self._ex.submit(_score, self.fn, list(completions[i:i + step]), list(answers[i:i + step]))
                 for i in range(0, n, step)]
        done: concurrent.futures.Future = concurrent.futures.Future()

        def gather(_):
            if all(p.done() for p in parts) and not done.done():
                try:
                    done.set_result(np.concatenate([p.result() for p in parts]) if parts else np.zeros(0, np.float32))
                except Exception as e:  # noqa: BLE001
                    done.set_exception(e)

        for p in parts:
            p.add_done_callback(gather)
        if not parts:
            done.set_result(np.zeros(0, np.float32))
        return done

    def close(self):
        self._ex.shutdown(wait=True)
