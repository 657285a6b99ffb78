"""An HTTP rollout server that speaks SGLang's native API, backed by ``rollout.engine``.

    quads serve --config configs/tiny_cpu.yaml [--checkpoint DIR] [--recipe quads] --port 30000

Endpoints (request and response fields as in SGLang, so its clients work unchanged):
  POST /generate                  text | input_ids (one or a batch), sampling_params, return_logprob
  POST /update_weights_from_disk  {model_path, weight_version?}: through ``rollout.bridge``
  GET|POST /flush_cache, GET /health, GET /health_generate, GET /get_model_info, GET /get_server_info
  POST /abort_request, /pause_generation, /continue_generation, /release_memory_occupation,
       /resume_memory_occupation

With ``api_key`` (``quads serve --api-key``), every endpoint but /health* needs SGLang's
``Authorization: Bearer <key>`` header, else 401 (SGLang's rule and reply).

Serving: FastAPI on uvicorn, as SGLang serves its API (``make_app``, ``HTTPServer``). Each
request is handled on a worker thread and queues its sequences; one scheduler thread takes
everything queued within ``batch_window_s`` and runs it as one ``Engine.generate`` call
(continuous batching inside), so concurrent clients share the decode batch. Every request is validated against the engine's true limits before it is
queued (``Engine.validate``: types, NaN, ranges, seed width, vocabulary, context length),
and answered 400 with the reason. Should a batch still fail, each of its requests is rerun
alone, so only the one that caused it fails. Connections: a listen backlog of 1024; idle
clients are dropped after the socket timeout, and a client that stalls inside its body gets
408; 400 for malformed framing (uvicorn's HTTP parser), 413 for bodies over 64 MiB. Weight updates load only from directories under the roots the
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
from typing import Any

from pydantic import ValidationError

from rollout import schemas
from rollout.bridge import WeightBridge
from rollout.engine import TOP_LOGPROBS_MAX, Engine, Request, Result

# SGLang's GenerateReqInput and SamplingParams (0.5.23) as pydantic models: rollout.schemas
GENERATE_UNSUPPORTED = {k: v[0] for k, v in schemas.GENERATE_UNSUPPORTED.items()}  # field -> values that change nothing
SAMPLING_NEUTRAL = schemas.SAMPLING_NEUTRAL
FLUSH_TEXT = "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"
MAX_BODY = 64 << 20
SOCKET_TIMEOUT_S = 60.0  # idle or slow clients are dropped after this long without progress
LISTEN_BACKLOG = 1024


class BadRequest(ValueError):
    """A client error: answered 400 with the message."""


@dataclasses.dataclass
class _Reply:
    """An endpoint's status and payload (a str payload is sent as text/plain)."""
    code: int
    payload: Any


def _expect(cond: bool, msg: str):
    if not cond:
        raise BadRequest(msg)


def _valid(model, data, prefix: str = ""):
    """``model`` validated from ``data``, or BadRequest with the first error on one line."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BadRequest(schemas.one_line(e, data, prefix)) from None


def parse_sampling(sp: dict | None, *, tokenizer, eos_id) -> dict:
    """SGLang ``sampling_params`` -> Request keyword arguments (+ the server's own keys,
    ``LOCAL_KEYS``), validated by ``schemas.SamplingParams``."""
    sp = {} if sp is None else sp
    _expect(isinstance(sp, dict), "sampling_params: expected an object")
    m = _valid(schemas.SamplingParams, sp, "sampling_params")
    out: dict[str, Any] = {"max_new_tokens": m.max_new_tokens, "temperature": m.temperature, "top_p": m.top_p,
                           "top_k": max(0, m.top_k), "ignore_eos": m.ignore_eos}
    seed = m.seed if m.seed is not None else m.sampling_seed
    if seed is not None:
        out["seed"] = seed
    ids = list(m.stop_token_ids or [])  # a copy: one sampling_params may be shared by a batch
    strings = []
    for s in m.stop or []:  # a one-token stop string stops inside the engine; longer ones are cut after decoding
        enc = _encode(tokenizer, s)
        (ids.append(enc[0]) if len(enc) == 1 else strings.append(s))
    out["stop_token_ids"] = tuple(ids)
    out["stop_strings"] = strings
    out["decode"] = {"skip_special_tokens": m.skip_special_tokens, "spaces_between_special_tokens": m.spaces_between_special_tokens}
    out["no_stop_trim"] = m.no_stop_trim
    return out


LOCAL_KEYS = ("stop_strings", "decode", "no_stop_trim")  # parse_sampling's keys that are the server's, not the engine's


def _encode(tokenizer, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text))
    except ValueError as e:
        raise BadRequest(str(e)) from e


def _decode(tokenizer, ids, opts: dict | None = None) -> str:
    """tokenizer.decode with SGLang's detokenization options where the tokenizer takes them."""
    if opts:
        try:
            return tokenizer.decode(ids, **opts)
        except TypeError:  # a tokenizer without the options decodes its one way
            pass
    return tokenizer.decode(ids)


def _cut_at_stop(text: str, ids: list, lps: list, strings: list[str], tokenizer, *, keep: bool = False, opts=None):
    """Truncate at the first stop string: SGLang excludes it from the text, or keeps it with
    ``no_stop_trim`` (``keep``)."""
    hits = [(text.find(s), s) for s in strings if s in text]
    if not hits:
        return text, ids, lps, None
    pos, s = min(hits)
    end = pos + len(s) if keep else pos
    for n in range(1, len(ids) + 1):  # shortest token prefix whose text contains the stop string
        if s in _decode(tokenizer, ids[:n], opts):
            return text[:end], ids[:n], lps[:n], s
    return text[:end], ids, lps, s


@dataclasses.dataclass
class _Job:
    request: Request
    future: Future
    rid: str | None = None
    seq: int = 0


class RolloutServer:
    """The engine behind a scheduler thread; ``handle(method, path, body)`` is the whole API."""

    def __init__(self, engine: Engine, tokenizer, *, model_path: str | None = None, batch_window_s: float = 0.005,
                 server_args: dict | None = None, weights_dirs: list[str] | tuple[str, ...] = (), api_key: str | None = None):
        self.engine = engine
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("api_key: expected a non-empty string or None")
        self.api_key = api_key
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
        self._running = threading.Event()  # cleared by /pause_generation: queued requests wait
        self._running.set()
        self._seq = itertools.count(1)
        self._abort_lock = threading.Lock()
        self._aborted_rids: set[str] = set()
        self._abort_below = 0  # queued jobs with a smaller sequence number were aborted (abort_all)
        self.batches: list[int] = []  # sizes of the engine calls (observable batching)
        self._thread = threading.Thread(target=self._schedule, name="quads-scheduler", daemon=True)
        self._thread.start()

    # -- scheduling
    def _aborted(self, job: _Job) -> bool:
        with self._abort_lock:
            return job.seq < self._abort_below or (job.rid is not None and job.rid in self._aborted_rids)

    def _finish_aborted(self, jobs: list[_Job]) -> list[_Job]:
        """Answer the aborted jobs (finish_reason "abort", no tokens); the others, to run."""
        keep = []
        for j in jobs:
            if self._aborted(j):
                j.future.set_result(Result(output_ids=[], logprobs=[], finish_reason="abort",
                                           prompt_tokens=len(j.request.prompt), weight_version=self.engine.version))
            else:
                keep.append(j)
        return keep

    def _schedule(self):
        while not self._stop.is_set():
            if not self._running.wait(timeout=0.1):
                continue
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
            while not self._running.is_set() and not self._stop.is_set():  # paused after these were taken
                self._running.wait(timeout=0.1)
            jobs = self._finish_aborted(jobs)
            if not jobs:
                continue
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

    def submit(self, requests: list[Request], rids: list | None = None) -> list[Result]:
        self.engine.validate(requests)
        futs = []
        for r, rid in zip(requests, rids or [None] * len(requests)):
            f: Future = Future()
            self._q.put(_Job(r, f, rid, next(self._seq)))
            futs.append(f)
        return [f.result() for f in futs]

    def close(self):
        self._stop.set()
        self._thread.join(timeout=2)

    # -- API
    def authorized(self, path: str, authorization: str | None) -> bool:
        """SGLang's --api-key rule: with a key set, every endpoint but the health / readiness /
        metrics probes needs ``Authorization: Bearer <key>`` (compared in constant time)."""
        import hmac

        if self.api_key is None or path.startswith(("/health", "/ready", "/metrics")):
            return True
        scheme, _, token = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), self.api_key.encode())

    def routes(self) -> list[tuple[str, str]]:
        """(method, path) of every endpoint."""
        return list(self._routes())

    def _routes(self) -> dict:
        return {
            ("POST", "/generate"): self.generate,
            ("POST", "/update_weights_from_disk"): self.update_weights_from_disk,
            ("GET", "/flush_cache"): self.flush_cache, ("POST", "/flush_cache"): self.flush_cache,
            ("GET", "/health"): self.health,
            ("GET", "/health_generate"): self.health_generate,
            ("GET", "/get_model_info"): self.model_info, ("GET", "/model_info"): self.model_info,
            ("GET", "/get_server_info"): self.server_info, ("GET", "/server_info"): self.server_info,
            ("POST", "/abort_request"): self.abort_request,
            ("POST", "/pause_generation"): self.pause_generation, ("POST", "/continue_generation"): self.continue_generation,
            ("POST", "/release_memory_occupation"): self.release_memory_occupation,
            ("POST", "/resume_memory_occupation"): self.resume_memory_occupation,
        }

    def handle(self, method: str, path: str, body: bytes, authorization: str | None = None) -> tuple[int, Any]:
        path = path.split("?", 1)[0].rstrip("/") or "/"
        if not self.authorized(path, authorization):
            return 401, {"error": "Unauthorized"}
        routes = self._routes()
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
            out = fn(payload)
            return (out.code, out.payload) if isinstance(out, _Reply) else (200, out)
        except BadRequest as e:
            return 400, {"error": {"message": str(e), "code": 400}}
        except ValueError as e:  # engine validation: context length, token ids
            return 400, {"error": {"message": str(e), "code": 400}}
        except Exception as e:  # a server fault; still answered, still serving
            return 500, {"error": {"message": f"{type(e).__name__}: {e}", "code": 500}}

    def generate(self, body: dict):
        _expect(not self.engine.released, "the weights are released (POST /resume_memory_occupation first)")
        req = _valid(schemas.GenerateRequest, body)
        _expect((req.text is None) != (req.input_ids is None), "expected exactly one of 'text' and 'input_ids'")
        if req.text is not None:
            single = isinstance(req.text, str)
            texts = [req.text] if single else req.text
            _expect(len(texts) > 0, "text: expected a string or a non-empty list of strings")
            prompts = [_encode(self.tokenizer, x) for x in texts]
            bos = getattr(self.tokenizer, "bos_id", None)
            if bos is not None:
                prompts = [[bos] + p for p in prompts]
        else:
            ids = req.input_ids
            single = len(ids) == 0 or not isinstance(ids[0], list)
            prompts = [ids] if single else ids
            _expect(len(prompts) > 0, "input_ids: expected a list of integers or a non-empty list of such lists")
        starts = self._per_prompt(req.logprob_start_len, "logprob_start_len", -1, len(prompts))
        tops = self._per_prompt(req.top_logprobs_num, "top_logprobs_num", 0, len(prompts))
        for p, st, tn in zip(prompts, starts, tops):
            _expect(-1 <= st < len(p), f"logprob_start_len={st!r}: expected -1 (the last prompt token) or an integer below "
                                       f"the prompt length {len(p)}")
            _expect(0 <= tn <= TOP_LOGPROBS_MAX, f"top_logprobs_num={tn!r}: expected an integer in [0, {TOP_LOGPROBS_MAX}]")
        want_lp = bool(req.return_logprob)
        sps = req.sampling_params
        sps = sps if isinstance(sps, list) else [sps] * len(prompts)
        _expect(len(sps) == len(prompts), f"sampling_params: {len(sps)} given for {len(prompts)} prompts")
        parsed = [parse_sampling(sp, tokenizer=self.tokenizer, eos_id=self.engine.eos) for sp in sps]
        base_seed = next(self._ids)
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, parsed)):
            kw = {k: v for k, v in sp.items() if k not in LOCAL_KEYS}
            kw.setdefault("seed", (base_seed * 7919 + i) % (2**31))
            reqs.append(Request(prompt=p, return_experts=req.return_experts or req.return_routed_experts,
                                top_logprobs=tops[i] if want_lp else 0, prompt_logprobs=want_lp and starts[i] >= 0, **kw))
        rid = req.rid
        if isinstance(rid, list):
            _expect(len(rid) == len(prompts), f"rid: expected one string per prompt ({len(prompts)})")
        results = self.submit(reqs, rids=rid if isinstance(rid, list) else [rid] * len(reqs))
        lp_text = req.return_text_in_logprobs
        outs = []
        for i, (r, sp) in enumerate(zip(results, parsed)):
            ids, lps = list(r.output_ids), list(r.logprobs)
            text = _decode(self.tokenizer, ids, sp["decode"])
            text, ids, lps, hit = _cut_at_stop(text, ids, lps, sp["stop_strings"], self.tokenizer, keep=sp["no_stop_trim"],
                                               opts=sp["decode"])
            finish = {"type": "stop", "matched": hit} if hit else {"type": r.finish_reason}
            if r.finish_reason == "stop" and not hit and ids:
                finish["matched"] = ids[-1]
            if r.finish_reason == "length" and not hit:
                finish["length"] = len(ids)
            meta = {"id": (rid[i] if isinstance(rid, list) else rid) or uuid.uuid4().hex, "finish_reason": finish,
                    "prompt_tokens": r.prompt_tokens, "completion_tokens": len(ids), "weight_version": r.weight_version}
            if want_lp:
                txt = (lambda t: _decode(self.tokenizer, [t], sp["decode"])) if lp_text else (lambda t: None)
                triples = lambda pairs: [[v, t, txt(t)] for v, t in pairs]
                meta["output_token_logprobs"] = [[lp, t, txt(t)] for lp, t in zip(lps, ids)]
                p, st = prompts[i], starts[i]
                if st < 0:  # SGLang's default starts at the last prompt token, which gets no log-prob
                    meta["input_token_logprobs"] = [[None, p[-1], None]]
                else:  # position 0 has no context: None, as SGLang
                    plp = [None] + list(r.prompt_logprobs)
                    meta["input_token_logprobs"] = [[plp[j], p[j], txt(p[j])] for j in range(st, len(p))]
                if tops[i]:
                    meta["output_top_logprobs"] = [triples(x) for x in r.top_logprobs[: len(ids)]]
                    if st >= 0:
                        ptop = [None] + [triples(x) for x in r.prompt_top_logprobs]
                        meta["input_top_logprobs"] = ptop[st:]
            if r.experts is not None and req.return_routed_experts:
                meta["routed_experts"] = routed_experts_b64(r.prompt_experts, r.experts[: len(ids)])
            elif r.experts is not None:  # this server's own form: per generated token, [moe_layers][k]
                meta["routed_experts"] = r.experts[: len(ids)]
            outs.append({"text": text, "output_ids": ids, "meta_info": meta})
        return outs[0] if single else outs

    @staticmethod
    def _per_prompt(v, key: str, default, n: int) -> list:
        """A field given once for all prompts or as a list of one value a prompt (SGLang's form)."""
        v = default if v is None else v
        if isinstance(v, list):
            _expect(len(v) == n, f"{key}: {len(v)} values given for {n} prompts")
            return [default if x is None else x for x in v]
        return [v] * n

    def update_weights_from_disk(self, body: dict):
        """SGLang's request (model_path, load_format, weight_version, abort_all_requests; its other
        fields are ignored) and reply: {success, message, num_paused_requests}, 400 on failure."""
        try:
            req = _valid(schemas.UpdateWeightsRequest, body)
            path = req.model_path
            real = self.allowed_weights_path(path)
            if req.abort_all_requests:
                self.abort_request({"abort_all": True})
            try:
                version = self.bridge.load_from_disk(real, version=req.weight_version)
            except Exception as e:  # noqa: BLE001 - missing, corrupt or mismatched: the old weights stay
                raise BadRequest(f"weight update failed, old weights kept (version {self.engine.version!r}): "
                                 f"{type(e).__name__}: {_redact(str(e), real)}") from e
        except BadRequest as e:
            return _Reply(400, {"success": False, "message": str(e), "num_paused_requests": 0})
        self.model_path = path
        return {"success": True, "message": f"Succeeded to update model weights from {path}.", "num_paused_requests": 0,
                "weight_version": version}

    def abort_request(self, body: dict):
        """SGLang's {rid} or {abort_all: true}: queued requests end with finish_reason "abort";
        a batch already on the device finishes."""
        req = _valid(schemas.AbortRequest, body)
        rid, all_ = req.rid, req.abort_all
        _expect(all_ or rid is not None, "abort_request: expected 'rid' (a string) or 'abort_all': true")
        with self._abort_lock:
            if all_:
                self._abort_below = next(self._seq)
            else:
                self._aborted_rids.add(rid)
        return _Reply(200, "")

    def release_memory_occupation(self, body: dict):
        """SGLang's {tags?}: "weights" to host memory ("kv_cache": nothing is held between
        batches); /generate answers 400 until /resume_memory_occupation. Other fields ignored."""
        self.engine.release_memory(self._memory_tags(body))
        return _Reply(200, None)

    def resume_memory_occupation(self, body: dict):
        self.engine.resume_memory(self._memory_tags(body))
        return _Reply(200, None)

    @staticmethod
    def _memory_tags(body):
        return _valid(schemas.MemoryRequest, body).tags

    def pause_generation(self, body=None):
        """Queued requests wait until /continue_generation; a batch on the device finishes.
        SGLang's ``mode``: "abort" also ends every queued request (finish_reason "abort");
        "in_place" and "retract" (SGLang's default) only pause here."""
        mode = _valid(schemas.PauseRequest, body or {}).mode
        self._running.clear()
        if mode == "abort":
            self.abort_request({"abort_all": True})
        return _Reply(200, {"message": "Generation paused successfully."})

    def continue_generation(self, _body=None):
        self._running.set()
        return _Reply(200, {"message": "Generation continued successfully."})

    def allowed_weights_path(self, path: str) -> str:
        """``path`` with symlinks resolved, if it lies under an allowed weights root; else 400
        (one message for every refusal: the reply says nothing of what exists on disk)."""
        real = os.path.realpath(path)
        ok = any(real == d or real.startswith(d + os.sep) for d in self.weights_dirs)
        _expect(ok and os.path.isdir(real), "model_path: not a loadable directory under the server's allowed weights "
                                            "directories (--weights-dir)")
        return real

    def flush_cache(self, _body=None):
        """SGLang's reply, as text (this engine keeps no prefix cache between batches)."""
        return _Reply(200, FLUSH_TEXT)

    def health(self, _body=None):
        """SGLang answers 200 with an empty body."""
        return _Reply(200, "")

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


def routed_experts_b64(prompt_experts, output_experts) -> str:
    """SGLang's ``routed_experts``: base64 of int32 [prompt + output - 1, moe_layers, k], the
    experts of every position fed to the model (the prompt's, then each generated token's but
    the last); SGLang's clients reshape it with the model's layer count and top-k."""
    import base64

    import numpy as np

    rows = list(prompt_experts or []) + list(output_experts)
    return base64.b64encode(np.asarray(rows, np.int32).tobytes()).decode("ascii")


def _no_constant(name):
    raise BadRequest(f"malformed JSON body: {name} is not a number JSON allows")


def _redact(message: str, path: str) -> str:
    """The first line of an error message, without listings (``[...]``: step numbers, file or
    directory names) and with the resolved path shortened to its last component."""
    line = (message.splitlines() or [""])[0]
    line = re.sub(r"\[[^\]]*\]", "[...]", line).replace(path, os.path.basename(path.rstrip(os.sep)))
    return line[:300]


def make_app(server: RolloutServer, *, socket_timeout: float = SOCKET_TIMEOUT_S):
    """The FastAPI application of ``server``, as SGLang serves its API: SGLang's routes (and a
    catch-all, so unknown paths get this API's 404 / 405), each request handed to
    ``RolloutServer.handle`` on a worker thread. Bodies over MAX_BODY are refused (413) before
    they are read; a client that stops sending its body for ``socket_timeout`` seconds gets
    408 and is disconnected."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response

    # Plain threads, not anyio's worker threads (orbax's restore fails inside those): a request
    # holds one until its batch is done, so there are as many as the listen backlog.
    pool = ThreadPoolExecutor(max_workers=LISTEN_BACKLOG, thread_name_prefix="quads-http")
    app = FastAPI(title="quads-jax rollout server (SGLang's native API)", on_shutdown=[lambda: pool.shutdown(wait=False)])
    closing = {"Connection": "close"}

    async def dispatch(request: Request):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY:
            return JSONResponse({"error": {"message": f"body of {size} bytes exceeds {MAX_BODY}", "code": 413}}, 413,
                                headers=closing)
        try:
            body = await asyncio.wait_for(request.body(), socket_timeout)
        except asyncio.TimeoutError:
            return Response(status_code=408, headers=closing)
        if len(body) > MAX_BODY:  # a chunked body without a length
            return JSONResponse({"error": {"message": f"body exceeds {MAX_BODY} bytes", "code": 413}}, 413, headers=closing)
        code, payload = await asyncio.get_running_loop().run_in_executor(
            pool, server.handle, request.method, request.url.path, body, request.headers.get("authorization"))
        if isinstance(payload, str):
            return PlainTextResponse(payload, code)
        return JSONResponse(payload, code)

    dispatch.__annotations__ = {"request": Request}  # resolved here: this module postpones annotations
    for method, path in server.routes():
        app.add_api_route(path, dispatch, methods=[method], name=f"{method} {path}", include_in_schema=True)
    app.add_api_route("/{rest:path}", dispatch, methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False)
    return app


class HTTPServer:
    """uvicorn serving ``make_app(server)`` on a socket bound at construction (port 0: any free
    port, read back from ``server_address``); ``serve_forever`` blocks (run it on a thread),
    ``shutdown`` stops it and waits. The listen backlog is LISTEN_BACKLOG; idle keep-alive
    connections are closed after ``socket_timeout``."""

    def __init__(self, server: RolloutServer, host: str, port: int, *, socket_timeout: float = SOCKET_TIMEOUT_S):
        import socket

        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        self.server_address = self._sock.getsockname()[:2]
        config = uvicorn.Config(make_app(server, socket_timeout=socket_timeout), log_level="warning",
                                timeout_keep_alive=socket_timeout, backlog=LISTEN_BACKLOG)
        self._uvicorn = uvicorn.Server(config)
        self._done = threading.Event()

    def serve_forever(self):
        try:
            self._uvicorn.run(sockets=[self._sock])
        finally:
            self._done.set()

    def shutdown(self, timeout: float = 10.0):
        self._uvicorn.should_exit = True
        self._done.wait(timeout)

    def server_close(self):
        self._sock.close()


def make_http_server(server: RolloutServer, host: str = "127.0.0.1", port: int = 30000, *,
                     socket_timeout: float = SOCKET_TIMEOUT_S) -> HTTPServer:
    return HTTPServer(server, host, port, socket_timeout=socket_timeout)


def job_model(config_path: str, overrides: dict | None = None):
    """(ModelConfig, tokenizer) of a job config, the vocabulary widened to the tokenizer's."""
    from quads_jax.rl import loop
    from quads_jax.rl.tokenizer import CharTokenizer

    job = loop.JobConfig.load(config_path, overrides)
    tok = CharTokenizer()
    return job.model.replace(vocab_size=max(job.model.vocab_size, tok.vocab_size)), tok


def build_server(config_path: str, *, checkpoint: str | None = None, recipe: str = "quads", max_batch: int = 32,
                 max_len: int | None = None, overrides: dict | None = None, seed: int = 0,
                 weights_dirs: list[str] | tuple[str, ...] = (), api_key: str | None = None) -> RolloutServer:
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
    srv = RolloutServer(eng, tok, model_path=checkpoint, server_args=srv_args, weights_dirs=roots, api_key=api_key)
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
