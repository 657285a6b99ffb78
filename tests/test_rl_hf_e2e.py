"""The whole real-model path on a CPU: a tiny random Qwen3-MoE in Hugging Face format, a
tokenizer trained here, a JSONL of arithmetic word problems, GRPO steps in the quads recipe
from the HF checkpoint, the RL policy checkpointed, and an export that transformers reloads."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Hugging Face path needs transformers + torch (the torch extra)")
transformers = pytest.importorskip("transformers")

from tests.test_rl_data import make_hf_tokenizer  # noqa: E402


def length_reward(completion: str, answer: str) -> float:
    """A user reward given by import path: a random policy's completions differ in it, so
    the advantages (and the update) are not zero."""
    return min(len(completion), 40) / 40.0


@pytest.mark.slow  # a minute or more on 2 cores (CI): ./test.sh -m slow
def test_hf_checkpoint_tokenizer_and_jsonl_through_grpo_to_an_export(tmp_path):
    from quads_jax.rl import loop
    from quads_jax.train.checkpoint import Checkpointer
    from rollout import bridge

    rng = np.random.default_rng(0)
    rows = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?", "answer": str(a + b)}
            for a, b in rng.integers(1, 20, (60, 2))]
    (tmp_path / "problems.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    lines = [r["question"] + " The answer is " + r["answer"] + "." for r in rows] * 4
    tok_dir = make_hf_tokenizer(tmp_path / "model", lines)
    vocab = len(transformers.AutoTokenizer.from_pretrained(tok_dir))
    torch.manual_seed(0)
    c = transformers.Qwen3MoeConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                                    eos_token_id=transformers.AutoTokenizer.from_pretrained(tok_dir).eos_token_id)
    transformers.Qwen3MoeForCausalLM(c).save_pretrained(tmp_path / "model")  # beside its tokenizer
    (tmp_path / "job.yaml").write_text(f"""
seed: 0
model: {{hf: {tmp_path / 'model'}, compute_dtype: float32, max_seq_len: 96}}
data: {{path: {tmp_path / 'problems.jsonl'}, prompt_field: question, answer_field: answer, eval_n: 8,
       system_prompt: "Answer with a number.", reward: "tests.test_rl_hf_e2e:length_reward"}}
rl: {{recipe: quads, steps: 2, prompts_per_step: 2, max_new_tokens: 8, eval_every: 1, eval_n: 4, seq_len: 64,
     grpo: {{group_size: 4, micro_batches: 2}}, optim: {{lr: 1.0e-3, warmup_steps: 1}}}}
""")
    cfg = loop.JobConfig.load(str(tmp_path / "job.yaml"))
    assert cfg.hf and cfg.tokenizer == cfg.hf and cfg.model.vocab_size == vocab
    graphdef, params, mcfg = loop.base_policy(cfg, str(tmp_path / "run"))
    state, hist = loop.run_grpo(cfg, graphdef, params, mcfg, str(tmp_path / "run"))
    assert [h["step"] for h in hist if "reward_mean" in h] == [0, 1] and all(np.isfinite(h["loss"]) for h in hist if "loss" in h)
    assert "pass_at_1" in hist[-1] and "pass_at_1_bf16" in hist[-1]
    assert any(not np.array_equal(np.asarray(state.params[k]), np.asarray(params[k])) for k in params)  # it trained
    assert Checkpointer(str(tmp_path / "run" / "checkpoints")).latest_step() == 2
    # back to Hugging Face: BF16 safetensors that transformers loads, and the NVFP4 ModelOpt layout
    out = bridge.export_hf(mcfg, state.params, str(tmp_path / "export"), dtype=jnp.float32)
    assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "float32"
    m2 = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = np.asarray([[1, 5, 9, 12, 3]])
    with torch.no_grad():
        want = m2(torch.tensor(ids)).logits.float().numpy()
    from quads_jax.train.state import to_model
    got = np.asarray(to_model(graphdef, state.params)(jnp.asarray(ids)))
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    q = bridge.export_modelopt_nvfp4(mcfg, state.params, str(tmp_path / "nvfp4"), recipe="quads")
    assert json.load(open(os.path.join(q, "config.json")))["quantization_config"]["quant_algo"] == "NVFP4"
