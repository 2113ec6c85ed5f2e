"""The prefill rate of the first-token deadline as a validator and gateway setting: the flag (and its
variable) reaches protocol.client.ClientTimeouts, and through it the deadline a real MinerClient holds a
real loopback miner to (test_protocol_client's miner, which prefills at a chosen rate)."""
import math
import time

import pytest
from test_protocol_client import SLACK_S, keys, miner  # noqa: F401 (fixtures)

from neurons.validator_app.settings import read_validator_settings
from protocol.client import MinerClient, MinerTimeout
from protocol.schemas import GenerateRequest

PROMPT = list(range(1, 1601))  # 1600 tokens: 0.64 s at the miner's 2500 tokens/s


def validator_settings(*flags, environ=None):
    return read_validator_settings(["--netuid", "1", "--first-byte-timeout-s", "0.3",
                                    "--gateway-first-token-timeout-s", "0.3", *flags], environ=environ or {})


def prefill_at_2500() -> GenerateRequest:
    return GenerateRequest(request_id="prefill-at-2500", prompt_token_ids=PROMPT, max_tokens=2, logprobs=2)


def test_the_flags_and_variables_set_the_rate():
    s = validator_settings("--prefill-tokens-per-s", "2000", "--gateway-prefill-tokens-per-s", "inf")
    assert s.timeouts.prefill_tokens_per_s == 2000 and s.timeouts.first_event_s(1600) == pytest.approx(1.1)
    assert s.gateway.miner_timeouts.prefill_tokens_per_s == math.inf
    assert s.gateway.miner_timeouts.first_event_s(1600) == pytest.approx(0.3)  # flat: the floor only
    s = validator_settings(environ={"K3_VALIDATOR_PREFILL_TOKENS_PER_S": "500", "K3_GATEWAY_PREFILL_TOKENS_PER_S": "250"})
    assert (s.timeouts.prefill_tokens_per_s, s.gateway.miner_timeouts.prefill_tokens_per_s) == (500, 250)
    assert validator_settings().timeouts.prefill_tokens_per_s == 1000  # ClientTimeouts' default
    for bad in ("0", "-5", "nan", "fast"):
        with pytest.raises(SystemExit):
            validator_settings("--prefill-tokens-per-s", bad)


async def test_the_validators_rate_is_the_deadline_its_client_holds_a_miner_to(keys, miner):
    hotkey = keys["miner"].ss58_address
    # the validator's MinerClient is made with settings.timeouts (validator_app/rounds.py)
    async with MinerClient(keys["validator"], validator_settings("--prefill-tokens-per-s", "2000").timeouts) as client:
        result = await client.generate(miner.url, hotkey, prefill_at_2500())
    assert result.token_ids == [10, 11] and result.ttft_s > 0.6  # longer than the 0.3 s floor, within 1.1 s
    async with MinerClient(keys["validator"], validator_settings("--prefill-tokens-per-s", "inf").timeouts) as client:
        started = time.monotonic()
        with pytest.raises(MinerTimeout) as caught:
            await client.generate(miner.url, hotkey, prefill_at_2500())
    assert caught.value.kind == "first_byte" and time.monotonic() - started <= 0.3 + SLACK_S


async def test_the_gateways_rate_is_the_deadline_of_its_calls_to_miners(keys, miner):
    hotkey = keys["miner"].ss58_address
    fast = validator_settings("--gateway-prefill-tokens-per-s", "2000").gateway.miner_timeouts
    slow = validator_settings("--gateway-prefill-tokens-per-s", "1000").gateway.miner_timeouts
    async with MinerClient(keys["validator"]) as client:
        # as the gateway calls a miner: client.generate(url, hotkey, request, settings.miner_timeouts)
        result = await client.generate(miner.url, hotkey, prefill_at_2500(), fast)
        assert result.token_ids == [10, 11]
        tight = validator_settings("--gateway-prefill-tokens-per-s", "20000").gateway.miner_timeouts
        with pytest.raises(MinerTimeout) as caught:  # 0.3 + 0.08 s allowed, the prefill takes 0.64 s
            await client.generate(miner.url, hotkey, prefill_at_2500(), tight)
        assert caught.value.limit_s == pytest.approx(0.38)
    assert slow.first_event_s(1600) == pytest.approx(1.9)
