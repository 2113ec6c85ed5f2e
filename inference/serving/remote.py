"""An engine in front of an OpenAI-compatible server (vLLM or SGLang serving Kimi K3 on GPUs).

Generation goes through the legacy completions endpoint with the prompt as token ids,
streamed as server-sent events, with per-token logprobs. Token ids come back as
`token_id:N` strings (`return_tokens_as_token_ids`, a vLLM and SGLang extension), so the
events carry exact ids. Scoring uses either vLLM's `prompt_logprobs` extension or the
standard `echo` + `logprobs` form (SGLang and others). Everything maps onto the same
events and errors as the local engine.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp

from inference.serving.engine import (
    Engine,
    EngineCapabilities,
    EngineError,
    EngineHealth,
    FinalEvent,
    GenerationRequest,
    ScoredPosition,
    TokenEvent,
)
from inference.serving.metrics import EngineMetrics
from inference.serving.sampling import MAX_LOGPROBS


@dataclass(frozen=True)
class RemoteSettings:
    base_url: str  # e.g. http://127.0.0.1:8000 (the /v1 prefix is added here)
    model_name: str
    api_key: str | None = None
    score_mode: str = "prompt_logprobs"  # or "echo"
    max_context: int = 131072
    max_concurrent_sequences: int = 64
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 120.0  # a long prompt's prefill happens before the first byte
    between_events_timeout_s: float = 30.0
    total_timeout_s: float = 1800.0
    health_interval_s: float = 5.0


def parse_token_key(key: str) -> int:
    """`token_id:123` -> 123 (the form servers use when asked to return token ids)."""
    if isinstance(key, int):
        return key
    if key.startswith("token_id:"):
        return int(key[len("token_id:"):])
    if key.lstrip("-").isdigit():
        return int(key)
    raise EngineError("engine_failure", f"the server returned token {key!r} instead of a token id; "
                                        "it must support return_tokens_as_token_ids")


_STATUS_CODES = {400: "invalid_request", 413: "context_too_long", 429: "over_capacity", 503: "engine_unavailable"}


class RemoteEngine(Engine):
    def __init__(self, settings: RemoteSettings, *, vocab_size: int, eos_id: int | None = None,
                 model_fingerprint: str = "", stop_ids=(), metrics: EngineMetrics | None = None):
        self.settings = settings
        self.metrics = metrics or EngineMetrics(model_name=settings.model_name)  # as measured from here
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.stop_ids = frozenset(stop_ids) | ({eos_id} if eos_id is not None else set())
        self.model_fingerprint = model_fingerprint
        self._session: aiohttp.ClientSession | None = None
        self._health = EngineHealth("down", "not started")
        self._health_task: asyncio.Task | None = None

    @property
    def _url(self) -> str:
        return self.settings.base_url.rstrip("/") + "/v1"

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self.settings.api_key:
            h["Authorization"] = f"Bearer {self.settings.api_key}"
        return h

    async def start(self) -> None:
        if self._session is None:
            s = self.settings
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=max(100, s.max_concurrent_sequences + 8)),
                timeout=aiohttp.ClientTimeout(
                total=s.total_timeout_s, connect=s.connect_timeout_s, sock_read=None))
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
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._health = EngineHealth("down", "stopped")

    async def _check_health(self) -> None:
        try:
            async with self._session.get(self._url + "/models", headers=self._headers(),
                                         timeout=aiohttp.ClientTimeout(total=self.settings.connect_timeout_s)) as r:
                if r.status != 200:
                    self._health = EngineHealth("down", f"{self._url}/models answered HTTP {r.status}")
                    return
                body = await r.json()
                names = [m.get("id") for m in body.get("data", [])]
                if self.settings.model_name not in names:
                    self._health = EngineHealth("down", f"the server does not serve {self.settings.model_name!r} "
                                                        f"(it serves {names})")
                else:
                    self._health = EngineHealth("ok")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._health = EngineHealth("down", f"cannot reach {self._url}: {exc!r}")

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
            layout={"server": s.base_url}, precision="server",
        )

    # ----------------------------------------------------------------- calls
    async def _post(self, path: str, body: dict) -> aiohttp.ClientResponse:
        if self._session is None:
            raise EngineError("engine_unavailable", "the remote engine is not started")
        try:
            resp = await asyncio.wait_for(
                self._session.post(self._url + path, data=json.dumps(body), headers=self._headers()),
                timeout=self.settings.first_byte_timeout_s)
        except asyncio.TimeoutError:
            raise EngineError("engine_failure", f"the server sent no response within {self.settings.first_byte_timeout_s} s",
                              timeout="first_byte") from None
        except aiohttp.ClientError as exc:
            raise EngineError("engine_unavailable", f"cannot reach the server: {exc}", unreachable=True) from None
        if resp.status != 200:
            try:
                text = (await resp.read())[:4096].decode(errors="replace")
            finally:
                resp.release()
            try:
                payload = json.loads(text)
                err = payload.get("error", payload)
                message = err.get("message") if isinstance(err, dict) else str(err)
            except ValueError:
                message = text
            code = _STATUS_CODES.get(resp.status, "engine_failure" if resp.status >= 500 else "invalid_request")
            if code == "invalid_request" and message and "context" in message.lower():
                code = "context_too_long"
            raise EngineError(code, f"server answered HTTP {resp.status}: {message}", http_status=resp.status)
        return resp

    def generate(self, request: GenerationRequest) -> "asyncio.AsyncIterator":
        return self._generate(request)

    async def _generate(self, request: GenerationRequest):
        p = request.sampling
        problems = p.problems()
        if problems:
            raise EngineError("invalid_request", "; ".join(problems))
        if len(request.prompt_token_ids) + p.max_tokens > self.settings.max_context:
            raise EngineError("context_too_long", f"prompt plus max_tokens exceeds {self.settings.max_context}")
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
        if p.top_k:
            body["top_k"] = p.top_k
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop:
            body["stop"] = list(p.stop)
        if p.ignore_eos:
            body["ignore_eos"] = True
        t0 = time.perf_counter()
        resp = await self._post("/completions", body)
        first_at = last_at = None
        last_token = None
        index = 0
        finish_reason, usage = None, None
        self.metrics.active_sequences.inc()
        try:
            async for data in self._sse_events(resp, t0):
                if data.get("usage"):
                    usage = data["usage"]
                for choice in data.get("choices") or []:
                    lp = choice.get("logprobs") or {}
                    tokens = lp.get("tokens") or []
                    if choice.get("text") and not tokens:
                        raise EngineError("engine_failure", "the server streamed text without logprobs")
                    texts = _split_text(choice.get("text", ""), len(tokens))
                    for j, tok in enumerate(tokens):
                        top_map = (lp.get("top_logprobs") or [None] * len(tokens))[j] or {}
                        top = sorted(((parse_token_key(k), float(v)) for k, v in top_map.items()),
                                     key=lambda kv: -kv[1])[: p.logprobs]
                        now = time.perf_counter()
                        if first_at is None:
                            first_at = now
                            self.metrics.ttft_seconds.observe(now - t0)
                        else:
                            self.metrics.inter_token_seconds.observe(now - last_at)
                        last_at = now
                        self.metrics.generation_tokens.inc()
                        last_token = parse_token_key(tok)
                        yield TokenEvent(index, last_token, texts[j], float(lp["token_logprobs"][j]), top)
                        index += 1
                    if choice.get("finish_reason"):
                        finish_reason = choice["finish_reason"]
        finally:
            self.metrics.active_sequences.dec()
            resp.release()
        if finish_reason is None:
            raise EngineError("engine_failure", "the server closed the stream without a finish reason")
        end = time.perf_counter()
        completion = index
        if usage and usage.get("completion_tokens") not in (None, completion):
            raise EngineError("engine_failure",
                              f"the server reported {usage['completion_tokens']} completion tokens but streamed {completion}")
        if finish_reason == "length":
            reason = "length"
        elif last_token is not None and last_token in self.stop_ids:
            reason = "eos"  # OpenAI servers say "stop" for both; the last token tells them apart
        else:
            reason = "stop"
        self.metrics.record_finished(reason, len(request.prompt_token_ids), completion, t0, None, first_at, end)
        yield FinalEvent(
            finish_reason=reason,
            prompt_tokens=len(request.prompt_token_ids), completion_tokens=completion, queue_ms=0.0,
            ttft_ms=None if first_at is None else (first_at - t0) * 1000, total_ms=(end - t0) * 1000,
        )

    async def _sse_events(self, resp: aiohttp.ClientResponse, t0: float):
        s = self.settings
        buffer = b""
        while True:
            if time.perf_counter() - t0 > s.total_timeout_s:
                raise EngineError("engine_failure", f"the stream exceeded {s.total_timeout_s} s", timeout="total")
            try:
                chunk = await asyncio.wait_for(resp.content.readany(), timeout=s.between_events_timeout_s)
            except asyncio.TimeoutError:
                raise EngineError("engine_failure", f"the server stalled for {s.between_events_timeout_s} s mid-stream",
                                  timeout="between_events") from None
            except aiohttp.ClientError as exc:
                raise EngineError("engine_failure", f"the stream broke: {exc}") from None
            if not chunk:
                if buffer.strip():
                    raise EngineError("engine_failure", "the stream ended inside an event")
                return
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        return
                    try:
                        data = json.loads(payload)
                    except ValueError:
                        raise EngineError("engine_failure", f"malformed event from the server: {payload[:200]!r}") from None
                    if "error" in data and not data.get("choices"):
                        err = data["error"]
                        raise EngineError("engine_failure", f"server error mid-stream: {err.get('message', err)}")
                    yield data

    async def score(self, token_ids: list[int], positions: list[int] | None = None, top_k: int = 0) -> list[ScoredPosition]:
        if len(token_ids) < 2:
            raise EngineError("invalid_request", "scoring needs at least 2 tokens")
        if not 0 <= top_k <= MAX_LOGPROBS:
            raise EngineError("invalid_request", f"top_k must lie in 0..{MAX_LOGPROBS}")
        n = len(token_ids)
        wanted = sorted(set(range(1, n)) if positions is None else set(positions))
        if any(not 1 <= q < n for q in wanted):
            raise EngineError("invalid_request", f"positions must lie in 1..{n - 1}")
        k = max(1, top_k)
        body = {"model": self.settings.model_name, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0,
                "return_tokens_as_token_ids": True}
        if self.settings.score_mode == "prompt_logprobs":
            body["prompt_logprobs"] = k
        else:
            body.update(echo=True, logprobs=k)
        resp = await self._post("/completions", body)
        try:
            data = await asyncio.wait_for(resp.json(), timeout=self.settings.total_timeout_s)
        except (ValueError, aiohttp.ContentTypeError):
            raise EngineError("engine_failure", "the server's score answer is not JSON") from None
        finally:
            resp.release()
        choice = (data.get("choices") or [{}])[0]
        per_position = self._per_position(choice, token_ids)
        out = []
        for q in wanted:
            entry = per_position[q]
            if entry is None:
                raise EngineError("engine_failure", f"the server returned no logprob for position {q}")
            actual, table = entry
            top = sorted(table.items(), key=lambda kv: -kv[1])[:top_k]
            out.append(ScoredPosition(q, token_ids[q], actual, top))
        return out

    def _per_position(self, choice: dict, token_ids: list[int]) -> list:
        """Per prompt position: (logprob of the actual token, {token_id: logprob} alternatives)."""
        n = len(token_ids)
        result: list = [None] * n
        if self.settings.score_mode == "prompt_logprobs":
            plp = choice.get("prompt_logprobs")
            if not isinstance(plp, list) or len(plp) < n:
                raise EngineError("engine_failure", "the server did not return prompt_logprobs for every prompt token")
            for q in range(1, n):
                table = {parse_token_key(k): float(v["logprob"] if isinstance(v, dict) else v)
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


def _split_text(text: str, n: int) -> list[str]:
    """A chunk's text belongs to its tokens; with one token per chunk (the usual case) it is exact."""
    if n <= 1:
        return [text] * n
    return [text] + [""] * (n - 1)
