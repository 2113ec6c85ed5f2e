"""A rewind carried in a forward's header (`ForwardHeader.rewind`), over real stage servers on loopback.

After a rejected speculative draft every stage must go back to the last accepted position; the route driver
sends that rewind with its next forward instead of a round trip of its own. Tested: greedy with speculation
equals greedy without (the single-process model) over 2 and 3 stages, for drafts that are always and never
accepted, with no rewind message sent; the old path (the rewind message) still gives the same tokens; a
forward with an embedded rewind leaves every stage's state as a fresh session fed only the kept tokens
(logprobs within 1e-5, fp32); hostile rewinds in the header (beyond the position, negative, of the wrong
type, not where the forward starts, older than the rewind window) get 4xx and leave the session intact.
"""
import asyncio
import json

import aiohttp
import pytest
import torch
from bittensor.sp_core import Keypair
from conftest import collect_events, reference_greedy

from inference.decoding.drafters import ReplayDrafter
from inference.decoding.sampling import SamplingParams
from inference.decoding.speculation import SpeculationConfig
from inference.model.config import ModelConfig
from inference.model.tokenizer import load_tokenizer
from inference.serving.engine import GenerationRequest
from inference.swarm.stage import LayerRange, Stage, StageError, StageLimits
from neurons.swarm.codec import encode_ids
from neurons.swarm.route import RouteDriver, RouteEngine, StaticDirectory
from neurons.swarm.stage_server import StageServer
from protocol.auth import sign_request
from protocol.stage import FORWARD_PATH, ForwardHeader, encode_frame

CONFIG = ModelConfig.tiny()
ROUTES = {2: [(0, 4), (4, 13)], 3: [(0, 4), (4, 6), (6, 13)]}
KEYS = {blk: Keypair.create_from_uri(f"//rewind-header-{blk[0]}-{blk[1]}") for r in ROUTES.values() for blk in r}
DRIVER = Keypair.create_from_uri("//rewind-header-driver")
PROMPT = [(11 * j + 5) % 256 for j in range(21)]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def greedy(tiny_reference):
    return reference_greedy(tiny_reference[0], PROMPT, NEW_TOKENS)


def run_servers(checkpoint, hops, body, limits=StageLimits(), forward_rewind=True, start_driver=False):
    """Start the stage servers of a `hops`-stage route in this process, run `body(servers, driver)` and stop
    (`start_driver`: the driver too; an engine starts its own)."""
    async def main():
        servers = []
        for a, b in ROUTES[hops]:
            stage = Stage.from_checkpoint(checkpoint, LayerRange(a, b, CONFIG.num_layers), limits=limits)
            if not forward_rewind:  # a stage that predates the field: it does not say it takes one
                stage.capacity = lambda s=stage: {k: v for k, v in Stage.capacity(s).items() if k != "forward_rewind"}
            servers.append(StageServer(stage, KEYS[(a, b)]))
        for s in servers:
            await s.start()
        driver = RouteDriver(StaticDirectory([s.url for s in servers]), DRIVER, CONFIG, hop_timeout_s=10.0)
        try:
            if start_driver:
                await driver.start()
            return await body(servers, driver)
        finally:
            if start_driver:
                await driver.stop()
            for s in servers:
                await s.close()
    return asyncio.run(asyncio.wait_for(main(), 300))


def replay_config(want, wrong_every):
    factory = lambda ids: ReplayDrafter(len(ids), want, CONFIG.vocab_size, wrong_every)  # noqa: E731
    return SpeculationConfig(max_draft_tokens=3, fixed_draft_tokens=3, drafter_factory=factory)


@pytest.mark.parametrize("hops", [2, 3])
@pytest.mark.parametrize("wrong_every", [0, 1, 2])
def test_speculation_with_header_rewinds_equals_plain_greedy(tiny_checkpoint, greedy, hops, wrong_every):
    want, want_lp = greedy

    async def body(servers, driver):
        engine = RouteEngine(driver, load_tokenizer(tiny_checkpoint, CONFIG), prefill_chunk=8,
                             speculation=replay_config(want, wrong_every))
        async with engine:
            events, final = await collect_events(engine.generate(GenerationRequest(
                PROMPT, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))))
        return events, final, [dict(s.rewinds) for s in servers], driver.rewind_messages

    events, final, rewinds, messages = run_servers(tiny_checkpoint, hops, body)
    assert [e.token_id for e in events] == want
    assert max(abs(e.logprob - w) for e, w in zip(events, want_lp)) < 1e-4
    assert final.verify_steps > 0 and messages == 0
    assert all(r["message"] == 0 for r in rewinds)
    if wrong_every == 0:
        assert final.draft_accepted == final.draft_proposed and all(r["forward"] == 0 for r in rewinds)
    else:  # every rejection was undone by the next forward's header, on every stage alike
        assert final.draft_accepted < final.draft_proposed
        assert len({r["forward"] for r in rewinds}) == 1 and rewinds[0]["forward"] > 0


def test_route_of_older_stages_uses_the_rewind_message(tiny_checkpoint, greedy):
    want, _ = greedy

    async def body(servers, driver):
        engine = RouteEngine(driver, load_tokenizer(tiny_checkpoint, CONFIG), prefill_chunk=8,
                             speculation=replay_config(want, 2))
        async with engine:
            events, final = await collect_events(engine.generate(GenerationRequest(
                PROMPT, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))))
        return [e.token_id for e in events], [dict(s.rewinds) for s in servers], driver.rewind_messages

    tokens, rewinds, messages = run_servers(tiny_checkpoint, 2, body, forward_rewind=False)
    assert tokens == want
    assert messages > 0 and all(r == {"message": messages, "forward": 0} for r in rewinds)


def test_embedded_rewind_leaves_state_as_if_rejected_tokens_were_never_seen(tiny_checkpoint, greedy):
    """A verify forward whose drafts are all wrong, then a score forward carrying the rewind; against a fresh
    session fed only the kept tokens: the same teacher-forced logprobs, within 1e-5."""
    want, _ = greedy
    start = len(PROMPT)
    follow = [want[1], want[2], 7, 8]
    targets = follow[1:] + [9]

    async def body(servers, driver):
        rs = await driver.open(SamplingParams(), 0)
        await driver.run(rs, [(PROMPT, "sample", None)])
        wrong = [(t + 1) % CONFIG.vocab_size for t in want[1:4]]
        out = (await driver.run(rs, [([want[0]] + wrong, "verify", wrong)]))[0]
        await driver.rewind(rs, start + 1 + out.accepted, with_next_forward=True)
        assert rs.rewind_to == start + 1 and rs.position == start + 1
        after = (await driver.run(rs, [(follow, "score", targets)], top_k=4))[0]
        fresh = await driver.open(SamplingParams(), 0)
        await driver.run(fresh, [(PROMPT + [want[0]], "none", None)])
        plain = (await driver.run(fresh, [(follow, "score", targets)], top_k=4))[0]
        for x in (rs, fresh):
            await driver.close(x)
        return out, after, plain, [dict(s.rewinds) for s in servers], driver.rewind_messages

    out, after, plain, rewinds, messages = run_servers(tiny_checkpoint, 3, body, start_driver=True)
    assert out.accepted == 0 and messages == 0 and all(r == {"message": 0, "forward": 1} for r in rewinds)
    assert max(abs(a - b) for a, b in zip(after.logprobs, plain.logprobs)) < 1e-5
    for a, b in zip(after.row_tops, plain.row_tops):
        assert [t for t, _ in a] == [t for t, _ in b]


def test_hostile_rewinds_in_the_header_are_refused_and_the_session_survives(tiny_checkpoint, greedy):
    want, _ = greedy
    limits = StageLimits(max_snapshots=2, rewind_window=4)

    async def body(servers, driver):
        first = servers[0]
        rs = await driver.open(SamplingParams(), 0)
        await driver.run(rs, [(PROMPT, "sample", None)])
        for t in want[:5]:  # past the rewind window: the prompt's recorded input is dropped
            await driver.run(rs, [([t], "sample", None)])
        pos = rs.position
        specs, ids = encode_ids([want[5]])

        def frame(**change):
            fields = {"route_id": rs.route_id, "session": rs.session, "step": rs.step, "position": pos,
                      "mode": "sample", "tensors": [s.model_dump() for s in specs], **change}
            raw = json.dumps(fields).encode()
            return b"K3SW" + bytes([1]) + len(raw).to_bytes(4, "little") + raw + ids

        cases = {"beyond": dict(rewind=pos + 1, position=pos + 1), "negative": dict(rewind=-1),
                 "string": dict(rewind=str(pos)), "float": dict(rewind=float(pos)), "bool": dict(rewind=True),
                 "list": dict(rewind=[pos]), "huge": dict(rewind=2**40),
                 "not_where_it_starts": dict(rewind=pos - 1), "out_of_window": dict(rewind=3, position=3)}
        statuses = {}
        async with aiohttp.ClientSession() as http:
            for name, change in cases.items():
                body_ = frame(**change)
                headers = sign_request(DRIVER, "POST", FORWARD_PATH, body_, first.hotkey)
                async with http.post(first.url + FORWARD_PATH, data=body_, headers=headers) as r:
                    statuses[name] = (r.status, (await r.json())["error"]["code"])
        positions = [s.stage.sessions[rs.session].position for s in servers]
        # intact: the route continues like the reference, and a good embedded rewind still works
        nxt = (await driver.run(rs, [([want[5]], "sample", None)]))[0]
        await driver.rewind(rs, pos, with_next_forward=True)
        again = (await driver.run(rs, [([want[5]], "sample", None)]))[0]
        await driver.close(rs)
        return statuses, positions, [nxt.token_id, again.token_id]

    statuses, positions, tokens = run_servers(tiny_checkpoint, 2, body, limits=limits, start_driver=True)
    assert {k: v[0] for k, v in statuses.items()} == {
        "beyond": 400, "negative": 400, "string": 400, "float": 400, "bool": 400, "list": 400, "huge": 400,
        "not_where_it_starts": 409, "out_of_window": 409}
    assert statuses["beyond"][1] == "bad_position" and statuses["out_of_window"][1] == "rewind_out_of_window"
    assert positions == [len(PROMPT) + 5] * 2
    assert tokens == [want[6], want[6]]


def test_stage_rewind_and_forward_checks_before_touching(tiny_checkpoint):
    """In process: a refused rewind-and-forward (bad rewind, or a forward that does not fit after it) leaves
    the session's position and state as they were."""
    stage = Stage.from_checkpoint(tiny_checkpoint, "0-12")
    stage.open("s")
    stage.forward("s", 0, torch.tensor(PROMPT), mode="sample")
    cache_len = stage.sessions["s"].cache.length
    for rewind, position, mode in ((len(PROMPT) + 1, len(PROMPT) + 1, "sample"), (-1, -1, "sample"),
                                   (5, 6, "sample"), (5, 5, "verify")):  # the last: a verify needs drafts
        with pytest.raises(StageError) as e:
            stage.rewind_and_forward("s", rewind, position, torch.tensor([1]), mode)
        assert e.value.status in (400, 409)
        assert stage.sessions["s"].position == len(PROMPT) and stage.sessions["s"].cache.length == cache_len
    out = stage.rewind_and_forward("s", 5, 5, torch.tensor([1]), "sample")
    stage.open("t")
    fresh = stage.forward("t", 0, torch.tensor(PROMPT[:5] + [1]), mode="sample")
    assert out.token_id == fresh.token_id and abs(out.logprob - fresh.logprob) < 1e-5
