"""The miner's /health follows its engine's scheduler (down at once when it dies, ok again once the
watchdog restarted it), and the replay store is written only for callers that pass the validator gate."""
import asyncio
import time

import aiohttp
from test_miner import body_of, local_engine, signed_call, start_miner, world  # noqa: F401 (fixtures)

from protocol.client import MinerClient
from protocol.schemas import GenerateRequest
from protocol.signature import verify_final


async def health_of(miner) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(miner.url + "/health") as response:
            return (await response.json())["status"]


async def test_health_reports_a_dead_scheduler_and_its_recovery(world, start_miner):
    engine = local_engine(world)
    miner = await start_miner(engine=engine)
    assert await health_of(miner) == "ok"
    engine._task.cancel()
    started = time.monotonic()
    while await health_of(miner) == "ok":
        assert time.monotonic() - started < 5.0, "still ok 5 s after the scheduler died"
        await asyncio.sleep(0.02)
    while await health_of(miner) != "ok":
        assert time.monotonic() - started < 10.0, "not recovered"
        await asyncio.sleep(0.05)
    async with MinerClient(world.key("validator")) as client:
        result = await client.generate(miner.url, miner.hotkey, GenerateRequest(
            request_id="after-restart", prompt_token_ids=[1, 2, 3], max_tokens=2, temperature=0.0))
    assert verify_final(result.final, result.body, result.token_ids, miner.hotkey)


def stored_nonces(miner) -> int:
    with miner.nonce_store._lock:
        return miner.nonce_store._connect().execute("SELECT COUNT(*) FROM btauth_nonces").fetchone()[0]


async def test_the_replay_store_is_written_only_past_the_gate(world, start_miner):
    miner = await start_miner()
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            status, _, _ = await signed_call(session, miner, world.key("stranger"), body_of())
            assert status == 403
        assert stored_nonces(miner) == 0
        status, _, _ = await signed_call(session, miner, world.key("validator"), body_of())
        assert status == 200
    assert stored_nonces(miner) == 1
