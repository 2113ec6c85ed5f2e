"""The one adapter between the engine (inference.serving) and the wire (protocol): engine events to wire
messages, wire sampling to the engine's SamplingParams. The miner, the stage server and the endpoint benchmark
all convert through here, so a generation reads the same on the wire whoever sent it.

    token_message(TokenEvent) -> TokenMessage                  final_message(FinalEvent, ...) -> FinalMessage
    opening_asks(StateOpeningRequest) -> [StateAsk]             opening_message(request_id, Opening, hidden) -> StateOpening
    scored_position_message(ScoredPosition) -> ScoredPositionMessage
    sampling_params(GenerateRequest) -> SamplingParams
    stage_sampling_params(WireSampling) -> SamplingParams       wire_sampling(SamplingParams) -> WireSampling
"""
from __future__ import annotations

import base64
import math
from typing import Optional

from inference.serving import EngineError, FinalEvent, SamplingParams, ScoredPosition, TokenEvent
from inference.serving.state_commitment import Opening, StateAsk, StateCommitment, leaf_bytes
from protocol.schemas import (LOGPROB_FLOOR, MAX_TOKEN_TEXT, FinalMessage, GenerateRequest, OpenedBoundary,
                              ResponseSignature, ScoredPositionMessage, StateCommitmentMessage, StateOpening,
                              StateOpeningRequest, Timings, TokenMessage, TopLogprob, Usage)
from protocol.stage import WireSampling


def wire_logprob(value: float) -> float:
    """An engine logprob as the wire carries it."""
    value = float(value)
    # NaN is an engine failure (EngineError); -inf (probability 0) goes as the protocol's floor; above 0 (+inf) as 0.
    if math.isnan(value):
        raise EngineError("engine_failure", "the engine produced a NaN logprob")
    return min(max(value, LOGPROB_FLOOR), 0.0)


def token_message(event: TokenEvent) -> TokenMessage:
    """One engine token as a wire token event (text cut to what one event may carry)."""
    # Validating one plain dict is cheaper than building the nested models one by one.
    return TokenMessage.model_validate({
        "index": int(event.index),
        "token_ids": [int(event.token_id)],
        "text": str(event.text)[:MAX_TOKEN_TEXT],
        "logprobs": [wire_logprob(event.logprob)],
        "top_logprobs": [[{"token_id": int(t), "logprob": wire_logprob(lp)} for t, lp in event.top_logprobs]],
    })


def _final_fields(event: FinalEvent, finish_reason: Optional[str], timings: Timings, model_fingerprint: str) -> dict:
    return dict(finish_reason=finish_reason or event.finish_reason,
                usage=Usage(prompt_tokens=int(event.prompt_tokens), completion_tokens=int(event.completion_tokens)),
                timings=timings, model_fingerprint=model_fingerprint)


def final_message(event: FinalEvent, *, timings: Timings, model_fingerprint: str, signature: ResponseSignature,
                  finish_reason: Optional[str] = None) -> FinalMessage:
    """The engine's final event as the wire's, with the sender's timings (its own clock), the model it declares,
    the seed the engine sampled with, its state commitment (engines that commit) and its signature over the
    request, the tokens, the commitment's root and that seed (protocol.signature.sign_response(..., event.seed,
    state_root=...)); `finish_reason` overrides the engine's."""
    return FinalMessage(**_final_fields(event, finish_reason, timings, model_fingerprint), signature=signature,
                        seed=event.seed, state_commitment=state_commitment_message(event.state_commitment))


def state_commitment_message(commitment: Optional[StateCommitment]) -> Optional[StateCommitmentMessage]:
    """An engine's state commitment as the final event carries it (None: the engine commits to nothing)."""
    if commitment is None:
        return None
    return StateCommitmentMessage(scheme=commitment.scheme, root=commitment.root, positions=commitment.positions,
                                  boundaries=list(commitment.boundaries))


def opening_asks(request: StateOpeningRequest) -> list[StateAsk]:
    return [StateAsk(b.boundary, tuple(b.positions)) for b in request.open]


def opening_message(request_id: str, opening: Opening, hidden_size: int) -> StateOpening:
    """An engine's opening of committed states as the wire carries it (rows as base64 of fp32 little-endian)."""
    order = sorted(opening.boundary_roots)
    return StateOpening(
        request_id=request_id, root=opening.root, positions=opening.positions, hidden_size=hidden_size,
        boundaries=order, boundary_roots=[opening.boundary_roots[b].hex() for b in order],
        opened=[OpenedBoundary(boundary=o.boundary, positions=list(o.positions),
                               rows=base64.b64encode(leaf_bytes(o.rows)).decode(), proof=[h.hex() for h in o.proof])
                for o in opening.opened])


def unsigned_final_message(event: FinalEvent, *, timings: Timings, model_fingerprint: str,
                           finish_reason: Optional[str] = None) -> FinalMessage:
    """A final event for a stream nobody signs (an OpenAI-compatible server under the benchmark): built without
    validation around an empty signature, so that tier 0 reports the signature check as not applicable."""
    empty = ResponseSignature.model_construct(hotkey="", request_sha256="", tokens_sha256="", signature="")
    return FinalMessage.model_construct(type="final", **_final_fields(event, finish_reason, timings, model_fingerprint),
                                        signature=empty)


def scored_position_message(scored: ScoredPosition) -> ScoredPositionMessage:
    """One teacher-forced position (/v1/score) as the wire carries it."""
    return ScoredPositionMessage(position=int(scored.position), token_id=int(scored.token_id),
                                 logprob=wire_logprob(scored.logprob),
                                 top=[TopLogprob(token_id=int(t), logprob=wire_logprob(lp)) for t, lp in scored.top])


def sampling_params(request: GenerateRequest, *, ignore_eos: bool = False) -> SamplingParams:
    """A generate request's sampling as the engine takes it (`ignore_eos`: the benchmark's fixed-length runs)."""
    return SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
                          top_k=request.top_k, seed=request.seed, stop=tuple(request.stop), logprobs=request.logprobs,
                          ignore_eos=ignore_eos)


def stage_sampling_params(sampling: WireSampling) -> SamplingParams:
    """A stage session's sampling (the last stage samples; the route driver bounds the length and the stops)."""
    return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          logprobs=sampling.logprobs)


def wire_sampling(params: SamplingParams) -> WireSampling:
    """A route's sampling as the stage wire carries it to each stage (what `stage_sampling_params` reads)."""
    return WireSampling(temperature=float(params.temperature), top_p=float(params.top_p), top_k=int(params.top_k),
                        logprobs=int(params.logprobs))


__all__ = ["wire_logprob", "token_message", "final_message", "unsigned_final_message", "scored_position_message",
           "sampling_params", "stage_sampling_params", "wire_sampling", "state_commitment_message",
           "opening_asks", "opening_message"]
