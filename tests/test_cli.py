"""The quads command as a newcomer meets it: one vocabulary of recipes, run directories
accepted where checkpoints are, one-line errors, paths that resolve from anywhere."""

import json
import os
import subprocess
import sys

import pytest

from quads_jax import cli
from quads_jax import precision as P
from quads_jax.metrics import MetricsWriter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_one_set_of_recipe_names():
    for name in P.RECIPES:  # every job recipe is servable by its own name: its rollout side
        assert P.rollout_recipe(name) == P.ROLLOUT_RECIPES[P.RECIPES[name][1]]
    assert P.rollout_recipe("quads").rac_ratio == 0.5 and P.rollout_recipe("w4a16_qat").rac_ratio == 0.0
    with pytest.raises(ValueError, match="nvfp4_naive"):
        P.rollout_recipe("nvfp4")  # the old rollout-only name is gone; the error lists the names


def test_checkpoint_dir_takes_a_run_directory(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "sft" / "base").mkdir(parents=True)
    assert cli.checkpoint_dir(str(tmp_path / "run")) == str(tmp_path / "run" / "checkpoints")
    assert cli.checkpoint_dir(str(tmp_path / "sft")) == str(tmp_path / "sft" / "base")
    (tmp_path / "other").mkdir()
    assert cli.checkpoint_dir(str(tmp_path / "other")) == str(tmp_path / "other")
    with pytest.raises(FileNotFoundError, match="--checkpoint .*nothing: no such directory"):
        cli.checkpoint_dir(str(tmp_path / "nothing"))


def test_user_errors_are_one_line_and_paths_resolve_from_anywhere(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    run = lambda *args: subprocess.run([sys.executable, "-m", "quads_jax.cli", *args], cwd=tmp_path, env=env,
                                       capture_output=True, text=True, timeout=300)
    p = run("export", "--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().startswith("quads export: error: --checkpoint") and len(p.stderr.strip().splitlines()) == 1
    p = run("train", "--set", "rl.recipe=nvfp4")  # the default config, found from another directory
    assert p.returncode == 2 and "rl.recipe='nvfp4'" in p.stderr and "Traceback" not in p.stderr
    p = run("--debug", "train", "--set", "rl.recipe=nvfp4")
    assert p.returncode != 0 and "Traceback" in p.stderr


def _fake_run(d, recipe, bf16_first, bf16_last, gap):
    os.makedirs(d)
    w = MetricsWriter(str(d), ["step", "reward_mean", "pass_at_1", "pass_at_1_bf16", "gap_max", "gap_mean", "k3_kl"])
    w.write(0, {"reward_mean": 0.2, "pass_at_1": 0.3, "pass_at_1_bf16": bf16_first, "gap_max": 1.0, "gap_mean": gap, "k3_kl": 0.01})
    w.write(1, {"reward_mean": 0.4, "pass_at_1": 0.5, "pass_at_1_bf16": bf16_last, "gap_max": 1.0, "gap_mean": gap, "k3_kl": 0.01})
    w.close()
    return {"recipe": recipe, "pass_at_1_bf16_first": bf16_first, "pass_at_1_bf16_last": bf16_last, "gap_mean_avg": gap}


def test_compare_output_plots_and_tells_its_story(tmp_path):
    rows = [_fake_run(tmp_path / "cmp" / r, r, 0.3, last, gap)
            for r, last, gap in (("bf16", 0.6, 0.001), ("nvfp4_naive", 0.4, 0.02), ("quads", 0.58, 0.005))]
    png = cli.main(["plot", str(tmp_path / "cmp"), "--out", str(tmp_path / "p.png")])
    assert png == 0 and os.path.getsize(tmp_path / "p.png") > 0  # a compare directory plots its runs
    text = cli.story(rows)
    assert len(text.splitlines()) == 2
    assert "bf16: 0.30 -> 0.60" in text and "nvfp4_naive 0.0200 (20.0x bf16)" in text and "quads 0.0050 (5.0x bf16)" in text


def test_the_qwen3_30b_example_config_parses(tmp_path):
    """configs/qwen3_30b_a3b.yaml against Qwen3-30B-A3B's published config.json."""
    from quads_jax.rl import loop

    hf = tmp_path / "Qwen3-30B-A3B"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144, "rope_theta": 1e6,
        "max_position_embeddings": 40960, "tie_word_embeddings": False, "norm_topk_prob": True}))
    cfg = loop.JobConfig.load(os.path.join(ROOT, "configs", "qwen3_30b_a3b.yaml"), {"model.hf": str(hf)})
    n = cfg.model.param_counts()
    assert 30.0e9 < n["total"] < 31.0e9 and 3.0e9 < n["active"] < 3.6e9
    assert cfg.model.remat == "full" and cfg.model.max_seq_len == 8192 and cfg.mesh == {"expert": 8, "fsdp": 1}
    assert cfg.rl.recipe == "quads" and cfg.data.reward == "math_verify" and cfg.tokenizer == str(hf)
