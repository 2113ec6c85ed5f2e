"""An engine in front of a serving engine a miner runs beside it: vLLM or SGLang serving Kimi K3 on GPUs.

Two wire protocols, each as the server really speaks it:
- `vllm`: the OpenAI legacy completions endpoint (`/v1/completions`) with vLLM's extensions: the
  prompt as token ids, `return_tokens_as_token_ids` (tokens come back as `token_id:N`), per-token
  `logprobs`, and `prompt_logprobs` for teacher-forced scoring (or the standard `echo` form).
- `sglang`: SGLang's native `/generate`: `input_ids` in, `output_ids` and `[logprob, token_id, text]`
  entries out (`return_logprob`, `top_logprobs_num`), and `logprob_start_len=0` for teacher forcing.
  Token ids are always read from id fields, never parsed from token text. Streams may be
  cumulative (SGLang's default) or incremental (`--incremental-streaming-output`); both are read.

Streams are server-sent events read by `httpx-sse` (CRLF, comments, multi-line data as the standard
says). Deadlines fit prefill: the first token is due `first_token_floor_s + prompt_tokens / rate`
after the request starts (rate: the declared prefill rate, or the slowest measured lately when that
is lower); after it, each event must follow the last within `stall_timeout_s`.

The model-dependent parts come from the served model's own files (`build_remote_engine`):
vocabulary and eos from its `config.json`, the fingerprint from `k3_manifest.json` (made by
`python -m inference manifest DIR`), the tokenizer from `tiktoken.model` (Kimi K3 releases) or
`tokenizer.json` (byte-level BPE saved by `tokenizers`).

Sampling is the server's own (capabilities say `sampler: "engine"`): every request carries a seed (the
request's, or one drawn here and reported in the final event), but the server's sampler is not the protocol's
k3-gumbel/1, so a validator cannot replay its sampled answers token by token (it checks them statistically).
"""
from __future__ import annotations

import asyncio
import collections
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
from httpx_sse import EventSource, SSEError

from inference.decoding.sampling import ENGINE_SAMPLER, MAX_LOGPROBS, ReplayKey, draw_seed
from inference.serving.engine import (Engine, EngineCapabilities, EngineError, EngineHealth, FinalEvent,
                                      GenerationRequest, ScoredPosition, TokenEvent)
from inference.serving.metrics import EngineMetrics

PROTOCOLS = ("vllm", "sglang")
SCORE_MODES = ("prompt_logprobs", "echo")
# SGLang's "no top-k" value (its SamplingParams default); 0 means "off" here.
SGLANG_NO_TOP_K = 1 << 30


@dataclass(frozen=True)
class RemoteSettings:
    base_url: str  # e.g. http://127.0.0.1:8000 (vllm: the /v1 prefix is added here)
    model_name: str
    api_key: str | None = None
    protocol: str = "vllm"  # "vllm" (OpenAI completions + vLLM extensions) or "sglang" (native /generate)
    score_mode: str = "prompt_logprobs"  # vllm protocol only: "prompt_logprobs" or "echo"
    max_context: int = 131072
    max_concurrent_sequences: int = 64
    connect_timeout_s: float = 5.0
    first_token_floor_s: float = 60.0  # the first token's deadline: this floor ...
    prefill_tokens_per_s: float = 1000.0  # ... plus the prompt at this (declared) prefill rate
    stall_timeout_s: float = 30.0  # after the first token: longest gap between two events
    total_timeout_s: float = 1800.0
    health_interval_s: float = 5.0

    def problems(self) -> list[str]:
        out = []
        if self.protocol not in PROTOCOLS:
            out.append(f"remote protocol {self.protocol!r} is not one of {PROTOCOLS}")
        if self.score_mode not in SCORE_MODES:
            out.append(f"remote score mode {self.score_mode!r} is not one of {SCORE_MODES}")
        for name in ("connect_timeout_s", "first_token_floor_s", "prefill_tokens_per_s", "stall_timeout_s",
                     "total_timeout_s", "health_interval_s"):
            if not getattr(self, name) > 0:
                out.append(f"{name} must be positive")
        return out


MODELS_PATH = "/v1/models"  # vLLM and SGLang both list their models here (OpenAI's list shape)


def served_model_problems(listing, settings: RemoteSettings) -> list[str]:
    """What in a server's /v1/models answer contradicts the miner's settings: the model is not served, or its
    context (`max_model_len`, which vLLM and SGLang report) is below the miner's declared --max-context."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return [f"{MODELS_PATH} is not a model list (no 'data' array)"]
    entries = {m.get("id"): m for m in data if isinstance(m, dict)}
    entry = entries.get(settings.model_name)
    if entry is None:
        return [f"the server does not serve {settings.model_name!r} (it serves {sorted(map(str, entries))}): "
                "give --remote-model the name the server was started with (vLLM's --served-model-name)"]
    served_context = entry.get("max_model_len")
    if isinstance(served_context, int) and served_context < settings.max_context:
        return [f"the server serves {settings.model_name!r} with a context of {served_context} tokens, below this "
                f"miner's --max-context {settings.max_context}: lower --max-context, or restart the server with a "
                "larger one (vLLM's --max-model-len, SGLang's --context-length)"]
    return []


def check_served_model(settings: RemoteSettings) -> str:
    """Read the server's /v1/models once (within the connect timeout) and refuse settings it contradicts
    (RemoteSetupError). Returns "ok", or why the server could not be asked (it may still be loading the model:
    the engine's health says so until it answers)."""
    url = settings.base_url.rstrip("/") + MODELS_PATH
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    try:
        r = httpx.get(url, headers=headers, timeout=settings.connect_timeout_s)
    except httpx.HTTPError as exc:
        return f"cannot reach {url}: {exc!r}"
    if r.status_code != 200:
        return f"{url} answered HTTP {r.status_code}"
    try:
        listing = r.json()
    except ValueError:
        return f"{url} answered something other than JSON"
    problems = served_model_problems(listing, settings)
    if problems:
        raise RemoteSetupError(f"{url}: " + "; ".join(problems))
    return "ok"


def first_token_deadline_s(prompt_tokens: int, floor_s: float, prefill_tokens_per_s: float) -> float:
    """Seconds from a request's start by which its first token is due: a floor plus the prefill."""
    return floor_s + max(0, prompt_tokens) / prefill_tokens_per_s


class PrefillRate:
    """The prefill rate the deadlines assume: the declared one, or the slowest recently measured
    (prompt tokens / time to first token, on prompts long enough to say something) when lower."""

    MIN_PROMPT = 256

    def __init__(self, declared_tokens_per_s: float, window: int = 32):
        self.declared = declared_tokens_per_s
        self._measured: collections.deque[float] = collections.deque(maxlen=window)

    def record(self, prompt_tokens: int, ttft_s: float) -> None:
        if prompt_tokens >= self.MIN_PROMPT and ttft_s > 0:
            self._measured.append(prompt_tokens / ttft_s)

    @property
    def tokens_per_s(self) -> float:
        return min([self.declared, *self._measured])


def parse_token_key(key) -> int:
    """`token_id:123` -> 123: the only form in which a vLLM server names a token by id."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.startswith("token_id:"):
        try:
            return int(key[len("token_id:"):])
        except ValueError:
            pass
    raise EngineError("engine_failure", f"the server returned token {key!r} instead of a token id; "
                                        "it must honour return_tokens_as_token_ids")


def parse_id_key(key) -> int:
    """A `prompt_logprobs` key: vLLM keys that map by token id, as a decimal string (JSON keys are strings)."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    return parse_token_key(key)


_STATUS_CODES = {400: "invalid_request", 404: "engine_unavailable", 413: "context_too_long", 422: "invalid_request",
                 429: "over_capacity", 503: "engine_unavailable"}
_CONTEXT_WORDS = ("context", "too long")  # vLLM: "This model's maximum context length is ..."


def openai_sampling_extras(top_k: int, seed: int | None, stop, ignore_eos: bool) -> dict:
    """The keys of an OpenAI-compatible request body sent only when set: top_k, seed, stop and vLLM's ignore_eos
    (completions and chat completions alike)."""
    extras: dict = {}
    if top_k:
        extras["top_k"] = top_k
    if seed is not None:
        extras["seed"] = seed
    if stop:
        extras["stop"] = list(stop)
    if ignore_eos:
        extras["ignore_eos"] = True
    return extras


def _error_from_status(status: int, text: str) -> EngineError:
    """A server's non-200 answer as our error: the status picks the code, the server's message is kept."""
    try:
        payload = json.loads(text)
    except ValueError:
        payload = None
    message = text
    if isinstance(payload, dict):
        err = payload.get("error", payload)  # vLLM: {"error": {...}} or {"message": ...}; SGLang: {"error": "..."}
        if isinstance(err, dict):
            message = str(err.get("message") or err)
        elif err is not None:
            message = str(err)
    code = _STATUS_CODES.get(status, "engine_failure" if status >= 500 else "invalid_request")
    if code == "invalid_request" and any(w in message.lower() for w in _CONTEXT_WORDS):
        code = "context_too_long"
    return EngineError(code, f"server answered HTTP {status}: {message}", http_status=status)


def _stream_error(err) -> EngineError:
    """An error event inside a 200 stream. vLLM refuses a streamed request this way (with the HTTP
    code it would have used in the event); SGLang's carries a code too."""
    message = err.get("message", err) if isinstance(err, dict) else err
    code = err.get("code") if isinstance(err, dict) else None
    if isinstance(code, int) and 400 <= code < 500:
        mapped = _error_from_status(code, json.dumps({"error": err}))
        return EngineError(mapped.code, f"server error {code} in the stream: {message}")
    return EngineError("engine_failure", f"server error mid-stream: {message}")


class RemoteEngine(Engine):
    def __init__(self, settings: RemoteSettings, *, vocab_size: int, eos_id: int | None = None,
                 model_fingerprint: str = "", stop_ids=(), tokenizer=None, metrics: EngineMetrics | None = None):
        problems = settings.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.settings = settings
        self.metrics = metrics or EngineMetrics(model_name=settings.model_name)  # as measured from here
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.stop_ids = frozenset(stop_ids) | ({eos_id} if eos_id is not None else set())
        self.model_fingerprint = model_fingerprint
        self.tokenizer = tokenizer  # the served model's tokenizer (the miner tokenizes text prompts with it)
        self.prefill_rate = PrefillRate(settings.prefill_tokens_per_s)
        self._client: httpx.AsyncClient | None = None
        self._health = EngineHealth("down", "not started")
        self._health_task: asyncio.Task | None = None

    # ------------------------------------------------------------- lifecycle
    @property
    def _root(self) -> str:
        return self.settings.base_url.rstrip("/")

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self.settings.api_key:
            h["Authorization"] = f"Bearer {self.settings.api_key}"
        return h

    async def start(self) -> None:
        if self._client is None:
            s = self.settings
            self._client = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=max(100, s.max_concurrent_sequences + 8)),
                # reads are bounded by the deadlines below, not by a per-read timeout
                timeout=httpx.Timeout(connect=s.connect_timeout_s, read=None, write=s.connect_timeout_s,
                                      pool=s.total_timeout_s))
            await self._check_health()
            self._health_task = asyncio.create_task(self._watch_health())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except (asyncio.CancelledError, Exception):
                pass
            self._health_task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        self._health = EngineHealth("down", "stopped")

    async def _check_health(self) -> None:
        url = self._root + MODELS_PATH
        try:
            r = await self._client.get(url, headers=self._headers(), timeout=self.settings.connect_timeout_s)
            if r.status_code != 200:
                self._health = EngineHealth("down", f"{url} answered HTTP {r.status_code}")
                return
            problems = served_model_problems(r.json(), self.settings)
            self._health = EngineHealth("down", "; ".join(problems)) if problems else EngineHealth("ok")
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            self._health = EngineHealth("down", f"cannot reach {url}: {exc!r}")

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            await self._check_health()

    def health(self) -> EngineHealth:
        return self._health

    def capabilities(self) -> EngineCapabilities:
        s = self.settings
        return EngineCapabilities(
            model_id=s.model_name, model_fingerprint=self.model_fingerprint, vocab_size=self.vocab_size,
            max_context=s.max_context, max_concurrent_sequences=s.max_concurrent_sequences, engine_kind="remote",
            layout={"server": s.base_url, "protocol": s.protocol}, precision="server", sampler=ENGINE_SAMPLER,
        )

    def first_token_deadline_s(self, prompt_tokens: int) -> float:
        return first_token_deadline_s(prompt_tokens, self.settings.first_token_floor_s, self.prefill_rate.tokens_per_s)

    # ----------------------------------------------------------------- HTTP
    async def _send(self, path: str, body: dict, deadline: float, stream: bool, late: str = "") -> httpx.Response:
        """POST and wait for the answer's headers until `deadline` (loop time); non-200 -> EngineError."""
        if self._client is None:
            raise EngineError("engine_unavailable", "the remote engine is not started")
        request = self._client.build_request("POST", self._root + path, content=json.dumps(body),
                                             headers=self._headers())
        try:
            async with asyncio.timeout_at(deadline):
                resp = await self._client.send(request, stream=True)
                if resp.status_code != 200:
                    try:
                        text = (await resp.aread())[:4096].decode(errors="replace")
                    finally:
                        await resp.aclose()
                    raise _error_from_status(resp.status_code, text)
                if not stream:
                    try:
                        await resp.aread()
                    finally:
                        await resp.aclose()
        except TimeoutError:
            raise EngineError("engine_stalled", late or f"the server did not answer {path} in time",
                              timeout="first_byte") from None
        except httpx.HTTPError as exc:
            raise EngineError("engine_unavailable", f"cannot reach the server: {exc!r}", unreachable=True) from None
        return resp

    async def _events(self, resp: httpx.Response, clock: "_StreamClock"):
        """The JSON payloads of a server-sent event stream, each awaited until `clock.deadline()`."""
        events = EventSource(resp).aiter_sse()
        try:
            while True:
                try:
                    async with asyncio.timeout_at(clock.deadline()):
                        sse = await anext(events)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise EngineError("engine_stalled", clock.overdue(), timeout=clock.which()) from None
                except SSEError as exc:
                    raise EngineError("engine_failure", f"the server's answer is not an event stream: {exc}") from None
                except httpx.HTTPError as exc:
                    raise EngineError("engine_failure", f"the stream broke: {exc!r}") from None
                clock.event()
                if sse.data == "[DONE]":
                    await _drain(events, min(clock.deadline(), asyncio.get_running_loop().time() + DRAIN_S))
                    return
                if not sse.data:
                    continue
                yield event_chunk(sse.data)
        finally:
            await events.aclose()

    # ----------------------------------------------------------- generation
    def generate(self, request: GenerationRequest):
        return self._generate(request)

    async def _generate(self, request: GenerationRequest):
        p = request.sampling
        problems = p.problems()
        if problems:
            raise EngineError("invalid_request", "; ".join(problems))
        if p.seed is None:  # every answer names its seed; under 2^63, which every server reads as an integer
            p = replace(p, seed=draw_seed() >> 1)
            request = replace(request, sampling=p)
        n_prompt = len(request.prompt_token_ids)
        if n_prompt + p.max_tokens > self.settings.max_context:
            raise EngineError("context_too_long", f"prompt plus max_tokens exceeds {self.settings.max_context}")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        first_deadline = t0 + self.first_token_deadline_s(n_prompt)
        if self.settings.protocol == "sglang":
            path, body, reader = "/generate", self._sglang_generate_body(request), _SGLangStream(self, request)
        else:
            path, body, reader = "/v1/completions", self._vllm_generate_body(request), _VLLMStream(self, request)
        resp = await self._send(path, body, first_deadline, stream=True,
                                late=f"no first token within {first_deadline - t0:.1f} s (the prefill deadline)")
        clock = _StreamClock(loop, t0, first_deadline, self.settings)
        index = 0
        last_at = t0
        self.metrics.active_sequences.inc()
        try:
            events = self._events(resp, clock)
            try:
                async for data in events:
                    for token_id, text, logprob, top in reader.tokens(data):
                        now = loop.time()
                        if clock.first_token_at is None:
                            clock.token()
                            self.prefill_rate.record(n_prompt, clock.first_token_at - t0)
                            self.metrics.ttft_seconds.observe(now - t0)
                        else:
                            self.metrics.inter_token_seconds.observe(now - last_at)
                        last_at = now
                        self.metrics.generation_tokens.inc()
                        yield TokenEvent(index, token_id, text, logprob, top)
                        index += 1
            finally:
                await events.aclose()
        finally:
            self.metrics.active_sequences.dec()
            await resp.aclose()
        first_at = clock.first_token_at
        reason = reader.finish_reason(index)
        end = loop.time()
        self.metrics.record_finished(reason, n_prompt, index, t0, None, first_at, end)
        yield FinalEvent(
            finish_reason=reason, prompt_tokens=n_prompt, completion_tokens=index, queue_ms=0.0,
            ttft_ms=None if first_at is None else (first_at - t0) * 1000, total_ms=(end - t0) * 1000, seed=p.seed,
        )

    def _vllm_generate_body(self, request: GenerationRequest) -> dict:
        p = request.sampling
        body = {
            "model": self.settings.model_name,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": max(1, p.logprobs),
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        return body | openai_sampling_extras(p.top_k, p.seed, p.stop, p.ignore_eos)

    def _sglang_generate_body(self, request: GenerationRequest) -> dict:
        p = request.sampling
        sampling = {
            "max_new_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k or SGLANG_NO_TOP_K,
            "skip_special_tokens": False,
            "ignore_eos": bool(p.ignore_eos),
        }
        if p.seed is not None:
            sampling["sampling_seed"] = p.seed
        if p.stop:
            sampling["stop"] = list(p.stop)
        if self.stop_ids:
            sampling["stop_token_ids"] = sorted(self.stop_ids)
        return {
            "input_ids": list(request.prompt_token_ids),
            "sampling_params": sampling,
            "stream": True,
            "return_logprob": True,
            "logprob_start_len": -1,  # no prompt logprobs while generating
            "top_logprobs_num": max(1, p.logprobs),
            "return_text_in_logprobs": False,
        }

    # -------------------------------------------------------------- scoring
    async def score(self, token_ids: list[int], positions: list[int] | None = None, top_k: int = 0,
                    replay: ReplayKey | None = None) -> list[ScoredPosition]:
        if replay is not None:
            raise EngineError("invalid_request", "a remote engine returns no logits rows: it cannot replay sampled "
                                                 "tokens")
        if len(token_ids) < 2:
            raise EngineError("invalid_request", "scoring needs at least 2 tokens")
        if not 0 <= top_k <= MAX_LOGPROBS:
            raise EngineError("invalid_request", f"top_k must lie in 0..{MAX_LOGPROBS}")
        n = len(token_ids)
        if n > self.settings.max_context:
            raise EngineError("context_too_long", f"{n} tokens exceed the context of {self.settings.max_context}")
        wanted = sorted(set(range(1, n)) if positions is None else set(positions))
        if any(not 1 <= q < n for q in wanted):
            raise EngineError("invalid_request", f"positions must lie in 1..{n - 1}")
        k = max(1, top_k)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(self.first_token_deadline_s(n), self.settings.total_timeout_s)
        if self.settings.protocol == "sglang":
            body = {"input_ids": list(token_ids), "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
                    "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": k,
                    "return_text_in_logprobs": False, "stream": False}
            resp = await self._send("/generate", body, deadline, stream=False)
            per_position = _sglang_prompt_logprobs(_json_body(resp), token_ids)
        else:
            body = {"model": self.settings.model_name, "prompt": list(token_ids), "max_tokens": 1,
                    "temperature": 0.0, "return_tokens_as_token_ids": True}
            if self.settings.score_mode == "prompt_logprobs":
                body["prompt_logprobs"] = k
            else:
                body.update(echo=True, logprobs=k)
            resp = await self._send("/v1/completions", body, deadline, stream=False)
            choice = (_json_body(resp).get("choices") or [{}])[0]
            per_position = self._vllm_prompt_logprobs(choice, token_ids)
        out = []
        for q in wanted:
            entry = per_position[q]
            if entry is None:
                raise EngineError("engine_failure", f"the server returned no logprob for position {q}")
            actual, table = entry
            top = sorted(table.items(), key=lambda kv: -kv[1])[:top_k]
            out.append(ScoredPosition(q, token_ids[q], actual, top))
        return out

    def _vllm_prompt_logprobs(self, choice: dict, token_ids: list[int]) -> list:
        """Per prompt position: (logprob of the actual token, {token_id: logprob} alternatives)."""
        n = len(token_ids)
        result: list = [None] * n
        if self.settings.score_mode == "prompt_logprobs":
            plp = choice.get("prompt_logprobs")
            if not isinstance(plp, list) or len(plp) < n:
                raise EngineError("engine_failure", "the server did not return prompt_logprobs for every prompt token")
            for q in range(1, n):
                table = {parse_id_key(k): float(v["logprob"] if isinstance(v, dict) else v)
                         for k, v in (plp[q] or {}).items()}
                if token_ids[q] in table:
                    result[q] = (table[token_ids[q]], table)
        else:
            lp = choice.get("logprobs") or {}
            tokens, values, tops = lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
            if len(tokens) < n:
                raise EngineError("engine_failure", "the server did not echo logprobs for every prompt token")
            for q in range(1, n):
                if parse_token_key(tokens[q]) != token_ids[q]:
                    raise EngineError("engine_failure", f"the server echoed a different token at position {q}")
                table = {parse_token_key(k): float(v) for k, v in (tops[q] or {}).items()}
                result[q] = (float(values[q]), table)
        return result


def _json_body(resp: httpx.Response) -> dict:
    try:
        data = resp.json()
    except ValueError:
        raise EngineError("engine_failure", "the server's answer is not JSON") from None
    if not isinstance(data, dict):
        raise EngineError("engine_failure", "the server's answer is not a JSON object")
    return data


# How long the end of a stream's body may take after its [DONE] event (the chunked encoding's last
# chunk) before the connection is closed instead of kept for the next request.
DRAIN_S = 1.0


def event_chunk(data: str) -> dict:
    """One server-sent event's data as the JSON object it must be; an error event as its EngineError."""
    try:
        chunk = json.loads(data)
    except ValueError:
        raise EngineError("engine_failure", f"malformed event from the server: {data[:200]!r}") from None
    if not isinstance(chunk, dict):
        raise EngineError("engine_failure", f"unexpected event from the server: {data[:200]!r}")
    if chunk.get("error") and not chunk.get("choices"):
        raise _stream_error(chunk["error"])
    return chunk


async def _drain(events, deadline: float) -> None:
    """Read a stream to its end after [DONE], so that httpx puts the connection back in its pool
    (keep-alive, as every other HTTP client does) instead of closing it: a new TCP connection per
    request costs a connect and the server's connection setup inside the next request's TTFT."""
    try:
        async with asyncio.timeout_at(deadline):
            async for _ in events:
                pass
    except (TimeoutError, SSEError, httpx.HTTPError):
        pass  # the connection is closed instead; the answer is complete either way


class _StreamClock:
    """The deadline of a stream's next event: the first token's (from the request's start) until a
    token came, then the stall timer from the last event; always within the total timeout."""

    def __init__(self, loop, t0: float, first_deadline: float, settings: RemoteSettings):
        self.loop, self.t0, self.first_deadline, self.settings = loop, t0, first_deadline, settings
        self.total_deadline = t0 + settings.total_timeout_s
        self.first_token_at: float | None = None
        self.last_event_at = t0

    def token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = self.last_event_at = self.loop.time()

    def event(self) -> None:
        self.last_event_at = self.loop.time()

    def deadline(self) -> float:
        if self.first_token_at is None:
            return min(self.first_deadline, self.total_deadline)
        return min(self.last_event_at + self.settings.stall_timeout_s, self.total_deadline)

    def which(self) -> str:
        """The deadline that passed, as EngineError.timeout names it."""
        if self.deadline() >= self.total_deadline:
            return "total"
        return "first_byte" if self.first_token_at is None else "between_events"

    def overdue(self) -> str:
        if self.deadline() >= self.total_deadline:
            return f"the stream exceeded {self.settings.total_timeout_s:g} s"
        if self.first_token_at is None:
            return f"no first token within {self.first_deadline - self.t0:.1f} s (the prefill deadline)"
        return f"the server stalled for {self.settings.stall_timeout_s:g} s mid-stream"


# ------------------------------------------------------------ stream readers
class _VLLMStream:
    """Completions chunks (vLLM): tokens as `token_id:N`, one logprobs entry per token."""

    def __init__(self, engine: RemoteEngine, request: GenerationRequest):
        self.engine, self.k = engine, request.sampling.logprobs
        self.finish, self.usage, self.last_token = None, None, None

    def tokens(self, data: dict) -> list:
        if data.get("usage"):
            self.usage = data["usage"]
        out = []
        for choice in data.get("choices") or []:
            lp = choice.get("logprobs") or {}
            tokens = lp.get("tokens") or []
            if choice.get("text") and not tokens and not choice.get("finish_reason"):
                # (in the finishing chunk: text held back for tokens already sent, e.g. an unfinished character)
                raise EngineError("engine_failure", "the server streamed text without logprobs")
            texts = _split_text(choice.get("text", ""), len(tokens))
            tops = lp.get("top_logprobs") or [None] * len(tokens)
            for j, tok in enumerate(tokens):
                top = sorted(((parse_token_key(key), float(v)) for key, v in (tops[j] or {}).items()),
                             key=lambda kv: -kv[1])[: self.k]
                self.last_token = parse_token_key(tok)
                out.append((self.last_token, texts[j], float(lp["token_logprobs"][j]), top))
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def finish_reason(self, completion: int) -> str:
        if self.finish is None:
            raise EngineError("engine_failure", "the server closed the stream without a finish reason")
        if self.usage and self.usage.get("completion_tokens") not in (None, completion):
            raise EngineError("engine_failure", f"the server reported {self.usage['completion_tokens']} completion "
                                                f"tokens but streamed {completion}")
        if self.finish == "length":
            return "length"
        if self.finish == "abort":
            raise EngineError("engine_failure", "the server aborted the request")
        if self.last_token is not None and self.last_token in self.engine.stop_ids:
            return "eos"  # OpenAI servers say "stop" for both; the last token tells them apart
        return "stop"


class _SGLangStream:
    """Native /generate chunks (SGLang): cumulative by default, incremental with
    --incremental-streaming-output; ids from `output_token_logprobs` entries `[logprob, id, text]`."""

    def __init__(self, engine: RemoteEngine, request: GenerationRequest):
        self.engine, self.k = engine, request.sampling.logprobs
        self.emitted = 0
        self.finish = None
        self.decoder = engine.tokenizer.incremental_decoder(skip_special_tokens=True) if engine.tokenizer is not None else None

    def tokens(self, data: dict) -> list:
        meta = data.get("meta_info")
        if not isinstance(meta, dict):
            raise EngineError("engine_failure", "the server's /generate chunk has no meta_info")
        entries = meta.get("output_token_logprobs")
        tops = meta.get("output_top_logprobs") or []
        total = meta.get("completion_tokens")
        if entries is None or not isinstance(total, int):
            raise EngineError("engine_failure", "the server sent no output_token_logprobs (return_logprob)")
        if len(entries) == total and total >= self.emitted:
            new, new_tops = entries[self.emitted:], tops[self.emitted:]  # cumulative chunk
        elif self.emitted + len(entries) == total:
            new, new_tops = entries, tops  # incremental chunk
        else:
            raise EngineError("engine_failure", f"the server's chunk has {len(entries)} token entries for "
                                                f"{total} completion tokens after {self.emitted}")
        out = []
        for j, entry in enumerate(new):
            logprob, token_id = _sglang_entry(entry)
            top_list = new_tops[j] if j < len(new_tops) and new_tops[j] else []
            top = sorted((_sglang_entry(t)[::-1] for t in top_list), key=lambda kv: -kv[1])[: self.k]
            text = self.decoder.push(token_id) if self.decoder is not None else ""
            out.append((token_id, text, logprob, top))
        self.emitted = total
        if meta.get("finish_reason"):
            self.finish = meta["finish_reason"]
            if self.decoder is not None and out:  # bytes of an unfinished character end as U+FFFD
                token_id, text, logprob, top = out[-1]
                out[-1] = (token_id, text + self.decoder.flush(), logprob, top)
        return out

    def finish_reason(self, completion: int) -> str:
        finish = self.finish
        if not isinstance(finish, dict) or "type" not in finish:
            raise EngineError("engine_failure", "the server closed the stream without a finish reason")
        kind = finish["type"]
        if kind == "length":
            return "length"
        if kind == "abort":
            raise EngineError("engine_failure", f"the server aborted the request: {finish.get('message')}")
        if kind == "stop":
            matched = finish.get("matched")
            if isinstance(matched, int) and not isinstance(matched, bool):
                return "eos" if matched in self.engine.stop_ids else "stop"
            return "stop"
        raise EngineError("engine_failure", f"unknown finish reason {finish!r}")


def _sglang_entry(entry) -> tuple[float, int]:
    """SGLang's `[logprob, token_id, text]` entry -> (logprob, token_id); the id field, never the text."""
    if not isinstance(entry, (list, tuple)) or len(entry) < 2:
        raise EngineError("engine_failure", f"the server sent logprob entry {entry!r}, not [logprob, token_id, text]")
    logprob, token_id = entry[0], entry[1]
    if not isinstance(token_id, int) or isinstance(token_id, bool):
        raise EngineError("engine_failure", f"the server sent token id {token_id!r}, not an integer")
    return (float("nan") if logprob is None else float(logprob)), token_id


def _sglang_prompt_logprobs(data: dict, token_ids: list[int]) -> list:
    meta = data.get("meta_info") or {}
    entries = meta.get("input_token_logprobs")
    tops = meta.get("input_top_logprobs") or []
    n = len(token_ids)
    if not isinstance(entries, list) or len(entries) < n:
        raise EngineError("engine_failure", "the server did not return input_token_logprobs for every prompt token")
    result: list = [None] * n
    for q in range(1, n):
        logprob, token_id = _sglang_entry(entries[q])
        if token_id != token_ids[q]:
            raise EngineError("engine_failure", f"the server scored token {token_id} at position {q}, "
                                                f"not {token_ids[q]}")
        table = dict(_sglang_entry(t)[::-1] for t in (tops[q] if q < len(tops) and tops[q] else []))
        result[q] = (logprob, table)
    return result


def _split_text(text: str, n: int) -> list[str]:
    """A chunk's text belongs to its tokens; with one token per chunk (the usual case) it is exact."""
    if n <= 1:
        return [text] * n
    return [text] + [""] * (n - 1)


# ----------------------------------------------------------------- building
class RemoteSetupError(ValueError):
    """The served model's files do not describe a model the adapter can front."""


def read_served_model(ckpt_dir: str | Path):
    """(vocab_size, eos_id, stop_ids, tokenizer, fingerprint) from the served model's own files."""
    from inference.model.checkpoint import CheckpointError, fingerprint  # noqa: PLC0415

    ckpt_dir = Path(ckpt_dir)
    try:
        hf_config = json.loads((ckpt_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise RemoteSetupError(f"{ckpt_dir}/config.json cannot be read: {exc}") from None
    try:
        fp = fingerprint(ckpt_dir)
    except CheckpointError:
        raise RemoteSetupError(f"{ckpt_dir} has no valid k3_manifest.json (the model fingerprint validators check); "
                               f"make it with: python -m inference manifest {ckpt_dir}") from None
    tokenizer, vocab_size, eos_id = _served_tokenizer(ckpt_dir, hf_config)
    return vocab_size, eos_id, tuple(getattr(tokenizer, "stop_ids", ())), tokenizer, fp


def served_tokenizer(ckpt_dir: str | Path):
    """The served model's tokenizer from its directory (tiktoken.model of a K3 release, or tokenizer.json)."""
    ckpt_dir = Path(ckpt_dir)
    try:
        hf_config = json.loads((ckpt_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise RemoteSetupError(f"{ckpt_dir}/config.json cannot be read: {exc}") from None
    return _served_tokenizer(ckpt_dir, hf_config)[0]


def _served_tokenizer(ckpt_dir: Path, hf_config: dict):
    from inference.model.checkpoint import read_config  # noqa: PLC0415
    from inference.model.hf_tokenizer import HF_TOKENIZER_FILE, HFByteLevelTokenizer  # noqa: PLC0415
    from inference.model.tokenizer import TokenizerError, load_tokenizer  # noqa: PLC0415

    text = hf_config.get("text_config") or hf_config
    try:
        config = read_config(ckpt_dir)  # a Kimi K3 config: its tokenizer (tiktoken.model, or the byte tokenizer)
    except Exception:  # noqa: BLE001 - CheckpointError, and TypeError/KeyError on another model's config
        config = None
    try:
        if config is not None:
            return load_tokenizer(ckpt_dir, config), config.vocab_size, config.eos_token_id
        if (ckpt_dir / HF_TOKENIZER_FILE).exists():
            tok = HFByteLevelTokenizer.from_dir(ckpt_dir, text)
            return tok, tok.vocab_size, tok.eos_id
    except (TokenizerError, Exception) as exc:  # CheckpointError, ConfigError: a file that does not parse
        raise RemoteSetupError(f"the tokenizer in {ckpt_dir} cannot be read: {exc}") from None
    raise RemoteSetupError(f"{ckpt_dir} is not a Kimi K3 config and has no {HF_TOKENIZER_FILE}")


def build_remote_engine(settings: RemoteSettings, ckpt_dir: str | Path) -> RemoteEngine:
    vocab_size, eos_id, stop_ids, tokenizer, fp = read_served_model(ckpt_dir)
    return RemoteEngine(settings, vocab_size=vocab_size, eos_id=eos_id, stop_ids=stop_ids, tokenizer=tokenizer,
                        model_fingerprint=fp)
