"""Verifiable rewards: the registry, math answer verification, user callables, the pool."""

import time

import numpy as np
import pytest

from quads_jax.rl.rewards import RewardPool, boxed_match, exact_match, get_reward, last_boxed, math_verify


def test_exact_and_boxed_match():
    assert exact_match(" 42 \n", "42") == 1.0 and exact_match("42.0", "42") == 0.0
    assert last_boxed(r"so \boxed{\frac{1}{2}} and finally \boxed{x^{2}+1}") == "x^{2}+1"
    assert last_boxed("no box") is None and last_boxed(r"\boxed{unclosed") is None
    assert boxed_match(r"... \boxed{7}", "7") == 1.0 and boxed_match("7", "7") == 0.0


def test_math_verify_checks_equivalent_answers():
    assert math_verify(r"The answer is \boxed{0.5}", r"\frac{1}{2}") == 1.0
    assert math_verify(r"so \boxed{\frac{6}{12}}", "0.5") == 1.0
    assert math_verify(r"\boxed{4}", "3") == 0.0
    assert math_verify("}}}{{{ \\boxed{", "3") == 0.0  # unparsable output scores 0


def _shout(completion, answer):
    return float(completion.upper() == answer)


def test_rewards_by_import_path_and_clear_errors():
    assert get_reward("tests.test_rewards:_shout")("ab", "AB") == 1.0
    with pytest.raises(ValueError, match="expected one of"):
        get_reward("bleu")
    with pytest.raises(ValueError, match="cannot import"):
        get_reward("tests.test_rewards:nope")


def test_pool_scores_in_order_off_the_calling_thread():
    def slow(c, a):
        time.sleep(0.05)
        if c == "boom":
            raise RuntimeError("a reward that raises scores 0")
        return float(c == a)

    pool = RewardPool(slow, workers=4)
    comps = [str(i % 3) for i in range(16)] + ["boom"]
    answers = ["1"] * 17
    t0 = time.monotonic()
    fut = pool.submit(comps, answers)
    assert time.monotonic() - t0 < 0.05  # returned at once
    got = fut.result(timeout=10)
    np.testing.assert_array_equal(got, np.array([float(c == "1") for c in comps[:-1]] + [0.0], np.float32))
    assert time.monotonic() - t0 < 16 * 0.05  # in parallel
    pool.close()
