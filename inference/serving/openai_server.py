"""A small OpenAI-compatible completions server over any `Engine`.

It speaks the subset vLLM and SGLang speak that `RemoteEngine` uses: `/v1/models`,
`/v1/completions` (token-id or text prompts, streaming server-sent events, `logprobs`,
`echo`, and the `prompt_logprobs` / `return_tokens_as_token_ids` / `top_k` / `seed` /
`ignore_eos` extensions) and `/health`. It lets the remote adapter, the endpoint
benchmark and operators exercise the real wire format against the reference engine.
"""
from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

from inference.decoding.sampling import SamplingParams
from inference.serving.engine import Engine, EngineError, FinalEvent, GenerationRequest, TokenEvent

_ERROR_STATUS = {"invalid_request": 400, "context_too_long": 400, "over_capacity": 429, "queue_full": 429,
                 "engine_unavailable": 503, "engine_failure": 503}  # as protocol.errors (a test checks)


def _error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _token_key(token_id: int, as_ids: bool, tokenizer) -> str:
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


class OpenAICompatibleServer:
    def __init__(self, engine: Engine, tokenizer, model_name: str, max_body_bytes: int = 8 << 20):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.app = web.Application(client_max_size=max_body_bytes)
        self.app.add_routes([
            web.get("/v1/models", self.models),
            web.post("/v1/completions", self.completions),
            web.get("/health", self.health),
        ])

    async def health(self, request: web.Request) -> web.Response:
        h = self.engine.health()
        return web.Response(status=200 if h.ok else 503, text=h.status)

    async def models(self, request: web.Request) -> web.Response:
        caps = self.engine.capabilities()
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "owned_by": "k3-subnet", "max_model_len": caps.max_context}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "the body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        if body.get("model") != self.model_name:
            return _error(404, f"model {body.get('model')!r} does not exist; this server serves {self.model_name!r}",
                          "NotFoundError")
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = prompt
        else:
            return _error(400, "prompt must be a string or a non-empty list of token ids")
        as_ids = bool(body.get("return_tokens_as_token_ids", False))
        k = body.get("logprobs")
        prompt_k = body.get("prompt_logprobs")
        echo = bool(body.get("echo", False))
        try:
            sampling = SamplingParams(
                max_tokens=int(body.get("max_tokens", 16)), temperature=float(body.get("temperature", 1.0)),
                top_p=float(body.get("top_p", 1.0)), top_k=max(0, int(body.get("top_k", 0) or 0)),
                seed=body.get("seed"), stop=tuple([body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop") or ()),
                logprobs=int(k or 0), ignore_eos=bool(body.get("ignore_eos", False)),
            )
        except (TypeError, ValueError) as exc:
            return _error(400, f"bad sampling parameter: {exc}")
        try:
            prompt_table = None
            if prompt_k is not None or (echo and k is not None):
                scored = await self.engine.score(ids, None, int(prompt_k if prompt_k is not None else k))
                prompt_table = [None] + [s for s in scored]
            stream = self.engine.generate(GenerationRequest(ids, sampling, uuid.uuid4().hex))
        except EngineError as exc:
            return _error(_ERROR_STATUS.get(exc.code, 400), exc.message)
        rid = "cmpl-" + uuid.uuid4().hex[:24]
        created = int(time.time())

        def logprobs_block(tokens):
            if k is None:
                return None
            return {
                "tokens": [_token_key(t.token_id, as_ids, self.tokenizer) for t in tokens],
                "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{_token_key(i, as_ids, self.tokenizer): v for i, v in t.top_logprobs}
                                 or {_token_key(t.token_id, as_ids, self.tokenizer): t.logprob} for t in tokens],
                "text_offset": [0] * len(tokens),
            }

        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            try:
                first = await stream.__anext__()
            except EngineError as exc:
                return _error(_ERROR_STATUS.get(exc.code, 400), exc.message)
            await resp.prepare(request)
            ev = first
            try:
                while True:
                    if isinstance(ev, TokenEvent):
                        chunk = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                                 "choices": [{"index": 0, "text": ev.text, "logprobs": logprobs_block([ev]),
                                              "finish_reason": None}]}
                        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    elif isinstance(ev, FinalEvent):
                        reason = "length" if ev.finish_reason == "length" else "stop"
                        chunk = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                                 "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": reason}]}
                        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                        if (body.get("stream_options") or {}).get("include_usage"):
                            usage = {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                                     "total_tokens": ev.prompt_tokens + ev.completion_tokens}
                            await resp.write(b"data: " + json.dumps(
                                {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                                 "choices": [], "usage": usage}).encode() + b"\n\n")
                        await resp.write(b"data: [DONE]\n\n")
                        break
                    ev = await stream.__anext__()
            except EngineError as exc:
                await resp.write(b"data: " + json.dumps({"error": {"message": exc.message, "code": 500}}).encode() + b"\n\n")
            finally:
                await stream.aclose()
            return resp

        tokens, final = [], None
        try:
            async for ev in stream:
                if isinstance(ev, TokenEvent):
                    tokens.append(ev)
                else:
                    final = ev
        except EngineError as exc:
            return _error(_ERROR_STATUS.get(exc.code, 500), exc.message)
        choice = {"index": 0, "text": "".join(t.text for t in tokens), "logprobs": logprobs_block(tokens),
                  "finish_reason": "length" if final.finish_reason == "length" else "stop"}
        if prompt_table is not None:
            if prompt_k is not None:
                choice["prompt_logprobs"] = [None] + [
                    {str(s.token_id): {"logprob": s.logprob}, **{str(i): {"logprob": v} for i, v in s.top}}
                    for s in prompt_table[1:]]
            else:
                echo_tokens = [_token_key(t, as_ids, self.tokenizer) for t in ids]
                lp = logprobs_block(tokens) or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                choice["logprobs"] = {
                    "tokens": echo_tokens + lp["tokens"],
                    "token_logprobs": [None] + [s.logprob for s in prompt_table[1:]] + lp["token_logprobs"],
                    "top_logprobs": [None] + [{_token_key(i, as_ids, self.tokenizer): v for i, v in s.top}
                                              for s in prompt_table[1:]] + lp["top_logprobs"],
                    "text_offset": [0] * (len(ids) + len(lp["tokens"])),
                }
        return web.json_response({
            "id": rid, "object": "text_completion", "created": created, "model": self.model_name, "choices": [choice],
            "usage": {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
                      "total_tokens": final.prompt_tokens + final.completion_tokens}})
