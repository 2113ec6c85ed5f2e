"""The one error-code table: every code has a status, the engine's codes are all in it, and the
servers answer with the status the table gives."""
import re

import pytest

from inference.serving import engine as engine_module, local_engine, openai_server, scheduler
from inference.serving.engine import ERROR_CODES, EngineError
from neurons.gateway import ApiError
from neurons.miner_app import Refusal, engine_refusal
from protocol.auth import AuthFailure
from protocol.client import ClientTimeouts
from protocol.errors import HTTP_STATUS, RETRY_AFTER_S, ErrorCode, http_status
from protocol.schemas import ProtocolError, error_body, parse_error_body


def test_every_code_has_a_status_and_a_wire_spelling():
    assert set(HTTP_STATUS) == set(ErrorCode)
    for code in ErrorCode:
        assert re.fullmatch(r"[a-z0-9_]{1,64}", code.value), code
        assert 400 <= HTTP_STATUS[code] <= 599
        assert str(code) == code.value
    assert set(RETRY_AFTER_S) <= set(ErrorCode)
    # a retry hint only where waiting helps
    assert all(HTTP_STATUS[c] in (429, 503) for c in RETRY_AFTER_S)


def test_every_engine_error_code_is_in_the_enum():
    for code in ERROR_CODES:
        assert ErrorCode.parse(code) is not None, f"engine code {code!r} has no entry in protocol.errors"
    # the codes the engine modules actually raise are all declared in ERROR_CODES
    raised = set()
    for module in (engine_module, local_engine, scheduler, __import__("inference.serving.remote", fromlist=["x"])):
        source = open(module.__file__).read()
        raised |= set(re.findall(r'EngineError\(\s*"([a-z_]+)"', source))
    assert raised and raised <= set(ERROR_CODES), raised - set(ERROR_CODES)


def test_the_openai_server_in_inference_agrees_with_the_table():
    for code, status in openai_server._ERROR_STATUS.items():
        assert http_status(code) == status, code


def test_engine_failure_is_a_retryable_503():
    assert http_status("engine_failure") == 503
    refusal = engine_refusal(EngineError("engine_failure", "CUDA error in /secret/path"))
    assert (refusal.status, refusal.code, refusal.retry_after_s) == (503, "engine_failure", 5.0)
    assert "/secret/path" not in refusal.message
    assert engine_refusal(EngineError("queue_full", "full")).status == 429
    assert engine_refusal(EngineError("context_too_long", "long")).retry_after_s is None
    # a code outside the table is answered as an engine failure, never echoed unchecked
    odd = engine_refusal(EngineError("Weird Code!", "x"))
    assert (odd.status, odd.code) == (503, "engine_failure")


def test_errors_take_their_status_from_the_code():
    assert ProtocolError("too_large", "big").status == 413
    assert ProtocolError("token_out_of_vocab", "x").status == 400
    assert AuthFailure(ErrorCode.WRONG_RECEIVER, "x").status == 403
    assert AuthFailure(ErrorCode.REPLAY_STORE_UNAVAILABLE, "x").status == 503
    assert Refusal(ErrorCode.NOT_REGISTERED, "x").status == 403
    assert Refusal(ErrorCode.SHUTTING_DOWN, "x").retry_after_s == 5.0
    assert Refusal("http_error", "teapot", status=418).status == 418
    assert ApiError(ErrorCode.MINER_FAILED, "x").status == 502
    assert ApiError(ErrorCode.TIMEOUT, "x").status == 504
    assert ApiError(None, "x", status=405).body()["error"]["code"] is None


def test_the_code_travels_as_its_wire_value():
    detail = parse_error_body(error_body(ErrorCode.RATE_LIMITED, "slow down"))
    assert detail.code == "rate_limited" and ErrorCode.parse(detail.code) is ErrorCode.RATE_LIMITED
    assert ErrorCode.parse("no_such_code") is None
    assert http_status("no_such_code", 502) == 502


@pytest.mark.parametrize("kind,fields", [
    ("http", {"http_status": 429}),
    ("unreachable", {"unreachable": True}),
    ("first_byte", {"timeout": "first_byte"}),
])
def test_the_benchmark_reads_the_error_fields_not_the_message(kind, fields):
    from benchmarks.endpoint import _miner_error, error_kind

    # the message says something else on purpose: only the fields count
    error = EngineError("over_capacity" if kind == "http" else "engine_failure", "HTTP 500 stalled cannot reach",
                        **fields)
    expected = {"http": "http_429", "unreachable": "unreachable", "first_byte": "timeout_first_byte"}[kind]
    assert error_kind(_miner_error(error, ClientTimeouts())) == expected


def test_the_benchmark_counts_a_local_refusal_by_its_code():
    from benchmarks.endpoint import _miner_error, error_kind
    assert error_kind(_miner_error(EngineError("context_too_long", "too long"), ClientTimeouts())) == "http_400"
    assert error_kind(_miner_error(EngineError("engine_failure", "HTTP 404"), ClientTimeouts())) == "protocol"
