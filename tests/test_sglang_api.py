"""The server against what SGLang's RL clients send and parse (SGLang 0.5.23's GenerateReqInput
and SamplingParams; slime's rollout payload as its sglang_rollout.generate builds it)."""

import http.client
import json
import threading
import time

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
    code, err = _json(port, "/generate", {"input_ids": [1, 5], "logprob_start_len": 0})
    assert code == 400 and "logprob_start_len" in err["error"]["message"]


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
