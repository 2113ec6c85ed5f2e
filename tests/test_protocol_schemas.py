"""Wire schemas: every bound, strictness, extra fields, model checks, event round trips."""
import json

import pytest
from hypothesis import given, settings, strategies as st
from pydantic import ValidationError

from protocol.schemas import (DEFAULT_LIMITS, Capabilities, ErrorBody, ErrorEvent, FinalMessage, GenerateRequest,
                              Health, Limits, ProtocolError, ResponseSignature, ScoreResponse, Timings, TokenMessage,
                              TopLogprob, Usage, decode_event, encode_event, encode_model, error_body, parse_error_body,
                              parse_generate, parse_score)

SIGNATURE = ResponseSignature(
    hotkey="5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY",
    request_sha256="ab" * 32,
    tokens_sha256="cd" * 32,
    signature="ef" * 64,
)


def generate_body(**overrides) -> bytes:
    fields = {"request_id": "r-1", "prompt": "Hello", "max_tokens": 16}
    fields.update(overrides)
    return json.dumps({k: v for k, v in fields.items() if v is not _DROP}).encode()


def score_body(**overrides) -> bytes:
    fields = {"request_id": "s-1", "token_ids": [5, 6, 7, 8]}
    fields.update(overrides)
    return json.dumps({k: v for k, v in fields.items() if v is not _DROP}).encode()


_DROP = object()


def refused(parse, raw, limits=DEFAULT_LIMITS) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        parse(raw, limits)
    return caught.value


# ---------------------------------------------------------------- generate
def test_valid_generate_requests_parse_and_encode_back():
    request = parse_generate(generate_body(temperature=0, top_p=0.9, top_k=40, seed=2**64 - 1,
                                           stop=["\n\n"], logprobs=20))
    assert request.temperature == 0.0 and request.seed == 2**64 - 1 and request.logprobs == 20
    assert parse_generate(encode_model(request)) == request
    by_ids = parse_generate(generate_body(prompt=_DROP, prompt_token_ids=[0, 1, 2]))
    assert by_ids.prompt is None and by_ids.prompt_token_ids == [0, 1, 2]


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.01),
        ("temperature", 2.01),
        ("top_p", 0),
        ("top_p", 1.01),
        ("top_k", -1),
        ("max_tokens", 0),
        ("seed", -1),
        ("seed", 2**64),
        ("logprobs", 21),
        ("logprobs", -1),
        ("stop", ["s"] * 9),
        ("stop", ["x" * 65]),
        ("stop", [""]),
        ("prompt", ""),
        ("request_id", ""),
        ("request_id", "x" * 129),
        ("request_id", "has space"),
        ("protocol_version", 2),
        # strict types: no coercion from strings, floats or booleans
        ("max_tokens", "16"),
        ("max_tokens", 16.0),
        ("temperature", "0.5"),
        ("logprobs", True),
        ("stop", "single string"),
        ("add_special_tokens", 1),
    ],
)
def test_each_generate_bound_is_rejected_naming_the_field(field, value):
    error = refused(parse_generate, generate_body(**{field: value}))
    assert error.status == 400
    assert error.message.startswith(field), error.message


@pytest.mark.parametrize("ids, expected", [
    ([1, -1, 2], "prompt_token_ids: token id at index 1 is -1, outside 0..4294967295"),
    ([1, 2, 2**32], "prompt_token_ids: token id at index 2 is 4294967296, outside 0..4294967295"),
    ([1, 1.0], "prompt_token_ids.1: Input should be a valid integer"),
    ([1, "2"], "prompt_token_ids.1: Input should be a valid integer"),
])
def test_prompt_token_ids_must_be_non_negative_u32_integers(ids, expected):
    error = refused(parse_generate, generate_body(prompt=_DROP, prompt_token_ids=ids))
    assert (error.status, error.message) == (400, expected)


@pytest.mark.parametrize("bad", [-1, "x"])
def test_a_million_bad_token_ids_give_one_short_error(bad):
    raw = generate_body(prompt=_DROP, prompt_token_ids=[bad] * 1_000_000)
    error = refused(parse_generate, raw)
    assert error.message.count("prompt_token_ids") == 1 and len(error.message) < 200


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_non_finite_temperature_is_rejected(literal):
    raw = b'{"request_id": "r", "prompt": "x", "max_tokens": 1, "temperature": ' + literal + b"}"
    error = refused(parse_generate, raw)
    assert error.message == "temperature: Input should be a finite number"


def test_exactly_one_of_prompt_and_prompt_token_ids():
    both = refused(parse_generate, generate_body(prompt_token_ids=[1, 2]))
    neither = refused(parse_generate, generate_body(prompt=_DROP))
    for error in (both, neither):
        assert error.status == 400 and "exactly one of prompt" in error.message
    with pytest.raises(ValidationError):
        GenerateRequest(request_id="r", prompt_token_ids=[1], max_tokens=1, add_special_tokens=True)


def test_extra_fields_are_rejected_by_name():
    error = refused(parse_generate, generate_body(stream=True))
    assert error.status == 400 and error.message.startswith("stream") and "Extra inputs" in error.message


def test_size_limits_answer_413_and_are_configurable():
    small = Limits(max_prompt_chars=10, max_prompt_tokens=4, max_tokens=8, max_body_bytes=2048)
    for raw, field in [
        (generate_body(prompt="x" * 11), "prompt"),
        (generate_body(prompt=_DROP, prompt_token_ids=[1] * 5), "prompt_token_ids"),
        (generate_body(max_tokens=9), "max_tokens"),
    ]:
        error = refused(parse_generate, raw, small)
        assert (error.status, error.code) == (413, "too_large") and error.message.startswith(field)
        parse_generate(raw)  # the default limits accept the same body
    too_big = refused(parse_generate, generate_body(prompt="x" * 3000), small)
    assert (too_big.status, too_big.code) == (413, "too_large") and "body" in too_big.message
    assert parse_generate(generate_body(max_tokens=8), small).max_tokens == 8


def test_configurable_stop_and_logprob_limits():
    limits = Limits(max_stop_strings=1, max_stop_chars=3, max_logprobs=5)
    assert refused(parse_generate, generate_body(stop=["a", "b"]), limits).message.startswith("stop")
    assert refused(parse_generate, generate_body(stop=["abcd"]), limits).message.startswith("stop")
    assert refused(parse_generate, generate_body(logprobs=6), limits).message.startswith("logprobs")
    assert parse_generate(generate_body(stop=["abc"], logprobs=5), limits).logprobs == 5


def test_malformed_json_and_non_objects():
    assert refused(parse_generate, b'{"request_id": ').code == "invalid_json"
    assert refused(parse_generate, b"[1, 2]").status == 400
    assert refused(parse_generate, b"").status == 400


def test_error_messages_never_echo_the_input():
    error = refused(parse_generate, generate_body(max_tokens="SECRET-VALUE-123"))
    assert "SECRET-VALUE-123" not in error.message and "Traceback" not in error.message


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200) | st.dictionaries(st.sampled_from(
    ["request_id", "prompt", "prompt_token_ids", "max_tokens", "temperature", "stop", "x"]),
    st.none() | st.integers() | st.floats() | st.text(max_size=5) | st.lists(st.integers(), max_size=3),
).map(lambda d: json.dumps(d).encode()))
def test_any_bytes_either_parse_or_raise_protocol_error(raw):
    try:
        parse_generate(raw)
    except ProtocolError as error:
        assert error.status in (400, 413) and error.message


def test_generate_check_against_model():
    request = parse_generate(generate_body(prompt=_DROP, prompt_token_ids=[0, 99], max_tokens=8))
    request.check_against(vocab_size=100, max_context=10)  # 2 + 8 == 10 fits exactly
    with pytest.raises(ProtocolError) as caught:
        request.check_against(vocab_size=99, max_context=10)
    assert caught.value.code == "token_out_of_vocab" and "prompt_token_ids[1] = 99" in caught.value.message
    with pytest.raises(ProtocolError) as caught:
        request.check_against(vocab_size=100, max_context=9)
    assert caught.value.code == "context_exceeded" and caught.value.status == 400
    text = parse_generate(generate_body(top_k=101))
    with pytest.raises(ProtocolError, match="top_k"):
        text.check_against(vocab_size=100, max_context=1000)
    with pytest.raises(ProtocolError, match="context"):
        parse_generate(generate_body(max_tokens=8)).check_context(prompt_tokens=3, max_context=10)


# ---------------------------------------------------------------- score
def test_score_request_positions():
    assert parse_score(score_body()).resolved_positions() == [1, 2, 3]
    assert parse_score(score_body(positions=[1, 3], top_k=20)).resolved_positions() == [1, 3]
    for positions in ([0], [4], [2, 2], [3, 1], []):
        error = refused(parse_score, score_body(positions=positions))
        assert error.status == 400 and error.message.startswith("positions"), (positions, error.message)


@pytest.mark.parametrize("field, value", [("token_ids", [1]), ("token_ids", [1, -2]), ("top_k", 21),
                                          ("top_k", -1), ("request_id", "a/b"), ("logprobs", 2)])
def test_score_bounds_are_rejected_naming_the_field(field, value):
    error = refused(parse_score, score_body(**{field: value}))
    assert error.status == 400 and error.message.startswith(field), error.message


def test_score_size_limits_answer_413():
    limits = Limits(max_score_tokens=4, max_score_positions=2)
    assert refused(parse_score, score_body(token_ids=[1] * 5), limits).status == 413
    # omitted positions mean every position: 3 here, above 2
    assert refused(parse_score, score_body(), limits).status == 413
    assert parse_score(score_body(positions=[1, 2]), limits).positions == [1, 2]


def test_score_check_against_model():
    request = parse_score(score_body(token_ids=[1, 2, 3]))
    request.check_against(vocab_size=4, max_context=3)
    with pytest.raises(ProtocolError, match="token_ids\\[2\\] = 3"):
        request.check_against(vocab_size=3, max_context=3)
    with pytest.raises(ProtocolError) as caught:
        request.check_against(vocab_size=4, max_context=2)
    assert caught.value.code == "context_exceeded"


# ---------------------------------------------------------------- events and answers
def final_event(**overrides) -> FinalMessage:
    fields = dict(
        finish_reason="length",
        usage=Usage(prompt_tokens=5, completion_tokens=2),
        timings=Timings(queue_ms=1.5, ttft_ms=20.0, total_ms=40.0, decode_tokens_per_s=50.0),
        model_fingerprint="k3-tiny:abc123",
        signature=SIGNATURE,
    )
    fields.update(overrides)
    return FinalMessage(**fields)


def test_events_round_trip_through_ndjson():
    events = [
        TokenMessage(index=0, token_ids=[17], text="Hi", logprobs=[-0.25],
                   top_logprobs=[[TopLogprob(token_id=17, logprob=-0.25), TopLogprob(token_id=3, logprob=-2.0)]]),
        TokenMessage(index=1, token_ids=[4, 9], text=" there", logprobs=[-1.0, 0.0], top_logprobs=[[], []]),
        final_event(),
        ErrorEvent(code="engine_failed", message="out of memory"),
    ]
    stream = b"".join(encode_event(event) for event in events)
    assert stream.count(b"\n") == len(events)
    decoded = [decode_event(line) for line in stream.splitlines()]
    assert decoded == events
    assert decode_event(encode_event(final_event(seed=2**64 - 1))).seed == 2**64 - 1
    assert [type(event) for event in decoded] == [TokenMessage, TokenMessage, FinalMessage, ErrorEvent]


@pytest.mark.parametrize(
    "line",
    [
        b'{"type": "tokens", "index": 0}',
        b'{"type": "token", "index": 0, "token_ids": [1], "text": "a", "logprobs": [-1.0], "top_logprobs": []}',
        b'{"type": "token", "index": 0, "token_ids": [1], "text": "a", "logprobs": [0.5], "top_logprobs": [[]]}',
        b'{"type": "token", "index": 0, "token_ids": [], "text": "", "logprobs": [], "top_logprobs": []}',
        b'{"type": "token", "index": 0, "token_ids": [1], "text": "a", "logprobs": [-1.0], "top_logprobs": [[]], "x": 1}',
        b'{"type": "error", "code": "Bad Code", "message": "m"}',
    ],
)
def test_malformed_events_are_rejected(line):
    with pytest.raises(ValidationError):
        decode_event(line)


def test_final_event_bounds():
    raw = json.loads(final_event().model_dump_json())
    for path, value in [(("finish_reason",), "cancelled"), (("usage", "extra"), 1),
                        (("usage", "completion_tokens"), -1), (("timings", "ttft_ms"), -5),
                        (("signature", "signature"), "zz" * 64), (("signature", "hotkey"), "0xnot-ss58"),
                        (("seed",), -1), (("seed",), 2**64), (("seed",), "7")]:
        mutated = json.loads(json.dumps(raw))
        target = mutated
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        with pytest.raises(ValidationError) as caught:
            decode_event(json.dumps(mutated).encode())
        assert path[-1] in str(caught.value)


def test_answers_round_trip_and_error_body():
    capabilities = Capabilities(
        model_id="kimi-k3-tiny", model_fingerprint="fp-1", vocab_size=1000, max_context=4096,
        max_concurrent_streams=8, engine="sharded", layout={"shards": 2, "plan": [[0, 1], [2, 3]]},
        precision="bf16+mxfp4", sampler="k3-gumbel/1", software_version="0.1.0", limits=Limits(max_tokens=1024),
    )
    assert Capabilities.model_validate_json(encode_model(capabilities)) == capabilities
    with pytest.raises(ValidationError):
        Capabilities.model_validate_json(encode_model(capabilities).replace(b'"sharded"', b'"gpu"'))
    with pytest.raises(ValidationError):  # a sampler the protocol does not name
        Capabilities.model_validate_json(encode_model(capabilities).replace(b'"k3-gumbel/1"', b'"k3-gumbel/2"'))
    undeclared = json.loads(encode_model(capabilities))
    del undeclared["sampler"]  # a miner that declares none runs its own sampler: not replayed
    assert Capabilities.model_validate(undeclared).sampler == "engine"
    score = ScoreResponse(request_id="s-1", model_fingerprint="fp-1", scores=[])
    assert ScoreResponse.model_validate_json(encode_model(score)) == score
    health = Health(status="degraded", detail="one shard restarting")
    assert Health.model_validate_json(encode_model(health)) == health
    body = error_body("over_capacity", "all 8 streams busy")
    assert json.loads(body) == {"error": {"code": "over_capacity", "message": "all 8 streams busy"}}
    assert parse_error_body(body) == ErrorBody.model_validate_json(body).error
    assert parse_error_body(b"<html>502</html>") is None


def test_protocol_imports_no_engine_chain_scoring_or_neurons():
    import subprocess
    import sys

    code = (
        "import sys, protocol, protocol.client, protocol.auth, protocol.signature\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'inference', 'chain', 'scoring', 'neurons'})\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
