"""Prompt data sets from local files: JSONL, Parquet, or a ``datasets`` directory.

    cfg = PromptData(path="data/math.jsonl", prompt_field="problem", answer_field="answer",
                     system_prompt="Put the final answer in \\\\boxed{}.", eval_n=500)
    task = DatasetTask(cfg, reward="math_verify")
    train, test = task.split("train", 10_000, seed=0), task.split("test", 500, seed=0)

Rows are shuffled deterministically from ``seed`` and split once: the last ``eval_n`` rows of
the shuffled order are the held-out evaluation set, never seen in training. A ``DatasetTask``
is a ``quads_jax.rl.tasks.Task``, so the RL loop takes it like the built-in tasks. Its
``system`` maps each prompt to its system prompt, which the tokenizer's chat template places
(``quads_jax.rl.hf_tokenizer``).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from quads_jax.config_util import build
from quads_jax.rl.rewards import get_reward
from quads_jax.rl.tasks import Problem, Task


@dataclasses.dataclass(frozen=True)
class PromptData:
    path: str
    format: str = "auto"  # "jsonl" | "parquet" | "datasets" (a save_to_disk directory) | "auto" (by the path)
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    system_prompt: str = ""  # for every row; a row's own ``system_field`` wins where set
    system_field: str = ""
    eval_n: int = 256
    seed: int = 0
    reward: str = "math_verify"

    @classmethod
    def from_dict(cls, d):
        return build(cls, d, "data")


def _format(cfg: PromptData) -> str:
    if cfg.format != "auto":
        if cfg.format not in ("jsonl", "parquet", "datasets"):
            raise ValueError(f"data.format={cfg.format!r}: expected 'jsonl', 'parquet', 'datasets' or 'auto'")
        return cfg.format
    if os.path.isdir(cfg.path):
        return "datasets"
    ext = os.path.splitext(cfg.path)[1].lower()
    if ext in (".jsonl", ".json"):
        return "jsonl"
    if ext == ".parquet":
        return "parquet"
    raise ValueError(f"data.path={cfg.path!r}: cannot tell the format from the name; set data.format")


def read_rows(cfg: PromptData) -> list[dict]:
    """All rows of the file as dicts, in file order."""
    if not os.path.exists(cfg.path):
        raise FileNotFoundError(f"data.path not found: {cfg.path}")
    fmt = _format(cfg)
    if fmt == "jsonl":
        rows = []
        with open(cfg.path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{cfg.path}:{n}: not a JSON object ({e})") from None
        return rows
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(cfg.path).to_pylist()
    import datasets

    ds = datasets.load_from_disk(cfg.path)
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    return ds.to_list()


def load_problems(cfg: PromptData) -> tuple[list[Problem], list[Problem], list[str]]:
    """(train problems, held-out problems, their system prompts in the same order as train +
    held-out), shuffled and split deterministically."""
    rows = read_rows(cfg)
    for f in (cfg.prompt_field, cfg.answer_field):
        missing = [i for i, r in enumerate(rows) if f not in r]
        if missing:
            raise ValueError(f"{cfg.path}: rows {missing[:5]} have no field {f!r} (data.prompt_field / data.answer_field)")
    order = np.random.default_rng(cfg.seed).permutation(len(rows))
    if not 0 <= cfg.eval_n < len(rows):
        raise ValueError(f"data.eval_n={cfg.eval_n}: expected 0 <= eval_n < the {len(rows)} rows of {cfg.path}")
    probs = [Problem(prompt=str(rows[i][cfg.prompt_field]), answer=str(rows[i][cfg.answer_field]),
                     demo=str(rows[i].get("solution", rows[i][cfg.answer_field]))) for i in order]
    systems = [str(rows[i].get(cfg.system_field) or cfg.system_prompt) if cfg.system_field else cfg.system_prompt
               for i in order]
    cut = len(probs) - cfg.eval_n
    return probs[:cut], probs[cut:], systems


class DatasetTask(Task):
    """A prompt data set with a verifiable reward, as a ``Task``."""

    def __init__(self, cfg: PromptData, reward=None):
        self.cfg = cfg
        self.name = f"data:{os.path.basename(cfg.path)}"
        self.train, self.test, systems = load_problems(cfg)
        self.system = {p.prompt: s for p, s in zip(self.train + self.test, systems)}
        self.reward_fn = get_reward(reward or cfg.reward)

    def sample(self, rng):
        return self.train[int(rng.integers(len(self.train)))]

    def reward(self, problem, completion):
        return float(self.reward_fn(completion, problem.answer))

    def split(self, split: str, n: int, seed: int = 0) -> list[Problem]:
        """The first ``n`` rows of the split, or all of them where it has fewer (the job's
        ``train_n`` / ``rl.eval_n`` are caps here; the split itself is fixed by ``data.seed``)."""
        if split not in ("train", "test"):
            raise ValueError(f"split={split!r}: expected 'train' or 'test'")
        return (self.train if split == "train" else self.test)[: max(0, int(n))]
