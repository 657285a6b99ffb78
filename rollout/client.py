"""A client for SGLang's native HTTP API: this project's ``quads serve`` or a real SGLang server.

    c = RolloutClient("http://127.0.0.1:30000")
    outs = c.generate(input_ids=[[1, 5, 7], [1, 6]], sampling_params={"max_new_tokens": 16, "seed": 0},
                      return_logprob=True)
    c.update_weights_from_disk("runs/x/ckpt", weight_version="step-100")

Standard library only (urllib). A 4xx/5xx answer raises ``RolloutError`` with the server's
message and status; connection failures are retried ``retries`` times.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any


class RolloutError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class RolloutClient:
    def __init__(self, base_url: str, *, timeout: float = 600.0, retries: int = 2, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.api_key = api_key  # sent as SGLang's "Authorization: Bearer" header

    def _call(self, method: str, path: str, body: Any = None):
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    raw = r.read()
                    if "json" not in (r.headers.get("Content-Type") or "application/json"):
                        return raw.decode(errors="replace")  # SGLang answers /flush_cache and /health in text
                    return json.loads(raw) if raw else None
            except urllib.error.HTTPError as e:
                raw = e.read()
                try:
                    msg = json.loads(raw)
                    msg = msg.get("error", {}).get("message") or msg.get("message") or raw.decode()
                except (json.JSONDecodeError, AttributeError):
                    msg = raw.decode(errors="replace")
                raise RolloutError(e.code, msg) from None
            except (urllib.error.URLError, ConnectionError):
                if attempt == self.retries:
                    raise
                time.sleep(0.2 * (attempt + 1))

    # -- SGLang native endpoints
    def generate(self, *, text=None, input_ids=None, sampling_params: dict | list | None = None,
                 return_logprob: bool = False, **extra):
        body = {k: v for k, v in {"text": text, "input_ids": input_ids, "sampling_params": sampling_params,
                                  "return_logprob": return_logprob or None}.items() if v is not None}
        body.update(extra)
        return self._call("POST", "/generate", body)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None):
        body = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._call("POST", "/update_weights_from_disk", body)

    def flush_cache(self) -> bool:
        """True when the server flushed (SGLang answers 200 with a text body)."""
        self._call("POST", "/flush_cache", {})
        return True

    def health(self) -> bool:
        """True when the server answers /health with 200 (SGLang's body is empty)."""
        self._call("GET", "/health")
        return True

    def abort_request(self, rid: str | None = None, *, abort_all: bool = False):
        return self._call("POST", "/abort_request", {"abort_all": True} if abort_all else {"rid": rid})

    def pause_generation(self):
        return self._call("POST", "/pause_generation", {})

    def continue_generation(self):
        return self._call("POST", "/continue_generation", {})

    def health_generate(self):
        return self._call("GET", "/health_generate")

    def model_info(self):
        return self._call("GET", "/get_model_info")

    def server_info(self):
        return self._call("GET", "/get_server_info")

    def wait_ready(self, timeout: float = 120.0):
        """Poll /health until the server answers (e.g. after starting it in a subprocess)."""
        t0 = time.monotonic()
        while True:
            try:
                return self.health()
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"{self.base_url} did not become healthy within {timeout} s") from None
                time.sleep(0.25)

    # -- the trainer's view: token ids in, (ids, logprobs, finish, version) out
    def rollout(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                seeds: list[int] | None = None, stop_token_ids=()) -> list[dict]:
        sps = [{"max_new_tokens": max_new_tokens, "temperature": temperature, "stop_token_ids": list(stop_token_ids),
                **({"seed": seeds[i]} if seeds else {})} for i in range(len(prompts))]
        outs = self.generate(input_ids=prompts, sampling_params=sps, return_logprob=True)
        return [{"output_ids": o["output_ids"], "logprobs": [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
                 "finish_reason": o["meta_info"]["finish_reason"]["type"],
                 "weight_version": o["meta_info"].get("weight_version")} for o in outs]


class RemoteRollout:
    """A rollout server used like an in-process ``Engine``: ``load(params, version)`` writes a
    params-only orbax step to ``sync_dir`` and asks the server to load it through
    /update_weights_from_disk; ``generate(requests)`` sends the batch over /generate and
    returns ``engine.Result`` objects. The RL loop takes either."""

    def __init__(self, client: RolloutClient, sync_dir: str, *, precision=None):
        self.client = client
        self.sync_dir = sync_dir
        self.version = None
        if precision is not None:  # the server must quantize as the RL recipe says
            import dataclasses

            served = client.server_info().get("precision", {})
            want = {k: v for k, v in dataclasses.asdict(precision).items() if k != "backend"}
            diff = {k: (served.get(k), v) for k, v in want.items() if served.get(k) != v}
            if diff:
                raise ValueError(f"rollout server at {client.base_url} serves a different precision "
                                 f"(field: (served, needed)) {diff}; start it with the RL recipe's --recipe")
        from quads_jax.train.checkpoint import Checkpointer

        self._ckpt = Checkpointer(sync_dir, save_every=1, max_to_keep=2, async_save=False)

    def load(self, params: dict, version=None):
        step = int(version) if isinstance(version, int) else (self._ckpt.latest_step() or 0) + 1
        self._ckpt.save_params(params, step)
        self._ckpt.wait()
        self.client.update_weights_from_disk(self.sync_dir, weight_version=str(version if version is not None else step))
        self.version = version

    def generate(self, requests):
        from rollout.engine import Result

        sps = [{"max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "top_p": r.top_p,
                "top_k": r.top_k if r.top_k else -1, "seed": r.seed, "stop_token_ids": list(r.stop_token_ids),
                "ignore_eos": r.ignore_eos} for r in requests]
        outs = self.client.generate(input_ids=[list(map(int, r.prompt)) for r in requests], sampling_params=sps,
                                    return_logprob=True)
        return [Result(output_ids=o["output_ids"], logprobs=[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
                       finish_reason=o["meta_info"]["finish_reason"]["type"], prompt_tokens=o["meta_info"]["prompt_tokens"],
                       weight_version=o["meta_info"].get("weight_version")) for o in outs]

    def close(self):
        self._ckpt.close()
