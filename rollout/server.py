"""An HTTP rollout server that speaks SGLang's native API, backed by ``rollout.engine``.

    quads serve --config configs/tiny_cpu.yaml [--checkpoint DIR] [--recipe quads] --port 30000

Endpoints (request and response fields as in SGLang, so its clients work unchanged):
  POST /generate                  text | input_ids (one or a batch), sampling_params, return_logprob
  POST /update_weights_from_disk  {model_path, weight_version?}: through ``rollout.bridge``
  GET|POST /flush_cache, GET /health, GET /health_generate, GET /get_model_info, GET /get_server_info

Concurrency: each HTTP request runs on its own thread and queues its sequences; one
scheduler thread takes everything queued within ``batch_window_s`` and runs it as one
``Engine.generate`` call (continuous batching inside), so concurrent clients share the
decode batch. Every request is validated against the engine's true limits before it is
queued (``Engine.validate``: types, NaN, ranges, seed width, vocabulary, context length),
and answered 400 with the reason. Should a batch still fail, each of its requests is rerun
alone, so only the one that caused it fails. Connections: a listen backlog of 1024, a
socket timeout for idle and slow clients, 400 for malformed framing (Content-Length) and
413 for bodies over 64 MiB. Weight updates load only from directories under the roots the
operator allowed at start-up (``weights_dirs``; symlinks resolved), their errors do not
reveal what exists on disk, and a failed or corrupt update keeps the old weights. Outputs
do not depend on batch companions (``rollout.engine``). The server keeps serving.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import queue
import re
import threading
import time
import uuid
from concurrent.futures import Future
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rollout.bridge import WeightBridge
from rollout.engine import Engine, Request, Result

GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "return_logprob", "rid", "stream", "logprob_start_len",
                   "top_logprobs_num", "return_text_in_logprobs", "return_experts"}
SAMPLING_FIELDS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "seed",
                   "sampling_seed", "skip_special_tokens", "min_p", "n"}
UPDATE_FIELDS = {"model_path", "weight_version", "load_format", "abort_all_requests"}
MAX_BODY = 64 << 20
SOCKET_TIMEOUT_S = 60.0  # idle or slow clients are dropped after this long without progress
LISTEN_BACKLOG = 1024


class BadRequest(ValueError):
    """A client error: answered 400 with the message."""


def _expect(cond: bool, msg: str):
    if not cond:
        raise BadRequest(msg)


def _is_int_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _number(d: dict, k: str):
    v = d[k]
    _expect(isinstance(v, (int, float)) and not isinstance(v, bool), f"sampling_params.{k}={v!r}: expected a number")
    return v


def parse_sampling(sp: dict | None, *, tokenizer, eos_id) -> dict:
    """SGLang ``sampling_params`` -> Request keyword arguments (+ ``stop_strings``)."""
    sp = {} if sp is None else sp
    _expect(isinstance(sp, dict), "sampling_params: expected an object")
    unknown = sorted(set(sp) - SAMPLING_FIELDS)
    _expect(not unknown, f"sampling_params: unknown fields {unknown}; supported: {sorted(SAMPLING_FIELDS)}")
    out: dict[str, Any] = {}
    num = lambda k: _number(sp, k)
    if "max_new_tokens" in sp:
        v = sp["max_new_tokens"]
        _expect(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"sampling_params.max_new_tokens={v!r}: expected an integer >= 1")
        out["max_new_tokens"] = v
    else:
        out["max_new_tokens"] = 128
    if "temperature" in sp:
        _expect(num("temperature") >= 0, f"sampling_params.temperature={sp['temperature']}: expected >= 0")
        out["temperature"] = float(sp["temperature"])
    if "top_p" in sp:
        _expect(0 < num("top_p") <= 1, f"sampling_params.top_p={sp['top_p']}: expected in (0, 1]")
        out["top_p"] = float(sp["top_p"])
    if "top_k" in sp:
        v = sp["top_k"]
        _expect(isinstance(v, int) and not isinstance(v, bool) and (v == -1 or v >= 0),
                f"sampling_params.top_k={v!r}: expected -1 (off) or an integer >= 0")
        out["top_k"] = max(0, v)
    if "n" in sp:
        _expect(sp["n"] == 1, "sampling_params.n: only n=1 is supported (send a batch instead)")
    if "min_p" in sp:
        _expect(num("min_p") == 0, "sampling_params.min_p: only 0 is supported")
    seed = sp.get("seed", sp.get("sampling_seed"))
    if seed is not None:
        _expect(isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**32,
                f"sampling_params.seed={seed!r}: expected an integer in [0, 2**32)")
        out["seed"] = seed
    ids = list(sp.get("stop_token_ids") or [])  # a copy: one sampling_params may be shared by a batch
    _expect(_is_int_list(ids), "sampling_params.stop_token_ids: expected a list of integers")
    stops = sp.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    _expect(isinstance(stops, list) and all(isinstance(s, str) and s for s in stops), "sampling_params.stop: expected a string or a list of non-empty strings")
    strings = []
    for s in stops:  # a one-token stop string stops inside the engine; longer ones are cut after decoding
        enc = _encode(tokenizer, s)
        (ids.append(enc[0]) if len(enc) == 1 else strings.append(s))
    out["stop_token_ids"] = tuple(ids)
    if "ignore_eos" in sp:
        _expect(isinstance(sp["ignore_eos"], bool), "sampling_params.ignore_eos: expected true or false")
        out["ignore_eos"] = sp["ignore_eos"]
    out["stop_strings"] = strings
    return out


def _encode(tokenizer, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text))
    except ValueError as e:
        raise BadRequest(str(e)) from e


def _cut_at_stop(text: str, ids: list, lps: list, strings: list[str], tokenizer):
    """Truncate at the first stop string (SGLang excludes it from the text)."""
    hits = [(text.find(s), s) for s in strings if s in text]
    if not hits:
        return text, ids, lps, None
    pos, s = min(hits)
    for n in range(1, len(ids) + 1):  # shortest token prefix whose text contains the stop string
        if s in tokenizer.decode(ids[:n]):
            return text[:pos], ids[:n], lps[:n], s
    return text[:pos], ids, lps, s


@dataclasses.dataclass
class _Job:
    request: Request
    future: Future


class RolloutServer:
    """The engine behind a scheduler thread; ``handle(method, path, body)`` is the whole API."""

    def __init__(self, engine: Engine, tokenizer, *, model_path: str | None = None, batch_window_s: float = 0.005,
                 server_args: dict | None = None, weights_dirs: list[str] | tuple[str, ...] = ()):
        self.engine = engine
        # roots that /update_weights_from_disk may load from (resolved once); none: updates refused
        self.weights_dirs = tuple(os.path.realpath(d) for d in weights_dirs)
        self.tokenizer = tokenizer
        self.bridge = WeightBridge(engine)
        self.model_path = model_path
        self.window = batch_window_s
        self.server_args = dict(server_args or {})
        self._q: queue.Queue = queue.Queue()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.batches: list[int] = []  # sizes of the engine calls (observable batching)
        self._thread = threading.Thread(target=self._schedule, name="quads-scheduler", daemon=True)
        self._thread.start()

    # -- scheduling
    def _schedule(self):
        while not self._stop.is_set():
            try:
                first = self._q.get(timeout=0.1)
            except queue.Empty:
                continue
            jobs = [first]
            deadline = time.monotonic() + self.window
            while len(jobs) < 4 * self.engine.max_batch:
                try:
                    jobs.append(self._q.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            self.batches.append(len(jobs))
            try:
                results = self.engine.generate([j.request for j in jobs])
                for j, r in zip(jobs, results):
                    j.future.set_result(r)
            except Exception:  # validated before queueing; still, fail only the request that caused it
                for j in jobs:
                    try:
                        j.future.set_result(self.engine.generate([j.request])[0])
                    except Exception as e:  # noqa: BLE001 - handed to that request's thread
                        j.future.set_exception(e)

    def submit(self, requests: list[Request]) -> list[Result]:
        self.engine.validate(requests)
        futs = []
        for r in requests:
            f: Future = Future()
            self._q.put(_Job(r, f))
            futs.append(f)
        return [f.result() for f in futs]

    def close(self):
        self._stop.set()
        self._thread.join(timeout=2)

    # -- API
    def handle(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        path = path.split("?", 1)[0].rstrip("/") or "/"
        routes = {
            ("POST", "/generate"): self.generate,
            ("POST", "/update_weights_from_disk"): self.update_weights_from_disk,
            ("GET", "/flush_cache"): self.flush_cache, ("POST", "/flush_cache"): self.flush_cache,
            ("GET", "/health"): self.health,
            ("GET", "/health_generate"): self.health_generate,
            ("GET", "/get_model_info"): self.model_info,
            ("GET", "/get_server_info"): self.server_info,
        }
        fn = routes.get((method, path))
        if fn is None:
            if any(p == path for _, p in routes):
                return 405, {"error": {"message": f"{method} {path}: method not allowed", "code": 405}}
            return 404, {"error": {"message": f"{path}: no such endpoint", "code": 404}}
        try:
            payload = None
            if method == "POST":
                try:
                    payload = json.loads(body or b"{}", parse_constant=_no_constant)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise BadRequest(f"malformed JSON body: {e}") from e
                except RecursionError:
                    raise BadRequest("malformed JSON body: nested too deeply") from None
                _expect(isinstance(payload, dict), "body: expected a JSON object")
            return 200, fn(payload)
        except BadRequest as e:
            return 400, {"error": {"message": str(e), "code": 400}}
        except ValueError as e:  # engine validation: context length, token ids
            return 400, {"error": {"message": str(e), "code": 400}}
        except Exception as e:  # a server fault; still answered, still serving
            return 500, {"error": {"message": f"{type(e).__name__}: {e}", "code": 500}}

    def generate(self, body: dict):
        unknown = sorted(set(body) - GENERATE_FIELDS)
        _expect(not unknown, f"unknown fields {unknown}; supported: {sorted(GENERATE_FIELDS)}")
        _expect(not body.get("stream"), "stream: streaming is not supported by this server")
        _expect(("text" in body) != ("input_ids" in body), "expected exactly one of 'text' and 'input_ids'")
        if "text" in body:
            t = body["text"]
            single = isinstance(t, str)
            texts = [t] if single else t
            _expect(isinstance(texts, list) and texts and all(isinstance(x, str) for x in texts), "text: expected a string or a non-empty list of strings")
            prompts = [_encode(self.tokenizer, x) for x in texts]
            bos = getattr(self.tokenizer, "bos_id", None)
            if bos is not None:
                prompts = [[bos] + p for p in prompts]
        else:
            ids = body["input_ids"]
            single = _is_int_list(ids)
            prompts = [ids] if single else ids
            _expect(isinstance(prompts, list) and prompts and all(_is_int_list(p) for p in prompts),
                    "input_ids: expected a list of integers or a non-empty list of such lists")
        sps = body.get("sampling_params")
        sps = sps if isinstance(sps, list) else [sps] * len(prompts)
        _expect(len(sps) == len(prompts), f"sampling_params: {len(sps)} given for {len(prompts)} prompts")
        parsed = [parse_sampling(sp, tokenizer=self.tokenizer, eos_id=self.engine.eos) for sp in sps]
        base_seed = next(self._ids)
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, parsed)):
            kw = {k: v for k, v in sp.items() if k != "stop_strings"}
            kw.setdefault("seed", (base_seed * 7919 + i) % (2**31))
            reqs.append(Request(prompt=p, return_experts=bool(body.get("return_experts")), **kw))
        rid = body.get("rid")
        if isinstance(rid, list):
            _expect(len(rid) == len(prompts) and all(isinstance(x, str) for x in rid),
                    f"rid: expected one string per prompt ({len(prompts)})")
        results = self.submit(reqs)
        want_lp = bool(body.get("return_logprob"))
        outs = []
        for i, (r, sp) in enumerate(zip(results, parsed)):
            ids, lps = list(r.output_ids), list(r.logprobs)
            text = self.tokenizer.decode(ids)
            text, ids, lps, hit = _cut_at_stop(text, ids, lps, sp["stop_strings"], self.tokenizer)
            finish = {"type": "stop", "matched": hit} if hit else {"type": r.finish_reason}
            if r.finish_reason == "stop" and not hit and ids:
                finish["matched"] = ids[-1]
            if r.finish_reason == "length" and not hit:
                finish["length"] = len(ids)
            meta = {"id": (rid[i] if isinstance(rid, list) else rid) or uuid.uuid4().hex, "finish_reason": finish,
                    "prompt_tokens": r.prompt_tokens, "completion_tokens": len(ids), "weight_version": r.weight_version}
            if want_lp:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids)]
            if r.experts is not None:
                meta["routed_experts"] = r.experts[: len(ids)]
            outs.append({"text": text, "output_ids": ids, "meta_info": meta})
        return outs[0] if single else outs

    def update_weights_from_disk(self, body: dict):
        unknown = sorted(set(body) - UPDATE_FIELDS)
        _expect(not unknown, f"unknown fields {unknown}; supported: {sorted(UPDATE_FIELDS)}")
        path = body.get("model_path")
        _expect(isinstance(path, str) and path, "model_path: expected a path string")
        real = self.allowed_weights_path(path)
        try:
            version = self.bridge.load_from_disk(real, version=body.get("weight_version"))
        except Exception as e:  # noqa: BLE001 - missing, corrupt or mismatched: the old weights stay
            raise BadRequest(f"weight update failed, old weights kept (version {self.engine.version!r}): "
                             f"{type(e).__name__}: {_redact(str(e), real)}") from e
        self.model_path = path
        return {"success": True, "message": f"loaded {path}", "weight_version": version}

    def allowed_weights_path(self, path: str) -> str:
        """``path`` with symlinks resolved, if it lies under an allowed weights root; else 400
        (one message for every refusal: the reply says nothing of what exists on disk)."""
        real = os.path.realpath(path)
        ok = any(real == d or real.startswith(d + os.sep) for d in self.weights_dirs)
        _expect(ok and os.path.isdir(real), "model_path: not a loadable directory under the server's allowed weights "
                                            "directories (--weights-dir)")
        return real

    def flush_cache(self, _body=None):
        return {"success": True, "message": "no prefix cache is kept between batches; nothing to flush"}

    def health(self, _body=None):
        return {"status": "ok", "weight_version": self.engine.version}

    def health_generate(self, _body=None):
        r = self.submit([Request(prompt=[getattr(self.tokenizer, "bos_id", 1)], max_new_tokens=1, temperature=0.0)])[0]
        return {"status": "ok", "output_ids": r.output_ids}

    def model_info(self, _body=None):
        return {"model_path": self.model_path, "tokenizer_path": None, "is_generation": True,
                "weight_version": self.engine.version, "recipe": self.engine.recipe_name,
                "vocab_size": self.engine.cfg.vocab_size, "context_length": self.engine.max_len}

    def server_info(self, _body=None):
        cfg = dataclasses.asdict(self.engine.cfg)
        return {**self.server_args, "model_config": cfg, "max_batch": self.engine.max_batch,
                "context_length": self.engine.max_len, "recipe": self.engine.recipe_name,
                "precision": dataclasses.asdict(self.engine.recipe), "weight_version": self.engine.version,
                "batches_run": len(self.batches), "version": "quads-jax"}


def _no_constant(name):
    raise BadRequest(f"malformed JSON body: {name} is not a number JSON allows")


def _redact(message: str, path: str) -> str:
    """The first line of an error message, without listings (``[...]``: step numbers, file or
    directory names) and with the resolved path shortened to its last component."""
    line = (message.splitlines() or [""])[0]
    line = re.sub(r"\[[^\]]*\]", "[...]", line).replace(path, os.path.basename(path.rstrip(os.sep)))
    return line[:300]


def _handler(server: RolloutServer, socket_timeout: float):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = socket_timeout  # an idle or stalled client frees its thread

        def _reply(self, code: int, payload):
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _serve(self, method):
            raw = self.headers.get("Content-Length")
            if raw is None and method == "POST" and self.headers.get("Transfer-Encoding"):
                self.close_connection = True
                return self._reply(411, {"error": {"message": "Content-Length required (chunked bodies are not accepted)", "code": 411}})
            try:
                n = int(raw or 0)
                if n < 0:
                    raise ValueError
            except ValueError:
                self.close_connection = True
                return self._reply(400, {"error": {"message": f"Content-Length={raw!r}: expected a non-negative integer", "code": 400}})
            if n > MAX_BODY:
                self.close_connection = True
                return self._reply(413, {"error": {"message": f"body of {n} bytes exceeds {MAX_BODY}", "code": 413}})
            body = self.rfile.read(n) if n else b""
            code, payload = server.handle(method, self.path, body)
            self._reply(code, payload)

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")

        def log_message(self, fmt, *args):  # quiet by default; errors are in the replies
            pass

    return Handler


class _HTTPServer(ThreadingHTTPServer):
    request_queue_size = LISTEN_BACKLOG  # the listen backlog (the standard library's default is 5)
    daemon_threads = True


def make_http_server(server: RolloutServer, host: str = "127.0.0.1", port: int = 30000, *,
                     socket_timeout: float = SOCKET_TIMEOUT_S) -> ThreadingHTTPServer:
    return _HTTPServer((host, port), _handler(server, socket_timeout))


def job_model(config_path: str, overrides: dict | None = None):
    """(ModelConfig, tokenizer) of a job config, the vocabulary widened to the tokenizer's."""
    from quads_jax.rl import loop
    from quads_jax.rl.tokenizer import CharTokenizer

    job = loop.JobConfig.load(config_path, overrides)
    tok = CharTokenizer()
    return job.model.replace(vocab_size=max(job.model.vocab_size, tok.vocab_size)), tok


def build_server(config_path: str, *, checkpoint: str | None = None, recipe: str = "quads", max_batch: int = 32,
                 max_len: int | None = None, overrides: dict | None = None, seed: int = 0,
                 weights_dirs: list[str] | tuple[str, ...] = ()) -> RolloutServer:
    """The server of a job config: its model, its task's tokenizer, weights from ``checkpoint``
    (orbax or HF directory) or a random initialisation. ``weights_dirs``: the roots that
    weight updates may load from (the checkpoint's own directory is always one)."""
    from flax import nnx

    from quads_jax.model import Transformer
    from quads_jax.train.state import split_params

    cfg, tok = job_model(config_path, overrides)
    eng = Engine(cfg, recipe=recipe, max_batch=max_batch, max_len=max_len, eos_token_id=tok.eos_id)
    srv_args = {"config": config_path, "checkpoint": checkpoint, "recipe": recipe}
    roots = list(weights_dirs) + ([os.path.dirname(os.path.abspath(checkpoint))] if checkpoint else [])
    srv = RolloutServer(eng, tok, model_path=checkpoint, server_args=srv_args, weights_dirs=roots)
    if checkpoint:
        srv.bridge.load_from_disk(checkpoint)
    else:
        eng.load(split_params(Transformer(cfg, rngs=nnx.Rngs(seed)))[1], version="random-init")
    return srv


def serve(config_path: str, *, host: str, port: int, **kw):
    srv = build_server(config_path, **kw)
    httpd = make_http_server(srv, host, port)
    print(f"[quads serve] {kw.get('recipe', 'quads')} on http://{host}:{httpd.server_address[1]} "
          f"(weights {srv.engine.version!r})", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        srv.close()
