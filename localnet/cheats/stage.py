"""Stage cheaters: real `Stage` subclasses that serve a block dishonestly, for the stage checks' tests (and a
local swarm run with a cheating stage). Each saves compute or hides a cheaper model behind valid receipts:

- `OtherWeightsStage`: serves other weights for its block (every tensor of the block perturbed, like a
  cheaper fine-tune or a different checkpoint);
- `SkipLayerStage`: skips one layer of its block;
- `EchoStage`: returns its input (no layer run; completed block sums it should produce are copies of the
  partial);
- `SessionLiarStage`: skips its last layer only for some sessions (a fraction chosen by the session id);
- `LongPositionLiarStage`: skips its last layer only at positions >= `from_position`;
- `ReplayStage`: computes an output once per forward length and replays it for every later input of that
  length;
- `ForwardingStage`: computes nothing; hands each session to another stage miner of its block (one of
  `forward_to`, chosen per session) over the stage wire and signs that stage's output as its own work.

The driver-side attack (receipts the stages never signed) lives in the tests: it needs no stage.

As processes: `python -m localnet.cheats.stage --checkpoint DIR --wallet-path P --stage NAME:KIND:A-B[:DTYPE
[:WIRE_DTYPE]] ...` serves one stage per --stage in one process (KIND: `honest` or a key of `CHEATS`; the
hotkey is wallet NAME/default), each on its own port (`--port` with one stage); `--ready-file` gets
stage_miner's JSON for one stage, {NAME: that JSON} for several; with `--network`/`--netuid` every stage announces
itself on chain as stage_miner does (endpoint and `StageAnnouncement`).
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import secrets
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from inference.model.k3 import ResidualState
from inference.model.kda import KDALayerCache
from inference.swarm.stage import LayerRange, Stage, StageError, StageLimits, blocks_before, load_stage_model
from neurons.swarm.codec import decode_wire, encode_head_output, encode_state
from neurons.swarm.stage_server import StageServer


class _Cheat(Stage):
    @classmethod
    def from_checkpoint(cls, checkpoint, layers, dtype=torch.float32, limits: StageLimits = StageLimits(), **kw):
        stage = super().from_checkpoint(checkpoint, layers, dtype, limits)
        stage.source = checkpoint
        for k, v in kw.items():
            setattr(stage, k, v)
        stage.setup()
        return stage

    def setup(self) -> None:
        pass

    def _input_state(self, inputs) -> ResidualState:
        if self.layers.has_embedding:
            return self.model.embed(inputs.to(torch.long))
        return ResidualState((int(inputs.partial.shape[0]),), [b.float() for b in inputs.blocks],
                             inputs.partial.float())

    def _run_skipping(self, session, inputs, skip: set[int]) -> ResidualState:
        state = self._input_state(inputs)
        for i in range(self.layers.start, self.layers.stop):
            if i not in skip:
                state = self.model.run_layer(i, state, [session.cache])
        state = self._fill_blocks(state)
        session.cache.advance(int(state.partial.shape[0]))
        return state

    def _fill_blocks(self, state: ResidualState) -> ResidualState:
        """A skipped layer that would have closed a block: fake the block sum so the shape is right."""
        while len(state.blocks) < self.output_blocks:
            state = ResidualState(state.lengths, list(state.blocks) + [state.partial], state.partial)
        return state


class OtherWeightsStage(_Cheat):
    """Every tensor of the block perturbed by `relative_noise` x its own scale (seeded)."""

    relative_noise = 0.1
    noise_seed = 1

    def setup(self) -> None:
        g = torch.Generator().manual_seed(self.noise_seed)
        with torch.no_grad():
            for i in range(self.layers.start, self.layers.stop):
                for p in self.model.layers[i].parameters():
                    if p.is_floating_point() and p.numel() > 1:
                        noise = torch.randn(p.shape, generator=g).to(p.dtype)
                        p.add_(noise * (p.float().std() * self.relative_noise).to(p.dtype))
                for mod in self.model.layers[i].modules():  # decoded expert caches hold the old weights
                    if hasattr(mod, "set_dequantize_cache"):
                        mod.set_dequantize_cache(False)
                        mod.set_dequantize_cache(True)


class SkipLayerStage(_Cheat):
    skip_layer: int | None = None  # default: the block's last layer

    def _run(self, session, inputs):
        return self._run_skipping(session, inputs, {self.layers.stop - 1 if self.skip_layer is None
                                                    else self.skip_layer})


class EchoStage(_Cheat):
    def _run(self, session, inputs):
        return self._run_skipping(session, inputs, set(range(self.layers.start, self.layers.stop)))


class SessionLiarStage(_Cheat):
    """Honest for most sessions; for one session in `one_in` (by its id) it skips its last layer."""

    one_in = 3

    def lies_for(self, session_id: str) -> bool:
        return hashlib.sha256(session_id.encode()).digest()[0] % self.one_in == 0

    def _run(self, session, inputs):
        if self.lies_for(session.session_id):
            return self._run_skipping(session, inputs, {self.layers.stop - 1})
        return super()._run(session, inputs)


class LongPositionLiarStage(_Cheat):
    """Honest at short positions; skips its last layer for forwards that reach `from_position`."""

    from_position = 48

    def _run(self, session, inputs):
        n = int(inputs.shape[0]) if isinstance(inputs, torch.Tensor) else int(inputs.partial.shape[0])
        if session.position + n > self.from_position:
            return self._run_skipping(session, inputs, {self.layers.stop - 1})
        return super()._run(session, inputs)


class ReplayStage(_Cheat):
    """The first output of each forward length is computed; later inputs of that length get it back."""

    def setup(self) -> None:
        self.replay: dict[int, ResidualState] = {}

    def _run(self, session, inputs):
        n = int(inputs.shape[0]) if isinstance(inputs, torch.Tensor) else int(inputs.partial.shape[0])
        if n in self.replay:
            session.cache.advance(n)
            return self.replay[n]
        out = super()._run(session, inputs)
        self.replay[n] = out
        return out


class ForwardingStage(_Cheat):
    """Hands every session to another stage miner of its block (one of `forward_to`, by the session id) and
    returns that stage's output under its own receipt; computes itself only while no such stage answers."""

    forward_to: tuple[str, ...] = ()
    keypair = None  # the hotkey it relays under: its own
    timeout_s = 10.0

    def setup(self) -> None:
        self._loop = None
        self._relay = None
        self._targets: list = []
        self._remote: dict[str, list] = {}  # session -> [target, route id, next step]

    async def _connect(self):
        import aiohttp  # noqa: PLC0415

        from localnet.relay import StageRelay, StageSink  # noqa: PLC0415

        sink = StageSink(self.keypair)
        await sink.start()
        return StageRelay(self.keypair, sink, aiohttp.ClientSession(), self.timeout_s)

    async def _discover(self):
        from neurons.swarm.route import StaticDirectory  # noqa: PLC0415

        found = await StaticDirectory(list(self.forward_to), timeout_s=2.0).stages(self._relay.http)
        return [s for s in found if (s.start, s.stop) == (self.layers.start, self.layers.stop)
                and s.hotkey != self.keypair.ss58_address]

    def forward(self, session_id, position, inputs, mode="none", targets=None, top_k=0):
        from localnet.relay import LoopThread, encode_input  # noqa: PLC0415
        from neurons.base.engine_wire import wire_sampling  # noqa: PLC0415

        with self._lock:
            session = self.get(session_id)
            n = self.check_forward(session, position, inputs, mode, targets, top_k)
            if self._loop is None:
                self._loop = LoopThread()
                self._relay = self._loop.call(self._connect(), 30.0)
            if session_id not in self._remote and position == 0:
                self._targets = self._loop.call(self._discover(), 30.0)  # whoever serves the block now
                if self._targets:
                    target = self._targets[hashlib.sha256(session_id.encode()).digest()[0] % len(self._targets)]
                    rid = secrets.token_hex(8)
                    opening = self._relay.open(target, session_id, rid, wire_sampling(session.sampling),
                                               session.seed, session.prompt_tokens)
                    self._loop.call(opening, self.timeout_s)
                    self._remote[session_id] = [target, rid, 0]
            if session_id not in self._remote:
                return super().forward(session_id, position, inputs, mode, targets, top_k)
            target, rid, step = self._remote[session_id]
            specs, body = encode_input(inputs)
            hop = self._loop.call(self._relay.forward(target, session_id, rid, step, position, specs, body, mode,
                                                      targets, top_k), self.timeout_s + 1)
            self._remote[session_id][2] += 1
            session.position = position + n
            session.step += 1
            session.last_used = time.monotonic()
            self.forwards += 1
            self.tokens += n
            return decode_wire(list(hop.output_specs), hop.output_body, False, self.config.hidden_size)

    def close(self, session_id: str) -> None:
        super().close(session_id)
        remote = self._remote.pop(session_id, None)
        if remote is not None:
            self._loop.call(self._relay.close(remote[0], session_id), self.timeout_s)


class WatchAwareStage(_Cheat):
    """Honest only while a session has the shape of a validator's check of old: the same party upstream and
    downstream of it (a validator relaying both sides); a real route never does that, so every user's session
    gets its input echoed."""

    def _watched(self, session) -> bool:
        downstream = (session.downstream or session.reply_to or {}).get("hotkey")
        return bool(session.upstream) and downstream == session.upstream

    def _run(self, session, inputs):
        if self._watched(session):
            return super()._run(session, inputs)
        return self._run_skipping(session, inputs, set(range(self.layers.start, self.layers.stop)))


class DriverAwareStage(_Cheat):
    """Honest for sessions a validator opens (its hotkey in `watched`); skips its last layer for every other
    driver's sessions (a route miner's, whose work it expects nobody to check)."""

    watched: tuple[str, ...] = ()

    def _run(self, session, inputs):
        if session.owner in self.watched:
            return super()._run(session, inputs)
        return self._run_skipping(session, inputs, {self.layers.stop - 1})


class SparseLiarStage(_Cheat):
    """Lies below any window: at 10 of every 16 positions its last layer's MLP (the MoE) is not run, so no run
    of 16 tokens ever holds 12 far-off ones; each such token is off by that layer's MLP only."""

    lie_positions = 10
    period = 16

    def setup(self) -> None:
        layer = self.model.layers[self.layers.stop - 1]
        honest = layer.mlp_forward
        stage = self

        def sparse(x):
            keep = torch.tensor([(stage._at + r) % stage.period >= stage.lie_positions for r in range(x.shape[0])])
            out = torch.zeros(x.shape[0], x.shape[1], dtype=x.dtype)
            if bool(keep.any()):
                out[keep] = honest(x[keep]).to(x.dtype)
            return out
        layer.mlp_forward = sparse
        self._at = 0

    def _run(self, session, inputs):
        self._at = session.position
        return super()._run(session, inputs)


class FewerExpertsStage(_Cheat):
    """A slightly cheaper model: every MoE layer of its block routes each token to `experts` of the model's
    top-k experts (the best ones by the same router), saving that share of the expert compute."""

    experts = 0  # 0: half the model's top-k

    def setup(self) -> None:
        for i in range(self.layers.start, self.layers.stop):
            layer = self.model.layers[i]
            if getattr(layer, "is_moe", False):
                router = layer.block_sparse_moe.gate
                k = self.experts or max(1, router.config.experts_per_token // 2)
                router.config = replace(router.config, experts_per_token=k)


class QuantizedStage(_Cheat):
    """A cheaper model: its block's dense weights rounded to 4-bit integers per output channel (the experts stay
    as they are), while it declares the numerics of its dtype."""

    bits = 4

    def setup(self) -> None:
        top = 2 ** (self.bits - 1) - 1
        with torch.no_grad():
            for i in range(self.layers.start, self.layers.stop):
                for name, p in self.model.layers[i].named_parameters():
                    if p.is_floating_point() and p.dim() == 2 and "experts" not in name:
                        scale = p.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / top
                        p.copy_((p.float() / scale).round().clamp(-top, top).mul(scale).to(p.dtype))


class StaleStateStage(_Cheat):
    """Forgets long context to save memory: every `window` positions its KDA layers' recurrent state is zeroed,
    so it attends honestly within a window and not across it."""

    window = 32

    def _run(self, session, inputs):
        n = int(inputs.shape[0]) if isinstance(inputs, torch.Tensor) else int(inputs.partial.shape[0])
        if session.position // self.window != (session.position + n) // self.window:
            for c in session.cache.layers:
                if isinstance(c, KDALayerCache):
                    c.state.zero_()
        return super()._run(session, inputs)


class LateSwitchStage(_Cheat):
    """Honest for its first `honest_forwards` forwards (while it builds a record), then echoes its input."""

    honest_forwards = 200

    def _run(self, session, inputs):
        if self.forwards < self.honest_forwards:
            return super()._run(session, inputs)
        return self._run_skipping(session, inputs, set(range(self.layers.start, self.layers.stop)))


class MisdeclaredStage(_Cheat):
    """Computes in bf16 (its weights cast) while its capabilities declare float32: a coarser numerics hidden
    behind the finest one (a route through it would claim fp32 answers)."""

    @property
    def numerics(self) -> str:
        return "float32"


class PairCoverStage(_Cheat):
    """The second of two adjacent stages under one operator: its partner (an echo stage of the block before)
    computes nothing, and this stage runs the partner's layers too before its own, so the route's answers are
    right and the partner is paid for work it never did. It holds both blocks' weights (`cover`: the partner's
    first layer)."""

    cover = 0

    def setup(self) -> None:
        whole = LayerRange(self.cover, self.layers.stop, self.config.num_layers)
        dtype = next(t.dtype for t in self.model.parameters() if t.is_floating_point())
        self.model, _, _ = load_stage_model(self.source, whole, dtype)  # the fingerprint stays its own block's

    def _run(self, session, inputs):
        partner_blocks = blocks_before(self.cover, self.config.attn_res_block_size)
        state = ResidualState((int(inputs.partial.shape[0]),), [b.float() for b in inputs.blocks[:partner_blocks]],
                              inputs.partial.float())  # the partner's input, under the blocks it faked
        state = self.model.run_layers(self.cover, self.layers.stop, state, [session.cache])
        session.cache.advance(int(state.partial.shape[0]))
        return state

    def _new_cache(self):
        return self.model.new_cache(layers=range(self.cover, self.layers.stop))


class RefusingLedgerServer(StageServer):
    """Never gives its ledger (as if it kept nothing), hoping the sessions it lied in cannot be checked."""

    async def handle_ledger(self, caller: str, body: bytes):
        raise StageError(404, "not_retained", "no record of that session")


class LyingLedgerServer(StageServer):
    """Its ledger holds what an honest stage would have sent (an honest twin computes every forward beside the
    cheat), not the bytes it signed and sent on."""

    def __init__(self, stage, keypair, settings, twin: Stage, **kw):
        super().__init__(stage, keypair, settings, **kw)
        self.twin = twin
        self._twin_out: dict[tuple[str, int], object] = {}
        honest_add = self.ledger.add

        def add(route_id, session, **fields):
            twin_out = self._twin_out.pop((session, fields["step"]), None)
            if twin_out is not None:
                if fields["output_specs"]:
                    fields["output_specs"], fields["output_body"] = encode_state(twin_out, self.settings.wire_dtype)
                else:
                    fields["output_body"] = encode_head_output(twin_out)
            honest_add(route_id, session, **fields)
        self.ledger.add = add

    def _timed_forward(self, header, inputs):
        out = super()._timed_forward(header, inputs)
        if header.session not in self.twin.sessions:
            session = self.stage.sessions[header.session]
            self.twin.open(header.session, sampling=session.sampling, seed=session.seed)
        if header.rewind is not None:
            twin_out = self.twin.rewind_and_forward(header.session, header.rewind, header.position, inputs,
                                                    header.mode, header.targets, header.top_k)
        else:
            twin_out = self.twin.forward(header.session, header.position, inputs, header.mode, header.targets,
                                         header.top_k)
        self._twin_out[(header.session, header.step)] = twin_out
        return out


# a cheat that only exists in numerics other than float32: (the dtype it computes in, its wire dtype)
CHEAT_DEFAULT_DTYPES = {"misdeclared": ("bfloat16", "float32")}  # bf16 compute behind float32 declared end to end


CHEATS = {"other-weights": OtherWeightsStage, "skip-layer": SkipLayerStage, "echo": EchoStage,
          "session-liar": SessionLiarStage, "long-position-liar": LongPositionLiarStage, "replay": ReplayStage,
          "forwarder": ForwardingStage, "watch-aware": WatchAwareStage, "driver-aware": DriverAwareStage,
          "sparse-liar": SparseLiarStage, "fewer-experts": FewerExpertsStage, "quantized": QuantizedStage,
          "stale-state": StaleStateStage, "late-switch": LateSwitchStage, "misdeclared": MisdeclaredStage,
          "refuse-ledger": EchoStage, "ledger-liar": EchoStage, "pair-cover-echo": EchoStage,
          "pair-cover": PairCoverStage}
# the server a cheat runs behind when its lie is in what it answers besides the forward
CHEAT_SERVERS = {"refuse-ledger": RefusingLedgerServer, "pair-cover-echo": RefusingLedgerServer,
                 "pair-cover": RefusingLedgerServer, "ledger-liar": LyingLedgerServer}

__all__ = ["CHEATS", "WireRounding", "OtherWeightsStage", "SkipLayerStage", "EchoStage", "SessionLiarStage",
           "LongPositionLiarStage", "ReplayStage", "ForwardingStage", "LayerRange", "load_stage_model", "main", "start_hosts",
           "stop_hosts"]


class WireRounding:
    """An honest stage whose outputs cross a bfloat16 wire (what `--wire-dtype bfloat16` sends): wraps any
    stage, rounds every output state to bf16 and back. Not a cheat: the checks must pass it."""

    def __init__(self, stage: Stage, dtype: torch.dtype = torch.bfloat16):
        self.stage = stage
        self.dtype = dtype

    def __getattr__(self, name):
        return getattr(self.stage, name)

    def forward(self, *args, **kw):
        out = self.stage.forward(*args, **kw)
        if isinstance(out, ResidualState):
            r = lambda t: t.to(self.dtype).float()  # noqa: E731
            return ResidualState(out.lengths, [r(b) for b in out.blocks], r(out.partial))
        return out


# ------------------------------------------------------------------ stage processes (honest or cheating)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m localnet.cheats.stage",
                                description="Serve stage miners, honest or cheating, one port each, in one process.")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--wallet-path", required=True, help="wallets NAME/default of every --stage")
    p.add_argument("--stage", action="append", required=True, metavar="NAME:KIND:A-B[:DTYPE[:WIRE]]",
                   help=f"KIND: honest or one of {sorted(CHEATS)}; DTYPE, WIRE: float32 (default) or bfloat16")
    p.add_argument("--forward-to", action="append", default=[], metavar="URL",
                   help="stage URLs a forwarder hands its sessions to (those serving its block)")
    p.add_argument("--one-in", type=int, default=3, help="session-liar: lies for one session in this many")
    p.add_argument("--from-position", type=int, default=48, help="long-position-liar: lies from this position")
    p.add_argument("--watched", action="append", default=[], metavar="HOTKEY",
                   help="driver-aware: the hotkeys whose sessions it computes honestly (the validators')")
    p.add_argument("--cover", type=int, default=0, help="pair-cover: the first layer of the partner's block it "
                                                        "computes too")
    p.add_argument("--honest-forwards", type=int, default=200, help="late-switch: forwards before it switches")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="with one --stage: its port (default: a free one each)")
    p.add_argument("--network", default="", help="chain to announce every stage on, as stage_miner does "
                                                  "(its hotkey registered there); empty: announce nothing")
    p.add_argument("--netuid", type=int, default=None)
    p.add_argument("--hop-timeout-s", type=float, default=5.0)
    p.add_argument("--max-tokens-per-forward", type=int, default=512)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--ready-file", default="")
    return p


def _stage(args, spec: str, keypair):
    from inference.model.checkpoint import read_config  # noqa: PLC0415
    from inference.swarm.stage import StageLimits  # noqa: PLC0415

    parts = spec.split(":")
    if len(parts) < 3 or (parts[1] != "honest" and parts[1] not in CHEATS) \
            or any(d not in _DTYPES for d in parts[3:5]):
        raise SystemExit(f"--stage {spec!r}: expected NAME:KIND:A-B[:DTYPE[:WIRE]], KIND honest or one of "
                         f"{sorted(CHEATS)}, dtypes {sorted(_DTYPES)}")
    name, kind, layers = parts[:3]
    dtype, wire = (parts[3:] + ["float32", "float32"])[:2] if len(parts) > 3 else ("float32", "float32")
    limits = StageLimits(max_tokens_per_forward=args.max_tokens_per_forward)
    rng = LayerRange.parse(layers, read_config(args.checkpoint).num_layers)
    if kind == "honest":
        stage = Stage.from_checkpoint(args.checkpoint, rng, _DTYPES[dtype], limits)
    else:
        kw = {"session-liar": {"one_in": args.one_in}, "long-position-liar": {"from_position": args.from_position},
              "forwarder": {"forward_to": tuple(args.forward_to), "keypair": keypair},
              "driver-aware": {"watched": tuple(args.watched)},
              "pair-cover": {"cover": args.cover},
              "late-switch": {"honest_forwards": args.honest_forwards}}.get(kind, {})
        if len(parts) <= 3 and kind in CHEAT_DEFAULT_DTYPES:
            dtype, wire = CHEAT_DEFAULT_DTYPES[kind]
        stage = CHEATS[kind].from_checkpoint(args.checkpoint, rng, _DTYPES[dtype], limits, **kw)
    return name, kind, stage, wire


async def serve(args) -> None:
    import bittensor as bt  # noqa: PLC0415

    from neurons.stage_miner import announce, announcement_for, serve_until_signalled  # noqa: PLC0415
    from neurons.swarm.stage_server import StageServerSettings  # noqa: PLC0415

    if args.port and len(args.stage) != 1:
        raise SystemExit("--port takes one --stage")
    servers, info = [], {}
    for spec in args.stage:
        wallet = bt.Wallet(spec.split(":")[0], "default", path=os.path.expanduser(args.wallet_path))
        name, kind, stage, wire = _stage(args, spec, wallet.hotkey)
        settings = StageServerSettings(host=args.host, port=args.port, hop_timeout_s=args.hop_timeout_s,
                                       wire_dtype=wire)
        if kind == "ledger-liar":
            twin = Stage.from_checkpoint(args.checkpoint, stage.layers, _DTYPES[stage.numerics])
            server = LyingLedgerServer(stage, wallet.hotkey, settings, twin)
        else:
            server = CHEAT_SERVERS.get(kind, StageServer)(stage, wallet.hotkey, settings)
        server.warm_up()
        await server.start()
        servers.append(server)
        if args.network:
            from chain import connect  # noqa: PLC0415

            async with connect(args.network) as chain:
                await announce(chain, wallet, args.netuid, args.host, server.port,
                               announcement_for(args.checkpoint, stage))
        info[name] = {"url": server.url, "hotkey": server.hotkey, "pid": os.getpid(), "layers": str(stage.layers),
                      "fingerprint": stage.fingerprint, "step_ms": stage.decode_ms, "kind": kind}
    await serve_until_signalled(next(iter(info.values())) if len(info) == 1 else info, args.ready_file)
    for server in servers:
        await server.close()


def start_hosts(checkpoint, wallet_path, hosts: dict[str, list[str]], run_dir, extra: dict[str, list[str]] = {},
                timeout_s: float = 240.0, threads: int = 1) -> tuple[dict, dict]:
    """Start one stage host process per entry of `hosts` (name -> its --stage specs, plus `extra[name]`
    arguments), all at once, and wait until each listens; (processes, {stage name: its ready info}). The
    caller stops them with `stop_hosts`. Logs go to run_dir/NAME.log."""
    import subprocess  # noqa: PLC0415

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs, info = {}, {}
    try:
        for name, specs in hosts.items():
            ready = Path(run_dir) / f"{name}.ready"
            cmd = [sys.executable, "-m", "localnet.cheats.stage", "--checkpoint", str(checkpoint), "--wallet-path",
                   str(wallet_path), "--threads", str(threads), "--ready-file", str(ready)]
            cmd += [a for spec in specs for a in ("--stage", spec)] + list(extra.get(name, []))
            log = Path(run_dir) / f"{name}.log"
            procs[name] = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
        deadline = time.monotonic() + timeout_s
        for name, specs in hosts.items():
            ready, log = Path(run_dir) / f"{name}.ready", Path(run_dir) / f"{name}.log"
            while not ready.exists():
                if procs[name].poll() is not None:
                    raise RuntimeError(f"stage host {name} exited: {log.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"stage host {name} not ready in {timeout_s} s")
                time.sleep(0.2)
            got = json.loads(ready.read_text())
            info.update({specs[0].split(":")[0]: got} if len(specs) == 1 else got)
    except BaseException:
        stop_hosts(procs)
        raise
    return procs, info


def stop_hosts(procs: dict) -> None:
    """SIGTERM every process still running (SIGCONT first: a test may have stopped one), then wait; SIGKILL
    what does not end within 10 s."""
    import subprocess  # noqa: PLC0415

    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.terminate()
    for p in procs.values():
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
