"""Rollout side: weight bridge, HF / ModelOpt exports, the SGLang-API server end to end."""

import concurrent.futures
import json
import os
import socket
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from quads_jax import precision as P
from quads_jax.model import ModelConfig, Transformer
from quads_jax.train.checkpoint import Checkpointer
from quads_jax.train.state import init_state, split_params
from rollout import bridge
from rollout.client import RolloutClient, RolloutError
from rollout.engine import Engine, Request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4,
                  experts_per_token=2, expert_ffn=64, max_seq_len=64, compute_dtype="float32")


def _params(cfg, seed):
    return split_params(Transformer(cfg, rngs=nnx.Rngs(seed)))[1]


def _save(directory, params, step):
    ck = Checkpointer(directory, save_every=1, async_save=False)
    st = init_state(params, optax.adam(1e-3))
    ck.save(st.__class__(params=st.params, opt_state=st.opt_state, step=jnp.int32(step), skipped=st.skipped, rng=st.rng),
            force=True)
    ck.wait()
    ck.close()


GREEDY = [Request(prompt=[1, 5, 9, 11], max_new_tokens=6, temperature=0.0), Request(prompt=[1, 7], max_new_tokens=6, temperature=0.0)]


def test_bridge_orbax_round_trip_push_and_failed_load_keeps_weights(tmp_path):
    p1, p2 = _params(CFG, 1), _params(CFG, 2)
    _save(str(tmp_path / "ck"), p2, step=7)
    eng = Engine(CFG, recipe="bf16", max_batch=2, max_len=32)
    br = bridge.WeightBridge(eng)
    br.push(p1, version="v1")
    out1 = [r.output_ids for r in eng.generate(GREEDY)]
    assert br.load_from_disk(str(tmp_path / "ck")) == "step-7"
    res = eng.generate(GREEDY)
    assert all(r.weight_version == "step-7" for r in res)
    ref = Engine(CFG, recipe="bf16", max_batch=2, max_len=32)
    ref.load(p2)
    assert [r.output_ids for r in res] == [r.output_ids for r in ref.generate(GREEDY)]  # the restored weights
    assert [r.output_ids for r in res] != out1
    with pytest.raises(FileNotFoundError, match="not found"):
        br.load_from_disk(str(tmp_path / "nope"))
    other = CFG.replace(d_model=32, head_dim=8)
    _save(str(tmp_path / "small"), _params(other, 0), step=1)
    with pytest.raises(ValueError, match="does not fit|shape"):
        br.load_from_disk(str(tmp_path / "small"))
    assert eng.version == "step-7"  # failed loads kept the old weights
    with pytest.raises(ValueError, match="parameter names"):
        br.push({"embed": p1["embed"]})


def test_hf_export_reloads_and_modelopt_export_holds_the_engines_codes(tmp_path):
    params = _params(CFG, 4)
    bridge.export_hf(CFG, params, str(tmp_path / "bf16"), dtype=jnp.float32)
    eng = Engine(CFG, recipe="bf16", max_batch=2, max_len=32)
    assert bridge.WeightBridge(eng).load_from_disk(str(tmp_path / "bf16")) == "bf16"
    ref = Engine(CFG, recipe="bf16", max_batch=2, max_len=32)
    ref.load(params)
    a, b = eng.generate(GREEDY), ref.generate(GREEDY)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    np.testing.assert_allclose(a[0].logprobs, b[0].logprobs, atol=1e-5)

    out = bridge.export_modelopt_nvfp4(CFG, params, str(tmp_path / "nvfp4"), recipe="quads")
    qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    assert qc["quant_algo"] == "NVFP4" and qc["group_size"] == 16 and qc["quads"]["rac_ratio"] == 0.5
    assert "lm_head" in qc["exclude_modules"] and "*mlp.gate" in qc["exclude_modules"]
    q = bridge.read_modelopt_weight(out, "model.layers.0.self_attn.q_proj")
    mine = P.quantize_weight(params["layers/0/attn/q/w"])  # the trainer's / engine's path
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(mine.codes))
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), np.asarray(mine.scales).view(np.uint8))
    assert float(q.global_scale) == float(mine.global_scale)
    e = bridge.read_modelopt_weight(out, "model.layers.1.mlp.experts.3.down_proj")
    mine = P.quantize_weight(params["layers/1/moe/w_down"])  # per-expert global scales
    np.testing.assert_array_equal(np.asarray(e.codes), np.asarray(mine.codes[3]))
    assert float(e.global_scale) == float(np.asarray(mine.global_scale).reshape(-1)[3])
    from quads_jax.hf import TensorSource
    src = TensorSource(out)
    assert src.get("lm_head.weight").dtype == jnp.bfloat16 and src.get("model.layers.0.mlp.gate.weight").dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="quantized export"):
        bridge.WeightBridge(eng).load_from_disk(out)
    with pytest.raises(ValueError, match="not an NVFP4 recipe"):
        bridge.export_modelopt_nvfp4(CFG, params, str(tmp_path / "x"), recipe="fp8")


def test_server_api_in_process_batches_and_rejects_bad_requests():
    from rollout.server import RolloutServer
    from quads_jax.rl.tokenizer import CharTokenizer

    eng = Engine(CFG, recipe="quads", max_batch=4, max_len=40, eos_token_id=2)
    eng.load(_params(CFG, 0), version="v0")
    srv = RolloutServer(eng, CharTokenizer(), batch_window_s=0.2)
    try:
        body = lambda d: json.dumps(d).encode()
        code, out = srv.handle("POST", "/generate", body({"input_ids": [[1, 5], [1, 6, 7]], "return_logprob": True,
                                                         "sampling_params": {"max_new_tokens": 5, "seed": 3, "ignore_eos": True}}))
        assert code == 200 and len(out) == 2
        for o in out:
            m = o["meta_info"]
            assert len(o["output_ids"]) == m["completion_tokens"] == 5 and m["finish_reason"] == {"type": "length", "length": 5}
            assert [t for _, t, _ in m["output_token_logprobs"]] == o["output_ids"] and m["weight_version"] == "v0"
            assert all(lp <= 0 for lp, _, _ in m["output_token_logprobs"])
        again = srv.handle("POST", "/generate", body({"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 5, "seed": 3, "ignore_eos": True}}))[1]
        assert again["output_ids"] == out[0]["output_ids"]  # same seed, same tokens, batched or not
        with concurrent.futures.ThreadPoolExecutor(4) as ex:  # concurrent callers share engine batches
            n0 = len(srv.batches)
            futs = [ex.submit(srv.handle, "POST", "/generate", body({"input_ids": [1, 5 + i], "sampling_params": {"max_new_tokens": 3}}))
                    for i in range(4)]
            assert all(f.result()[0] == 200 for f in futs)
            assert len(srv.batches) - n0 < 4
        bad = [
            ("POST", "/generate", b"{not json"),
            ("POST", "/generate", body({"input_ids": [1, 2], "lora_path": "adapter"})),
            ("POST", "/generate", body({"input_ids": [1, 2], "sampling_params": {"regex": "[0-9]+"}})),
            ("POST", "/generate", body({"input_ids": [1, 2], "sampling_params": {"temperature": -1}})),
            ("POST", "/generate", body({"input_ids": [1, 999]})),
            ("POST", "/generate", body({"input_ids": [1] * 39, "sampling_params": {"max_new_tokens": 4}})),
            ("POST", "/generate", body({"text": "1", "input_ids": [1]})),
            ("POST", "/update_weights_from_disk", body({"model_path": "/no/such/dir"})),
        ]
        for method, path, b in bad:
            code, err = srv.handle(method, path, b)
            msg = err["message"] if path == "/update_weights_from_disk" else err["error"]["message"]
            assert code == 400 and msg, (path, b, err)
        assert srv.handle("GET", "/nope", b"")[0] == 404
        assert srv.handle("GET", "/generate", b"")[0] == 405
        assert srv.handle("GET", "/health", b"") == (200, "")
        assert srv.handle("GET", "/get_model_info", b"")[1]["weight_version"] == "v0"
        code, t = srv.handle("POST", "/generate", body({"text": "12+3", "sampling_params": {"max_new_tokens": 6, "stop": ["0"], "temperature": 0.0}}))
        assert code == 200 and "0" not in t["text"]
    finally:
        srv.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_quads_serve_subprocess_end_to_end(tmp_path):
    """`quads serve` on localhost: concurrent clients, a weight update changes outputs and the
    version, a failed update keeps the old weights, bad requests get 4xx, still serving."""
    from rollout.server import job_model

    cfg, _ = job_model(os.path.join(ROOT, "configs/tiny_cpu.yaml"))
    _save(str(tmp_path / "ck"), _params(cfg, 9), step=3)
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen([sys.executable, "-m", "quads_jax.cli", "serve", "--config", "configs/tiny_cpu.yaml", "--recipe", "quads",
                             "--port", str(port), "--max-batch", "4", "--max-len", "48", "--weights-dir", str(tmp_path)],
                            cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        c = RolloutClient(f"http://127.0.0.1:{port}", timeout=300)
        c.wait_ready(timeout=180)
        prompts = [[1, 5, 6], [1, 7, 8, 9], [1, 10]]
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            outs = list(ex.map(lambda p: c.rollout([p], max_new_tokens=6, temperature=0.0)[0], prompts))
        assert all(o["weight_version"] == "random-init" and len(o["output_ids"]) == len(o["logprobs"]) for o in outs)
        with pytest.raises(RolloutError) as e:
            c.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2, "nope": 1})
        assert e.value.status == 400 and "nope" in e.value.message
        with pytest.raises(RolloutError) as e:
            c.update_weights_from_disk(str(tmp_path / "missing"))
        assert e.value.status == 400 and c.model_info()["weight_version"] == "random-init"
        assert c.update_weights_from_disk(str(tmp_path / "ck"), weight_version="w3")["success"]
        new = c.rollout(prompts, max_new_tokens=6, temperature=0.0)
        assert all(o["weight_version"] == "w3" for o in new)
        assert [o["output_ids"] for o in new] != [o["output_ids"] for o in outs]
        info = c.server_info()
        assert info["recipe"] == "quads" and info["weight_version"] == "w3" and c.model_info()["is_generation"]
        assert c.flush_cache() and c.health() and c.health_generate()["status"] == "ok"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
