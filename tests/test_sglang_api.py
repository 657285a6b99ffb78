"""The server against what SGLang's RL clients send and parse (SGLang 0.5.23's GenerateReqInput
and SamplingParams; slime's rollout payload as its sglang_rollout.generate builds it; verl's
HttpServerAdapter and SGLangHttpServer requests)."""

import http.client
import json
import threading
import time

import numpy as np
import pytest
from flax import nnx

from quads_jax.model import ModelConfig, Transformer
from quads_jax.rl.tokenizer import CharTokenizer
from quads_jax.train.state import split_params
from rollout.client import RolloutClient
from rollout.engine import Engine
from rollout.server import GENERATE_UNSUPPORTED, SAMPLING_NEUTRAL, RolloutServer, make_http_server

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, n_experts=4,
                  experts_per_token=2, expert_ffn=32, max_seq_len=64, compute_dtype="float32")


@pytest.fixture(scope="module")
def served():
    eng = Engine(CFG, recipe="quads", max_batch=4, max_len=48, eos_token_id=2)
    eng.load(split_params(Transformer(CFG, rngs=nnx.Rngs(0)))[1], version="v0")
    srv = RolloutServer(eng, CharTokenizer(), batch_window_s=0.01)
    httpd = make_http_server(srv, "127.0.0.1", 0, socket_timeout=5.0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield srv, httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()
    srv.close()


def _call(port, method, path, payload=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request(method, path, body=None if payload is None else json.dumps(payload).encode(),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    raw, ctype = r.read(), r.getheader("Content-Type")
    c.close()
    return r.status, ctype, raw


def _json(port, path, payload):
    code, _, raw = _call(port, "POST", path, payload)
    return code, json.loads(raw or b"null")


def test_slime_rollout_payload_is_served_and_parsed_as_slime_does(served):
    _, port = served
    tok = CharTokenizer()
    # slime's GenerateState.sampling_params (rollout_top_p != 1 adds custom_params), a group seed,
    # then its payload: sampling_params, return_logprob, input_ids
    sampling_params = dict(temperature=1.0, top_p=0.9, top_k=-1, max_new_tokens=8, stop=None, stop_token_ids=None,
                           skip_special_tokens=True, no_stop_trim=True, spaces_between_special_tokens=False,
                           custom_params={"return_top_p_token_ids": True}, sampling_seed=7)
    prompt_ids = [1] + tok.encode("12+3=")
    payload = {"sampling_params": sampling_params, "return_logprob": True, "input_ids": prompt_ids}
    code, output = _json(port, "/generate", payload)
    assert code == 200, output
    # slime's parsing
    new_tokens = [item[1] for item in output["meta_info"]["output_token_logprobs"]]
    new_logps = [item[0] for item in output["meta_info"]["output_token_logprobs"]]
    assert new_tokens == output["output_ids"] and len(new_logps) == len(new_tokens) > 0
    assert all(isinstance(x, float) and x <= 0 for x in new_logps)
    assert isinstance(output["text"], str) and output["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    assert output["meta_info"]["input_token_logprobs"] == [[None, prompt_ids[-1], None]]
    # the same seed gives the same tokens (slime's deterministic-inference groups rely on it)
    assert _json(port, "/generate", payload)[1]["output_ids"] == new_tokens


def test_unknown_top_level_fields_are_ignored_and_unsupported_ones_named(served):
    _, port = served
    code, out = _json(port, "/generate", {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 2},
                                          "log_metrics": True, "future_field": {"x": 1}, "return_hidden_states": False,
                                          "image_data": None, "logprob_start_len": -1})
    assert code == 200 and len(out["output_ids"]) == 2
    for field in GENERATE_UNSUPPORTED:
        code, err = _json(port, "/generate", {"input_ids": [1, 5], field: 3})
        assert code == 400 and err["error"]["message"].startswith(field), (field, err)
    code, err = _json(port, "/generate", {"input_ids": [1, 5], "logprob_start_len": 2})
    assert code == 400 and "logprob_start_len" in err["error"]["message"]
    code, err = _json(port, "/generate", {"input_ids": [1, 5], "top_logprobs_num": 21})
    assert code == 400 and "top_logprobs_num" in err["error"]["message"]


def test_input_and_top_logprobs_as_sglang_returns_them(served):
    """logprob_start_len >= 0 returns the prompt's token log-probs (position 0: None), equal to
    the log-probs the engine gave the same tokens when it generated them; top_logprobs_num adds
    the best tokens per position, best first, with the sampled token among them when it ranks."""
    _, port = served
    prompt = [1, 7, 9, 11]
    sp = {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 5}
    gen = _json(port, "/generate", {"input_ids": prompt, "sampling_params": sp, "return_logprob": True,
                                    "top_logprobs_num": 3})[1]
    out_ids = gen["output_ids"]
    out_lp = [lp for lp, _, _ in gen["meta_info"]["output_token_logprobs"]]
    tops = gen["meta_info"]["output_top_logprobs"]
    assert len(tops) == len(out_ids) and all(len(t) == 3 for t in tops)
    for (lp, tok, _), top in zip(gen["meta_info"]["output_token_logprobs"], tops):
        vals = [v for v, _, _ in top]
        assert vals == sorted(vals, reverse=True) and vals[0] >= lp - 1e-6
        assert lp < vals[-1] - 1e-6 or tok in [t for _, t, _ in top]
    full = prompt + out_ids[:-1]
    again = _json(port, "/generate", {"input_ids": full, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
                                      "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True})[1]
    inp = again["meta_info"]["input_token_logprobs"]
    assert len(inp) == len(full) and inp[0][0] is None and [t for _, t, _ in inp] == full
    assert all(isinstance(text, str) for _, _, text in inp)
    # the prompt's log-probs of the generated tokens: what decoding gave them (prefill vs decode rounding)
    np.testing.assert_allclose([v for v, _, _ in inp[len(prompt):]], out_lp[:-1], atol=1e-4)
    itop = again["meta_info"]["input_top_logprobs"]
    assert itop[0] is None and len(itop) == len(full) and all(len(t) == 2 for t in itop[1:])
    part = _json(port, "/generate", {"input_ids": full, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
                                     "logprob_start_len": 2})[1]["meta_info"]["input_token_logprobs"]
    assert part == [[v, t, None] for v, t, _ in inp[2:]]


@pytest.mark.parametrize("field", sorted(SAMPLING_NEUTRAL))
def test_every_sampling_param_is_honoured_or_refused_by_name(served, field):
    _, port = served
    neutral = SAMPLING_NEUTRAL[field][0]
    code, _ = _json(port, "/generate", {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 1, field: neutral}})
    assert code == 200
    bad = {"logit_bias": {"5": 3.0}, "beam_width": 4, "ebnf_full_assistant": True, "stop_regex": "[0-9]"}.get(field, 2)
    code, err = _json(port, "/generate", {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 1, field: bad}})
    assert code == 400 and f"sampling_params.{field}" in err["error"]["message"]


def test_no_stop_trim_keeps_the_stop_string_and_logprob_text(served):
    _, port = served
    tok = CharTokenizer()
    base = {"input_ids": [1] + tok.encode("1+1="), "return_logprob": True, "return_text_in_logprobs": True}
    free = _json(port, "/generate", {**base, "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}})[1]
    assert len(free["text"]) >= 3
    stop = free["text"][1:3]  # a two-character stop string the greedy output contains
    kept = _json(port, "/generate", {**base, "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "stop": stop,
                                                                  "no_stop_trim": True}})[1]
    cut = _json(port, "/generate", {**base, "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "stop": stop}})[1]
    assert kept["text"].endswith(stop) and cut["text"] == kept["text"][: -len(stop)]
    assert [t for _, _, t in kept["meta_info"]["output_token_logprobs"]] == [tok.decode([i]) for i in kept["output_ids"]]


def test_control_endpoints_in_sglangs_shapes(served, tmp_path):
    srv, port = served
    code, ctype, raw = _call(port, "GET", "/health")
    assert (code, raw) == (200, b"")
    code, ctype, raw = _call(port, "POST", "/flush_cache", {})
    assert code == 200 and ctype.startswith("text/plain") and raw.decode().startswith("Cache flushed")
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        code, _, raw = _call(port, "GET", path)
        assert code == 200 and json.loads(raw)["weight_version"] == "v0"
    code, out = _json(port, "/update_weights_from_disk", {"model_path": str(tmp_path), "flush_cache": True,
                                                          "is_async": False})
    assert code == 400 and out["success"] is False and out["message"] and out["num_paused_requests"] == 0
    c = RolloutClient(f"http://127.0.0.1:{port}")
    assert c.flush_cache() is True and c.health() is True


def test_pause_continue_and_abort(served):
    srv, port = served
    assert _json(port, "/pause_generation", {})[0] == 200
    results = {}

    def go(name, body):
        results[name] = _json(port, "/generate", body)

    threads = [threading.Thread(target=go, args=(f"r{i}", {"input_ids": [1, 5 + i], "rid": f"r{i}",
                                                          "sampling_params": {"max_new_tokens": 3}})) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    assert not results  # paused: queued, not run
    assert _json(port, "/abort_request", {"rid": "r1"})[0] == 200
    assert _json(port, "/continue_generation", {})[0] == 200
    for t in threads:
        t.join(timeout=60)
    assert results["r1"][1]["meta_info"]["finish_reason"]["type"] == "abort" and results["r1"][1]["output_ids"] == []
    assert all(results[r][1]["meta_info"]["finish_reason"]["type"] != "abort" and results[r][1]["output_ids"]
               for r in ("r0", "r2"))
    # abort_all while paused ends everything queued; later requests run
    assert _json(port, "/pause_generation", {})[0] == 200
    t = threading.Thread(target=go, args=("q", {"input_ids": [1, 9], "sampling_params": {"max_new_tokens": 2}}))
    t.start()
    time.sleep(0.3)
    assert _json(port, "/abort_request", {"abort_all": True})[0] == 200
    assert _json(port, "/continue_generation", {})[0] == 200
    t.join(timeout=60)
    assert results["q"][1]["meta_info"]["finish_reason"]["type"] == "abort"
    code, out = _json(port, "/generate", {"input_ids": [1, 9], "sampling_params": {"max_new_tokens": 2}})
    assert code == 200 and len(out["output_ids"]) == 2
    assert _json(port, "/abort_request", {})[0] == 400


def test_verl_http_adapter_payloads_are_served_and_parsed_as_verl_does(served):
    """What verl's SGLang HttpServerAdapter and SGLangHttpServer send: the readiness probes, a
    token-in generate request with routing replay, release / resume of memory between steps,
    pause with mode abort; parsed as verl parses them (routed experts through SGLang's decoder
    when sglang is installed)."""
    srv, port = served
    assert _call(port, "GET", "/health_generate")[0] == 200
    assert _call(port, "GET", "/flush_cache?reset_connector=true")[0] == 200
    prompt_ids = [1, 7, 9, 11, 4]
    request = {"rid": "verl-0", "input_ids": prompt_ids, "image_data": None, "return_logprob": True,
               "return_routed_experts": True,
               "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
                                   "max_new_tokens": 6, "sampling_seed": 11}}  # a seed: the calls below compare outputs
    code, output = _json(port, "/generate", request)
    assert code == 200, output
    meta = output["meta_info"]
    token_ids = list(output["output_ids"])
    output_token_logprobs = meta["output_token_logprobs"]
    assert len(output_token_logprobs) == len(token_ids) > 0
    log_probs = [float(lp) for lp, _, _ in output_token_logprobs]
    assert meta["finish_reason"]["type"] in ("stop", "length") and all(lp <= 0 for lp in log_probs)
    try:
        from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info
    except ImportError:  # the same decoding as SGLang's
        import base64

        extract_routed_experts_from_meta_info = lambda o: np.frombuffer(base64.b64decode(o["meta_info"]["routed_experts"]), np.int32)
    routed = extract_routed_experts_from_meta_info(output).reshape(-1, CFG.n_layers, CFG.experts_per_token)
    # every position fed to the model: the prompt's, then each generated token's but the last
    assert routed.shape[0] == len(prompt_ids) + len(token_ids) - 1
    assert ((routed >= 0) & (routed < CFG.n_experts)).all()
    assert all(len(set(row)) == CFG.experts_per_token for layer_rows in routed for row in layer_rows)
    mine = _json(port, "/generate", {**request, "return_routed_experts": False, "return_experts": True})[1]
    assert mine["output_ids"] == token_ids  # same seed
    assert routed[len(prompt_ids) - 1:].tolist() == mine["meta_info"]["routed_experts"]
    # memory released between steps: generate refuses, then runs the same as before
    assert _json(port, "/release_memory_occupation", {"tags": None, "reset_connector": True})[0] == 200
    code, err = _json(port, "/generate", request)
    assert code == 400 and "released" in err["error"]["message"]
    assert _json(port, "/resume_memory_occupation", {"tags": None})[0] == 200
    assert _json(port, "/generate", request)[1]["output_ids"] == token_ids
    assert _json(port, "/release_memory_occupation", {"tags": ["optimizer"]})[0] == 400
    # abort_all_requests: pause with mode abort, then continue
    assert _json(port, "/pause_generation", {"mode": "abort"})[0] == 200
    assert _json(port, "/continue_generation", {})[0] == 200
    assert _json(port, "/abort_request", {"rid": "", "abort_all": True})[0] == 200
    assert _json(port, "/generate", request)[1]["output_ids"] == token_ids


def test_api_key_as_sglang(served):
    """With an API key every endpoint but /health* needs the bearer token: 401 otherwise."""
    srv, _ = served
    keyed = RolloutServer(srv.engine, CharTokenizer(), api_key="s3cret")
    httpd = make_http_server(keyed, "127.0.0.1", 0, socket_timeout=5.0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    try:
        body = {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 1}}
        code, out = _json(port, "/generate", body)
        assert code == 401 and out == {"error": "Unauthorized"}
        assert _call(port, "GET", "/health")[0] == 200 and _call(port, "GET", "/model_info")[0] == 401
        assert keyed.handle("POST", "/generate", json.dumps(body).encode(), "Bearer wrong")[0] == 401
        assert keyed.handle("POST", "/generate", json.dumps(body).encode(), "Bearer s3cret")[0] == 200
        ok = RolloutClient(f"http://127.0.0.1:{port}", api_key="s3cret")
        assert ok.health() is True and ok.flush_cache() is True
        with pytest.raises(Exception, match="401|Unauthorized"):
            RolloutClient(f"http://127.0.0.1:{port}").flush_cache()
        with pytest.raises(ValueError, match="api_key"):
            RolloutServer(srv.engine, CharTokenizer(), api_key="")
    finally:
        httpd.shutdown()
        httpd.server_close()
        keyed.close()
