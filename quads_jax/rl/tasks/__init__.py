"""Verifiable tasks. A task is a module-level object with ``name``, ``sample(rng) -> Problem``
and ``reward(problem, completion_text) -> float``; register it in ``TASKS``.

    from quads_jax.rl.tasks import get_task
    task = get_task("addition")
    problems = task.split("train", 1000, seed=0)
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str  # what the policy sees
    answer: str  # the reference answer (used by the reward and by SFT demonstrations)
    demo: str  # a demonstration completion (reasoning + answer) for SFT


class Task:
    name = "task"

    def sample(self, rng: np.random.Generator) -> Problem:
        raise NotImplementedError

    def reward(self, problem: Problem, completion: str) -> float:
        raise NotImplementedError

    def split(self, split: str, n: int, seed: int = 0) -> list[Problem]:
        """Deterministic train / test splits: disjoint seeds, and test prompts never in train."""
        if split not in ("train", "test"):
            raise ValueError(f"split={split!r}: expected 'train' or 'test'")
        rng = np.random.default_rng([seed, 0 if split == "train" else 1, zlib.crc32(self.name.encode())])
        out, seen = [], set()
        held = set() if split == "test" else {p.prompt for p in self.split("test", 256, seed)}
        tries = 0
        while len(out) < n:
            tries += 1
            if tries > 100 * n + 10000:
                raise ValueError(f"{self.name}: could not draw {n} distinct {split} problems (the task has too few)")
            p = self.sample(rng)
            if p.prompt in held or (split == "test" and p.prompt in seen):
                continue
            seen.add(p.prompt)
            out.append(p)
        return out


from quads_jax.rl.tasks.arithmetic import Addition, Countdown  # noqa: E402

TASKS = {t.name: t for t in (Addition(), Countdown())}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"task={name!r}: expected one of {sorted(TASKS)}")
    return TASKS[name]
