"""The gateway is the least trusted door: what a miner would refuse it refuses first (an OpenAI-shaped 400
naming the field), and a request that a miner refuses, or that fells a miner's engine, reaches one miner
only: a request fault is the user's 400, an engine failure on the request is not handed to the next miner."""
import openai
import pytest
from test_gateway import KEY, MESSAGES, MODEL, Directory, openai_client, subnet, world  # noqa: F401 (fixtures)

from inference.serving import EngineError
from neurons.gateway import MinerTarget


class PoisonedEngine:
    """A real engine that fails every generation with `code` (a request it chokes on)."""

    def __init__(self, inner, code: str):
        self.inner, self.code = inner, code

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, request):
        raise EngineError(self.code, "this request felled the engine" if self.code == "engine_failure"
                          else "this request is refused")


@pytest.fixture
def poisoned(monkeypatch):
    """Miners started by `subnet` get a PoisonedEngine with the code given to set()."""
    import test_gateway

    def set_code(code: str):
        monkeypatch.setattr(test_gateway, "cheating_engine", lambda inner, cheat: PoisonedEngine(inner, code))
    return set_code


async def test_out_of_bounds_sampling_is_refused_by_the_gateway_before_any_miner(world, subnet):
    start_miner, start_gateway, _ = subnet
    miner = await start_miner("miner_a", uid=1, score=1.0)
    directory = Directory([miner])
    gateway = await start_gateway(directory)
    async with openai_client(gateway) as client:
        for field, value in (("temperature", 1e-39), ("temperature", 5e-324), ("top_p", 5e-324),
                             ("top_p", 1e-7)):
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **{field: value})
            assert caught.value.status_code == 400 and caught.value.body["param"] == field
        assert directory.reports == []  # no miner saw any of them
        answer = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                                      temperature=1e-3, top_p=1e-6)
        assert answer.usage.completion_tokens >= 1


@pytest.mark.parametrize("code, status", [("invalid_request", 400), ("engine_failure", 502)])
async def test_a_poison_request_reaches_at_most_one_miner(world, subnet, poisoned, code, status):
    start_miner, start_gateway, _ = subnet
    poisoned(code)
    first = await start_miner("miner_a", uid=1, score=0.9, cheat="poison")
    second = await start_miner("miner_b", uid=2, score=0.8, cheat="poison")
    directory = Directory([first, second])
    gateway = await start_gateway(directory, max_attempts=3)
    async with openai_client(gateway) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert caught.value.status_code == status
    assert [uid for uid, *_ in directory.reports] == [1]  # the second miner never saw it
