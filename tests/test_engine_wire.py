"""The engine<->wire adapter (neurons/base/engine_wire.py): engine events survive the trip to the wire and back
through their JSON, the one NaN/inf policy for logprobs, and the sampling each side hands the engine."""
import math

import pytest
from bittensor.sp_core import Keypair

from inference.serving import EngineError, FinalEvent, SamplingParams, ScoredPosition, TokenEvent
from neurons.base.engine_wire import (final_message, sampling_params, scored_position_message, stage_sampling_params,
                                      token_message, unsigned_final_message, wire_logprob, wire_sampling)
from protocol.schemas import (LOGPROB_FLOOR, MAX_TOKEN_TEXT, FinalMessage, GenerateRequest, ScoredPositionMessage,
                              Timings, TokenMessage, decode_event, encode_event, encode_model)
from protocol.signature import sign_response, verify_response
from protocol.stage import WireSampling


def test_a_token_event_goes_to_the_wire_and_back_unchanged():
    event = TokenEvent(index=4, token_id=65, text="A", logprob=-0.25,
                       top_logprobs=[(65, -0.25), (66, -1.5), (67, -float("inf"))])
    message = token_message(event)
    line = encode_event(message)
    again = decode_event(line)
    assert isinstance(again, TokenMessage) and again == message and encode_event(again) == line
    assert (again.index, again.token_ids, again.text, again.logprobs) == (4, [65], "A", [-0.25])
    assert [(t.token_id, t.logprob) for t in again.top_logprobs[0]] == [(65, -0.25), (66, -1.5), (67, LOGPROB_FLOOR)]


def test_one_logprob_policy_nan_fails_infinities_are_clamped():
    assert wire_logprob(-float("inf")) == LOGPROB_FLOOR and wire_logprob(-2e6) == LOGPROB_FLOOR
    assert wire_logprob(float("inf")) == 0.0 and wire_logprob(1e-7) == 0.0 and wire_logprob(-0.5) == -0.5
    with pytest.raises(EngineError) as caught:
        token_message(TokenEvent(index=0, token_id=1, text="x", logprob=math.nan))
    assert caught.value.code == "engine_failure"
    with pytest.raises(EngineError):
        scored_position_message(ScoredPosition(position=1, token_id=2, logprob=-1.0, top=[(2, math.nan)]))


def test_text_longer_than_an_event_may_carry_is_cut():
    message = token_message(TokenEvent(index=0, token_id=1, text="x" * (MAX_TOKEN_TEXT + 10), logprob=-1.0))
    assert len(message.text) == MAX_TOKEN_TEXT


def test_a_final_event_signed_and_unsigned_round_trips():
    key = Keypair.create_from_uri("//engine-wire")
    event = FinalEvent(finish_reason="length", prompt_tokens=12, completion_tokens=3, queue_ms=0.5, ttft_ms=4.0,
                       total_ms=9.0)
    timings = Timings(queue_ms=0.5, ttft_ms=4.0, total_ms=9.0)
    body, tokens = b'{"request": 1}', [5, 6, 7]
    signed = final_message(event, timings=timings, model_fingerprint="fp-1", signature=sign_response(key, body, tokens))
    again = decode_event(encode_event(signed))
    assert isinstance(again, FinalMessage) and again == signed
    assert (again.finish_reason, again.usage.prompt_tokens, again.usage.completion_tokens) == ("length", 12, 3)
    assert verify_response(again.signature, body, tokens, key.ss58_address)
    unsigned = unsigned_final_message(event, timings=timings, model_fingerprint="undeclared", finish_reason="eos")
    assert unsigned.finish_reason == "eos" and unsigned.signature.signature == ""
    assert encode_event(unsigned) == encode_event(signed).replace(b'"length"', b'"eos"').replace(
        b'"fp-1"', b'"undeclared"').replace(encode_model(signed.signature), encode_model(unsigned.signature))


def test_a_scored_position_round_trips():
    scored = ScoredPosition(position=7, token_id=9, logprob=-0.75, top=[(3, -0.5), (9, -0.75)])
    message = scored_position_message(scored)
    again = ScoredPositionMessage.model_validate_json(encode_model(message))
    assert again == message and (again.position, again.token_id, again.logprob) == (7, 9, -0.75)
    assert [(t.token_id, t.logprob) for t in again.top] == [(3, -0.5), (9, -0.75)]


def test_sampling_from_a_generate_request_and_over_the_stage_wire():
    request = GenerateRequest(request_id="r", prompt_token_ids=[1, 2], max_tokens=7, temperature=0.7, top_p=0.9,
                              top_k=40, seed=11, stop=["\n\n"], logprobs=5)
    assert sampling_params(request) == SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=40, seed=11,
                                                      stop=("\n\n",), logprobs=5)
    assert sampling_params(request, ignore_eos=True).ignore_eos
    route = SamplingParams(temperature=0.5, top_p=0.8, top_k=3, logprobs=2)
    wire = WireSampling.model_validate_json(wire_sampling(route).model_dump_json())
    assert stage_sampling_params(wire) == route
