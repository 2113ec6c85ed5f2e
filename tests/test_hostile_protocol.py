"""Protocol-level strictness from issue 12: the sampling bounds agree everywhere, duplicate JSON keys and
out-of-bounds sampling are 400s naming the field, btauth headers are refused on their own when duplicated,
non-text or malformed."""
import json
import time

import pytest
from multidict import CIMultiDict

from inference.decoding import sampling
from neurons.gateway import schemas as gateway_schemas
from protocol import schemas
from protocol.auth import AuthFailure, check_auth_headers, sign_request
from protocol.errors import ErrorCode


def test_the_sampling_bounds_are_the_same_in_the_engine_the_wire_and_the_gateway():
    assert sampling.MIN_TEMPERATURE == schemas.TEMPERATURE_MIN
    assert sampling.MAX_TEMPERATURE == schemas.TEMPERATURE_MAX
    assert sampling.MIN_TOP_P == schemas.TOP_P_MIN
    assert gateway_schemas.TEMPERATURE_MIN is schemas.TEMPERATURE_MIN


def body(**fields):
    values = {"request_id": "r1", "prompt_token_ids": [1, 2], "max_tokens": 2}
    values.update(fields)
    return json.dumps(values).encode()


@pytest.mark.parametrize("field, value", [("temperature", 1e-39), ("temperature", 5e-324), ("temperature", 9.9e-4),
                                          ("top_p", 5e-324), ("top_p", 0.0), ("top_p", 9e-7)])
def test_out_of_bounds_sampling_is_a_400_naming_the_field(field, value):
    with pytest.raises(schemas.ProtocolError) as caught:
        schemas.parse_generate(body(**{field: value}))
    assert caught.value.status == 400 and field in caught.value.message
    with pytest.raises(gateway_schemas.ApiError) as caught:
        gateway_schemas.parse_body(gateway_schemas.ChatCompletionBody, json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}).encode())
    assert caught.value.status == 400 and caught.value.param == field


def test_the_edges_themselves_are_admitted():
    parsed = schemas.parse_generate(body(temperature=1e-3, top_p=1e-6))
    assert parsed.temperature == 1e-3 and parsed.top_p == 1e-6
    assert schemas.parse_generate(body(temperature=0.0)).temperature == 0.0


def test_duplicate_json_keys_are_a_400():
    raw = b'{"request_id": "r1", "prompt_token_ids": [1], "max_tokens": -5, "max_tokens": 2}'
    with pytest.raises(schemas.ProtocolError) as caught:
        schemas.parse_generate(raw)
    assert caught.value.status == 400 and "max_tokens" in caught.value.message
    nested = b'{"model": "m", "messages": [{"role": "user", "role": "system", "content": "x"}]}'
    with pytest.raises(gateway_schemas.ApiError) as caught:
        gateway_schemas.parse_body(gateway_schemas.ChatCompletionBody, nested)
    assert caught.value.status == 400


@pytest.fixture(scope="module")
def keys(tmp_path_factory, make_wallets):
    wallets = make_wallets(tmp_path_factory.mktemp("hostile_keys"), ("caller", "server"))
    return wallets["caller"].hotkey, wallets["server"].hotkey


def test_auth_headers_are_judged_on_their_own(keys):
    caller, server = keys
    headers = sign_request(caller, "POST", "/v1/generate", b"{}", server.ss58_address)
    assert check_auth_headers(CIMultiDict(headers), server.ss58_address) == caller.ss58_address

    def refused(h) -> AuthFailure:
        with pytest.raises(AuthFailure) as caught:
            check_auth_headers(h, server.ss58_address)
        return caught.value

    twice = CIMultiDict(headers)
    twice.add("X-Bittensor-Hotkey", server.ss58_address)
    assert (refused(twice).status, refused(twice).code) == (401, ErrorCode.MALFORMED_AUTH)
    non_text = CIMultiDict(headers)
    non_text["X-Bittensor-Hotkey"] = caller.ss58_address + "\udcff"  # aiohttp's surrogate for a 0xff byte
    assert refused(non_text).status == 401
    stale = CIMultiDict(headers)
    stale["X-Bittensor-Nonce"] = str(time.time_ns() - 60 * 10**9)
    assert refused(stale).code == ErrorCode.STALE_REQUEST
    other = sign_request(caller, "POST", "/v1/generate", b"{}", caller.ss58_address)
    assert refused(CIMultiDict(other)).status == 403
    short = CIMultiDict(headers)
    short["X-Bittensor-Signature"] = "0xabcd"
    assert refused(short).code == ErrorCode.MALFORMED_AUTH
