"""The server, the engine and checkpoints under hostile input, load and faults (loopback only,
bounded in count and time): nothing lost, no request failed by a neighbour."""

import concurrent.futures
import glob
import http.client
import json
import os
import socket
import threading
import time
import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from quads_jax.model import ModelConfig, Transformer
from quads_jax.rl.tasks.arithmetic import Countdown, evaluate_arithmetic
from quads_jax.rl.tasks import Problem
from quads_jax.rl.tokenizer import CharTokenizer
from quads_jax.train.checkpoint import Checkpointer, CorruptCheckpoint
from quads_jax.train.state import init_state, split_params
from rollout.engine import Engine, Request
from rollout.server import RolloutServer, make_http_server

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, n_experts=4,
                  experts_per_token=2, expert_ffn=32, max_seq_len=64, compute_dtype="float32")


def _params(seed):
    return split_params(Transformer(CFG, rngs=nnx.Rngs(seed)))[1]


@pytest.fixture(scope="module")
def engine():
    eng = Engine(CFG, recipe="quads", max_batch=8, max_len=48, eos_token_id=2)
    eng.load(_params(0), version="v0")
    return eng


# ----------------------------------------------------------------------------- the engine's limits


@pytest.mark.parametrize("field,value", [
    ("max_new_tokens", 2.5), ("max_new_tokens", 0), ("max_new_tokens", True), ("temperature", float("nan")),
    ("temperature", float("inf")), ("top_p", float("nan")), ("top_p", 0.0), ("top_k", -5), ("seed", 2**32), ("seed", -1),
    ("stop_token_ids", (64,)), ("stop_token_ids", tuple(range(3, 12))), ("prompt", [1, 2.5]),
])
def test_engine_refuses_bad_numbers_at_once(engine, field, value):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=field):
        engine.generate([Request(prompt=[1, 5], max_new_tokens=3), Request(**{"prompt": [1, 6], field: value})])
    assert time.monotonic() - t0 < 1.0


def test_engine_edge_values(engine):
    assert engine.generate([]) == []
    a = engine.generate([Request(prompt=[1, 5, 7], max_new_tokens=4, top_k=0, seed=2**32 - 1)])[0]
    b = engine.generate([Request(prompt=[1, 5, 7], max_new_tokens=4, top_k=10**12, seed=2**32 - 1)])[0]
    assert a.output_ids == b.output_ids and a.logprobs == b.logprobs  # top_k >= vocabulary: no top-k


@pytest.mark.parametrize("backend", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_outputs_do_not_depend_on_batch_companions(backend):
    """A request's tokens and log-probs, bit for bit: alone, beside long prompts, in another
    arrival order, and with other stop lists beside it."""
    from quads_jax import precision as P

    eng = Engine(CFG, recipe=P.rollout_recipe("quads", backend=backend), max_batch=4, max_len=48, eos_token_id=2)
    eng.load(_params(3))
    rng = np.random.default_rng()
    probe = Request(prompt=rng.integers(3, 64, 5).tolist(), max_new_tokens=8, seed=11, ignore_eos=True)
    alone = eng.generate([probe])[0]
    longs = [Request(prompt=rng.integers(3, 64, n).tolist(), max_new_tokens=6, seed=i, stop_token_ids=list(range(3, 3 + i)))
             for i, n in enumerate((37, 20, 33, 9, 40))]
    crowd = eng.generate(longs[:2] + [probe] + longs[2:])[2]
    late = eng.generate(longs + [probe])[-1]  # admitted after others finish, into a reused slot
    for r in (crowd, late):
        assert r.output_ids == alone.output_ids
        assert r.logprobs == alone.logprobs


def test_stop_lists_of_any_length_share_one_compile(engine):
    engine.generate([Request(prompt=[1, 5], max_new_tokens=20, stop_token_ids=[3])])
    n = engine._burst._cache_size()
    for k in range(1, 7):
        engine.generate([Request(prompt=[1, 5], max_new_tokens=20, stop_token_ids=list(range(3, 3 + k)))])
    assert engine._burst._cache_size() == n


# ----------------------------------------------------------------------------- the server


@pytest.fixture()
def served(engine, tmp_path):
    srv = RolloutServer(engine, CharTokenizer(), batch_window_s=0.02, weights_dirs=[str(tmp_path / "allowed")])
    httpd = make_http_server(srv, "127.0.0.1", 0, socket_timeout=2.0)
    th = threading.Thread(target=httpd.serve_forever, daemon=True)
    th.start()
    yield srv, httpd.server_address[1], tmp_path
    httpd.shutdown()
    httpd.server_close()
    srv.close()


def _post(port, path, payload, timeout=60):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    out = (r.status, json.loads(r.read() or b"null"))
    c.close()
    return out


def _gen(i, **sp):
    return {"input_ids": [1, 5 + i % 40], "sampling_params": {"max_new_tokens": 3, "seed": i, **sp}, "return_logprob": True}


def test_a_poisoned_request_fails_alone(served):
    srv, port, _ = served
    bad = [({"sampling_params": {"seed": 2**32}}, 400), ({"sampling_params": {"stop_token_ids": [999]}}, 400),
           ({"sampling_params": {"max_new_tokens": 2.5}}, 400), ({"rid": ["only-one", "two"]}, 400),
           ({"input_ids": [[1, 5], [1, 6]], "rid": ["a"]}, 400),
           ({"sampling_params": {"top_k": 2**70}}, 200)]  # a top-k beyond the vocabulary is no top-k: served
    jobs = [(_gen(i), 200) for i in range(24)] + [
        ({**_gen(99), **b, "sampling_params": {**_gen(99)["sampling_params"], **b.get("sampling_params", {})}} if "input_ids" not in b else b, want)
        for b, want in bad]
    with concurrent.futures.ThreadPoolExecutor(32) as ex:
        codes = list(ex.map(lambda j: _post(port, "/generate", j[0])[0], jobs))
    assert codes == [want for _, want in jobs]


def test_an_engine_fault_fails_only_its_request(served, monkeypatch):
    """Should a batch fail inside the engine anyway, each request is rerun alone."""
    srv, port, _ = served
    real = srv.engine.generate

    def flaky(reqs):
        if any(list(r.prompt) == [1, 13] for r in reqs):
            raise RuntimeError("injected fault")
        return real(reqs)

    monkeypatch.setattr(srv.engine, "generate", flaky)
    with concurrent.futures.ThreadPoolExecutor(12) as ex:
        codes = list(ex.map(lambda i: _post(port, "/generate", {"input_ids": [1, 5 + i], "sampling_params": {"max_new_tokens": 2}})[0],
                            range(12)))
    assert codes[8] == 500 and codes[:8] + codes[9:] == [200] * 11


def test_malformed_json_numbers_and_framing_get_4xx(served):
    srv, port, _ = served
    for body in (b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}', b"[" * 100000 + b"]" * 100000,
                 b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2.5}}',
                 b'{"input_ids": [1, 2], "sampling_params": {"top_p": Infinity}}',
                 b'{"input_ids": [1, 2], "sampling_params": {"seed": 4294967296}}'):
        t0 = time.monotonic()
        code, err = _post(port, "/generate", body)
        assert code == 400 and err["error"]["message"] and time.monotonic() - t0 < 1.0
    for cl in ("abc", "-5"):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {cl}\r\n\r\n".encode())
        assert s.recv(4096).split(b" ")[1] == b"400"
        s.close()
    assert _post(port, "/generate", _gen(1))[0] == 200  # still serving


def test_a_shared_sampling_params_object_is_not_mutated():
    """One sampling_params for a batch of prompts: every prompt gets the same stop ids."""
    from rollout.server import parse_sampling

    tok = CharTokenizer()
    sp = {"stop_token_ids": [3], "stop": ["7", "12"], "max_new_tokens": 4}
    outs = [parse_sampling(sp, tokenizer=tok, eos_id=2) for _ in range(4)]
    assert all(o == outs[0] for o in outs) and sp["stop_token_ids"] == [3]
    assert outs[0]["stop_token_ids"] == (3, tok.encode("7")[0]) and outs[0]["stop_strings"] == ["12"]


def test_stalled_clients_do_not_block_others_and_are_dropped(served):
    srv, port, _ = served
    stalled = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(8)]
    for s in stalled:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")  # never finishes
    assert _post(port, "/generate", _gen(2), timeout=10)[0] == 200
    time.sleep(2.5)  # the socket timeout (2 s here): each gets 408 Request Timeout, then the server closes it
    for s in stalled:
        s.settimeout(5)
        got = b""
        while chunk := s.recv(4096):
            got += chunk
        assert got.split(b" ")[1] == b"408", got[:80]  # and recv returned b"": closed by the server
        s.close()


def test_bursts_of_64_simultaneous_connections(served):
    srv, port, _ = served
    barrier = threading.Barrier(64)

    def one(i):
        barrier.wait()
        return _post(port, "/generate", _gen(i))[0]

    with concurrent.futures.ThreadPoolExecutor(64) as ex:
        assert list(ex.map(one, range(64))) == [200] * 64


def _save(directory, params, step):
    ck = Checkpointer(directory, save_every=1, async_save=False)
    st = init_state(params, optax.adam(1e-3))
    ck.save(st.__class__(params=st.params, opt_state=st.opt_state, step=jnp.int32(step), skipped=st.skipped, rng=st.rng), force=True)
    ck.wait()
    ck.close()


def test_hostile_update_paths_are_refused_alike(served):
    srv, port, tmp = served
    (tmp / "allowed").mkdir()
    (tmp / "outside").mkdir()
    _save(str(tmp / "outside" / "ck"), _params(1), step=1)
    os.symlink(tmp / "outside" / "ck", tmp / "allowed" / "link")
    msgs = set()
    for p in (str(tmp / "allowed" / ".." / "outside" / "ck"), str(tmp / "allowed" / "link"), "/proc/self", "/etc",
              str(tmp / "allowed" / "missing")):
        code, err = _post(port, "/update_weights_from_disk", {"model_path": p})
        assert code == 400, p
        msgs.add(err["message"])
        assert err["success"] is False
    assert len(msgs) == 1 and "outside" not in next(iter(msgs))  # one message: nothing about what exists
    _save(str(tmp / "allowed" / "ck"), _params(1), step=4)
    code, out = _post(port, "/update_weights_from_disk", {"model_path": str(tmp / "allowed" / "ck")})
    assert code == 200 and out["weight_version"] == "step-4"


def _flip_a_byte(step_dir):
    files = [f for f in glob.glob(os.path.join(step_dir, "params", "**", "*"), recursive=True) if os.path.isfile(f)]
    big = max(files, key=os.path.getsize)
    data = bytearray(open(big, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(big, "wb").write(bytes(data))


@pytest.mark.parametrize("damage", ["bitflip", "truncate", "no_marker", "empty_step"])
def test_corrupt_checkpoints_fall_back_to_the_newest_intact_step(tmp_path, damage):
    d = str(tmp_path / "ck")
    good = _params(1) if damage != "empty_step" else _params(2)  # an empty step 3: step 2 is the newest intact
    _save(d, _params(1), step=1)
    _save(d, _params(2), step=2)
    if damage == "bitflip":
        _flip_a_byte(os.path.join(d, "2"))
    elif damage == "truncate":
        files = [f for f in glob.glob(os.path.join(d, "2", "params", "**", "*"), recursive=True) if os.path.isfile(f)]
        big = max(files, key=os.path.getsize)
        open(big, "r+b").truncate(os.path.getsize(big) // 2)
    elif damage == "no_marker":
        os.remove(os.path.join(d, "fingerprints", "2.json"))
    else:
        os.makedirs(os.path.join(d, "3"))
    ck = Checkpointer(d, async_save=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = ck.restore_params(jax_like(good))
    if damage == "empty_step":
        assert ck.restored_step == 2
    else:
        assert ck.restored_step == 1 and any("skipped" in str(x.message) for x in w)
    for k in good:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(good[k]))
    if damage != "empty_step":
        with pytest.raises(CorruptCheckpoint, match="step 2"):
            ck.restore_params(jax_like(good), step=2)
    ck.close()


def jax_like(params):
    import jax
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in params.items()}


def test_server_refuses_corrupt_weights_and_keeps_the_old(served):
    srv, port, tmp = served
    (tmp / "allowed").mkdir()
    d = str(tmp / "allowed" / "ck")
    _save(d, _params(5), step=1)
    _flip_a_byte(os.path.join(d, "1"))
    before = _post(port, "/generate", _gen(3))[1]
    code, err = _post(port, "/update_weights_from_disk", {"model_path": d})
    assert code == 400 and not err["success"] and "old weights kept" in err["message"]
    after = _post(port, "/generate", _gen(3))[1]
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]


# ----------------------------------------------------------------------------- rewards


def test_countdown_reward_never_evaluates_model_text():
    t0 = time.monotonic()
    p = Problem(prompt="9,9,9:81=", answer="81", demo="")
    task = Countdown()
    for text in ("9**9**9", "9*9**9", "(9)*(9)+9-9**99", "__import__('os')", "9*9*1"):
        assert task.reward(p, text) == 0.0
    assert task.reward(Problem(prompt="9,9,1:81=", answer="81", demo=""), "9*9*1") == 1.0
    assert time.monotonic() - t0 < 1.0
    assert evaluate_arithmetic("(2+3)*-4") == -20
    for bad in ("2**3", "7/2", "a+1", "1" * 20 + "*" + "1" * 20):
        with pytest.raises(ValueError):
            evaluate_arithmetic(bad)


# ----------------------------------------------------------------------------- load


@pytest.mark.parametrize("n", [200, pytest.param(1000, marks=pytest.mark.slow)])
def test_mixed_load_with_weight_updates(served, n):
    """Mixed requests from 64 clients, weight updates interleaved: no connection error, no
    server error, and every answer comes from a version that was live while it ran (the
    target's 1000 requests run with ``-m slow``)."""
    srv, port, tmp = served
    (tmp / "allowed").mkdir()
    for v in (1, 2):
        _save(str(tmp / "allowed" / f"ck{v}"), _params(10 + v), step=v)
    live = {srv.engine.version}
    lock = threading.Lock()
    errors = []

    def client(i):
        if i % 50 == 25:
            v = 1 + (i // 50) % 2
            with lock:
                live.add(f"step-{v}")
            code, out = _post(port, "/update_weights_from_disk", {"model_path": str(tmp / "allowed" / f"ck{v}")})
            return ("update", code, out)
        body = _gen(i, temperature=[0.0, 0.7, 1.0][i % 3], top_p=[1.0, 0.9][i % 2], top_k=[0, 5, -1][i % 3])
        if i % 7 == 0:
            body = {"input_ids": [[1, 5 + i % 30], [1, 6, 7]], "sampling_params": body["sampling_params"]}
        if i % 11 == 0:
            body = {"input_ids": [1, 999]}  # a bad request among them: 400, nobody else affected
        try:
            return ("gen", *_post(port, "/generate", body, timeout=120))
        except OSError as e:
            errors.append(repr(e))
            return ("gen", -1, None)

    with concurrent.futures.ThreadPoolExecutor(64) as ex:
        res = list(ex.map(client, range(n)))
    assert not errors
    for i, (kind, code, out) in enumerate(res):
        if kind == "update":
            assert code == 200, out
        elif i % 11 == 0:
            assert code == 400
        else:
            assert code == 200, out
            for o in out if isinstance(out, list) else [out]:
                assert o["meta_info"]["weight_version"] in live
