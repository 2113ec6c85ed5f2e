"""The stage wire without processes: frames and their bounds, fp32/bf16 state round trips, non-finite
detection, receipts and their chain, signed capabilities, route planning, and the delay link."""
import asyncio
import json
import struct
import time

import pytest
import torch
from bittensor.sp_core import Keypair

from inference.model.k3 import ResidualState
from localnet.linkproxy import DelayLink
from neurons.swarm.codec import decode_inputs, encode_ids, encode_state
from neurons.swarm.route import StageInfo, plan_route, uncovered
from protocol.stage import (ForwardHeader, StageWireError, decode_forward, encode_frame, sign_capabilities,
                            sign_receipt, split_frame, state_sha256, verify_capabilities, verify_receipt,
                            verify_receipt_chain)

K1, K2, K3 = (Keypair.create_from_uri(f"//swarm{i}") for i in range(3))


def frame_of(state, dtype="float32", **kw):
    specs, body = encode_state(state, dtype)
    return encode_frame(ForwardHeader(route_id="r", session="s", step=0, position=0, tensors=specs, **kw), body)


def test_state_round_trips_in_fp32_and_bf16():
    g = torch.Generator().manual_seed(0)
    st = ResidualState((3,), [torch.randn(3, 8, generator=g)], torch.randn(3, 8, generator=g))
    for dtype, tol in (("float32", 0.0), ("bfloat16", 1e-2)):
        header, tensors, _ = decode_forward(frame_of(st, dtype))
        back = decode_inputs(tensors, first_stage=False, hidden_size=8)
        assert (back.partial - st.partial).abs().max() <= tol * st.partial.abs().max()
        assert len(back.blocks) == 1 and back.lengths == (3,)
    specs, body = encode_ids([5, 6, 7])
    _, tensors, _ = decode_forward(encode_frame(ForwardHeader(route_id="r", session="s", step=0, position=0,
                                                              tensors=specs), body))
    assert decode_inputs(tensors, first_stage=True, hidden_size=8).tolist() == [5, 6, 7]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_non_finite_states_are_refused(bad, dtype):
    st = ResidualState((2,), [], torch.zeros(2, 4))
    st.partial[1, 3] = bad
    with pytest.raises(StageWireError) as e:
        decode_forward(frame_of(st, dtype))
    assert (e.value.status, e.value.code) == (400, "non_finite")


def test_frame_bounds():
    st = ResidualState((2,), [], torch.zeros(2, 4))
    good = frame_of(st)
    cases = {
        b"xx": "bad_frame",
        b"NOPE" + good[4:]: "bad_frame",
        good[:-1]: "bad_body",
        good + b"\0": "bad_body",
        good[:12]: "bad_frame",
    }
    for frame, code in cases.items():
        with pytest.raises(StageWireError) as e:
            decode_forward(frame)
        assert e.value.code == code and e.value.status == 400
    with pytest.raises(StageWireError) as e:
        decode_forward(good, max_body_bytes=8)
    assert e.value.status == 413
    header, body = split_frame(good)
    for patch in ({"step": -1}, {"surprise": 1}, {"mode": "train"}, {"tensors": []}):
        raw = json.dumps({**header, **patch}).encode()
        with pytest.raises(StageWireError) as e:
            decode_forward(b"K3SW" + struct.pack("<BI", 1, len(raw)) + raw + bytes(body))
        assert e.value.code == "invalid_message", patch


def test_receipts_chain_and_signatures():
    h0 = state_sha256([], b"ids")
    r1 = sign_receipt(K1, route_id="r", session="s", step=3, layers=[0, 4], fingerprint="f1",
                      input_sha256=h0, output_sha256="a" * 64, driver=K2.ss58_address)
    r2 = sign_receipt(K2, route_id="r", session="s", step=3, layers=[4, 13], fingerprint="f2",
                      input_sha256="a" * 64, output_sha256="b" * 64, driver=K2.ss58_address)
    assert verify_receipt(r1) and verify_receipt(r2, K2.ss58_address) and not verify_receipt(r2, K1.ss58_address)
    assert verify_receipt_chain([r1, r2], "r", "s", 3, h0, [K1.ss58_address, K2.ss58_address]) is None
    assert "does not start" in verify_receipt_chain([r2, r1], "r", "s", 3, "a" * 64)
    forged = r2.model_copy(update={"output_sha256": "c" * 64})
    assert not verify_receipt(forged)
    assert "bad signature" in verify_receipt_chain([r1, forged], "r", "s", 3, h0)
    assert verify_receipt_chain([r1, r2], "r", "s", 4, h0) is not None
    assert verify_receipt_chain([r1, r2], "r", "s", 3, h0, driver=K2.ss58_address) is None
    assert "not " + K1.ss58_address in verify_receipt_chain([r1, r2], "r", "s", 3, h0, driver=K1.ss58_address)


def caps(key, a, b, step_ms=1.0):
    return StageInfo(sign_capabilities(
        key, model_id="m", config_hash="c", num_layers=13, hidden_size=64, vocab_size=272, layers=[a, b],
        embedding=a == 0, head=b == 13, fingerprint="f", capacity={"sessions": 1}, step_ms=step_ms,
        max_body_bytes=1 << 20, url="http://127.0.0.1:1", software_version="0", signed_at=time.time()))


def test_capabilities_are_signed():
    info = caps(K1, 0, 4)
    assert verify_capabilities(info.caps, K1.ss58_address)
    assert not verify_capabilities(info.caps.model_copy(update={"layers": [0, 13]}))


def test_route_planning_prefers_current_then_fewest_hops_then_speed():
    a, b, b_fast, c, whole_tail = caps(K1, 0, 4), caps(K2, 4, 9, 5.0), caps(K3, 4, 9, 1.0), \
        caps(Keypair.create_from_uri("//c"), 9, 13), caps(Keypair.create_from_uri("//t"), 4, 13, 50.0)
    stages = [a, b, b_fast, c, whole_tail]
    assert [s.hotkey for s in plan_route(stages, 13)] == [a.hotkey, whole_tail.hotkey]  # fewest hops
    assert [s.hotkey for s in plan_route(stages, 13, exclude={whole_tail.hotkey})] == [a.hotkey, b_fast.hotkey, c.hotkey]
    route = plan_route(stages, 13, exclude={whole_tail.hotkey}, prefer={a.hotkey, b.hotkey, c.hotkey})
    assert [s.hotkey for s in route] == [a.hotkey, b.hotkey, c.hotkey]
    assert plan_route(stages, 13, exclude={c.hotkey, whole_tail.hotkey}) is None
    assert uncovered(stages, 13, {c.hotkey, whole_tail.hotkey}) == "layer 9"


def test_delay_link_delays_each_direction():
    async def main():
        async def echo(r, w):
            w.write(await r.read(5))
            await w.drain()
            w.close()
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        link = DelayLink(server.sockets[0].getsockname()[1], one_way_delay_s=0.05)
        await link.start()
        r, w = await asyncio.open_connection("127.0.0.1", link.listen_port)
        t0 = time.monotonic()
        w.write(b"hello")
        await w.drain()
        got = await r.read(5)
        rtt = time.monotonic() - t0
        w.close()
        await link.close()
        server.close()
        return got, rtt

    got, rtt = asyncio.run(main())
    assert got == b"hello" and 0.1 <= rtt < 0.6


def test_delay_link_limits_the_rate():
    async def main():
        received = asyncio.get_running_loop().create_future()

        async def sink(r, w):
            n = 0
            while n < 25_000:
                n += len(await r.read(65536))
            received.set_result(time.monotonic())
            w.close()
        server = await asyncio.start_server(sink, "127.0.0.1", 0)
        link = DelayLink(server.sockets[0].getsockname()[1], rate_bps=1_000_000)  # 1 Mbit/s: 25 kB take 0.2 s
        await link.start()
        _, w = await asyncio.open_connection("127.0.0.1", link.listen_port)
        t0 = time.monotonic()
        w.write(b"x" * 25_000)
        await w.drain()
        done = await asyncio.wait_for(received, 10)
        w.close()
        await link.close()
        server.close()
        return done - t0

    assert 0.19 <= asyncio.run(main()) < 2.0


def test_the_miner_entry_point_serves_a_stage_when_given_serve_layers(capsys):
    from neurons.miner import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--serve-layers", "0-5", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--serve-layers" in out and "--rewind-window" in out
