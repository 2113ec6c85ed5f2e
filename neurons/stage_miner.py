"""`python -m neurons.stage_miner --checkpoint DIR --serve-layers A-B ...`: serve one layer block.

(Also `python neurons/miner.py --serve-layers A-B ...` / `k3-miner --serve-layers A-B ...`.) Loads only the
block's tensors (onto --device: cpu, cuda or cuda:N; bf16 there unless --dtype says otherwise), measures its
single-token step time, and serves the stage wire on --host/--port, signed
with the wallet's hotkey (btcli's -w/-H/--wallet-path, BT_WALLET...). Every flag can also be set by the
environment variable shown in --help; a flag wins. With --ready-file it writes {"url", "hotkey", "pid",
"layers", "fingerprint", "step_ms", "metrics_url"} there once it listens (for scripts and tests that start
it with --port 0). With --metrics, Prometheus metrics on 127.0.0.1:--metrics-port. SIGTERM/SIGINT stop it.

With --network and --netuid it announces itself on that chain (its hotkey must be registered there): its
endpoint (ServeAxon: --external-ip/--external-port, default the listening address) and, as its hotkey's
commitment, a `StageAnnouncement` naming the model (config hash and checkpoint fingerprint), its layer block and
its stage fingerprint; route drivers find it from these (`MetagraphDirectory`). An identical entry already on
chain is left as it is (no quota spent); a rate-limited re-publish keeps the old one and says so.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch

from chain import connect
from chain.interface import ChainConnectionError, ChainError, RateLimited
from inference.model import resolve_device, resolve_dtype
from inference.model.checkpoint import CheckpointError, fingerprint, read_config
from inference.swarm.stage import LayerRange, Stage
from neurons.base.observability import MetricsServer, setup_logging
from neurons.base.settings import WalletSettings, describe_values, open_wallet, program_name
from neurons.swarm.settings import StageMinerSettings, read_stage_miner_settings, stage_miner_options
from neurons.swarm.stage_server import StageServer, StageServerSettings
from protocol.stage import StageAnnouncement

log = logging.getLogger("k3.stage_miner")


def _local(host: str) -> str:
    """An address this machine reaches a listener bound to `host` at."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def load_wallet(settings: WalletSettings):
    """The wallet, with its hotkey opened (a SystemExit naming the key when it cannot be)."""
    try:
        wallet = open_wallet(settings)
        wallet.hotkey
    except Exception as e:  # noqa: BLE001 (the SDK raises several kinds for a missing/locked key)
        raise SystemExit(f"stage_miner: cannot open hotkey {settings.name}/{settings.hotkey} under "
                         f"{settings.path}: {e}") from None
    return wallet


def announcement_for(checkpoint, stage: Stage) -> StageAnnouncement:
    try:
        model = fingerprint(checkpoint)
    except CheckpointError:  # no manifest: the config hash alone names the model
        model = ""
    return StageAnnouncement(config_hash=stage.config.config_hash(), model_fingerprint=model,
                             start=stage.layers.start, stop=stage.layers.stop, fingerprint=stage.fingerprint)


async def announce(chain, wallet, netuid: int, ip: str, port: int, announcement: StageAnnouncement) -> None:
    """Publish the endpoint and the announcement unless the chain already holds exactly these."""
    hotkey = wallet.hotkey.ss58_address
    me = (await chain.metagraph(netuid)).by_hotkey(hotkey)
    if me is None:
        raise SystemExit(f"stage_miner: hotkey {hotkey} is not registered on subnet {netuid}")
    if me.endpoint is None or (me.endpoint.ip, me.endpoint.port) != (ip, port):
        try:
            await chain.publish_endpoint(wallet, netuid, ip, port)
        except RateLimited as e:
            log.warning("endpoint not re-published (%s); the chain keeps %s", e, me.endpoint)
    text = announcement.text()
    current = (await chain.commitments(netuid)).get(hotkey)
    if current is None or current.data != text:
        try:
            await chain.publish_commitment(wallet, netuid, text)
        except RateLimited as e:
            log.warning("announcement not re-published (%s); the chain keeps %r", e, current and current.data)


ANNOUNCE_RETRY_S = 60.0  # how long a stage miner retries announcing through a chain that does not answer


async def announce_until_done(network: str, wallet, netuid: int, ip: str, port: int,
                              announcement: StageAnnouncement, retry_s: float = ANNOUNCE_RETRY_S) -> None:
    """`announce`, retried with backoff while the chain cannot be reached (a node restarting, RPC errors), for up to
    retry_s; other chain errors (not registered, refused) end the stage miner at once."""
    deadline, wait = time.monotonic() + retry_s, 1.0
    while True:
        try:
            async with connect(network) as chain:
                await announce(chain, wallet, netuid, ip, port, announcement)
            return
        except ChainConnectionError as e:
            if time.monotonic() + wait > deadline:
                raise
            log.warning("the chain did not answer (%s); announcing again in %.0f s", e, wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, 10.0)


async def run(settings: StageMinerSettings) -> None:
    b = settings.block
    config = read_config(b.checkpoint)
    layers = LayerRange.parse(b.serve_layers, config.num_layers)
    device = "cuda" if b.device == "cuda" and b.shard_ranks > 1 else resolve_device(b.device)
    stage = Stage.from_checkpoint(b.checkpoint, layers, resolve_dtype(b.dtype, resolve_device(b.device)), b.limits(),
                                  shard_ranks=b.shard_ranks, threads_per_rank=b.threads or None,
                                  shard_mode=b.shard_mode, device=device)
    try:
        await serve_stage(settings, stage)
    finally:
        stage.shutdown()


async def serve_stage(settings: StageMinerSettings, stage: Stage) -> None:
    b, s, c = settings.block, settings.server, settings.chain
    layers = stage.layers
    wallet = load_wallet(settings.wallet)
    readers = ValidatorReaders(c.network, c.netuid) if c.network else None
    server = StageServer(stage, wallet.hotkey, StageServerSettings(
        host=s.host, port=s.port, public_url=s.public_url, max_body_bytes=s.max_body_bytes,
        hop_timeout_s=s.hop_timeout_s, wire_dtype=b.wire_dtype, retain_s=s.ledger_retain_s,
        ledger_bytes=s.ledger_bytes), ledger_readers=readers)
    server.warm_up()
    await server.start()
    metrics = None
    try:
        if s.metrics:
            metrics = MetricsServer(lambda: [server.metrics.registry], s.metrics_host, s.metrics_port,
                                    component="stage-metrics")
            await metrics.start()
        if c.network:
            port = s.external_port or server.port
            await announce_until_done(c.network, wallet, c.netuid, s.external_ip or s.host, port,
                                      announcement_for(b.checkpoint, stage))
            await readers.start()
        info = {"url": server.url, "hotkey": server.hotkey, "pid": os.getpid(), "layers": str(layers),
                "fingerprint": stage.fingerprint, "step_ms": stage.decode_ms,
                "shard_pids": sorted(stage.model.pids.values()) if stage.sharded else [],
                "shard_layout": stage.shard_layout(),
                "metrics_url": f"http://{_local(s.metrics_host)}:{metrics.port}/metrics" if metrics else None}
        log.info("stage %s (layers %s) serving on %s%s", server.hotkey, layers, server.url,
                 f"; metrics on {info['metrics_url']}" if metrics else "")
        await serve_until_signalled(info, s.ready_file)
    finally:
        if readers is not None:
            await readers.close()
        if metrics is not None:
            await metrics.close()
        await server.close()


class ValidatorReaders:
    """Who may read the stage's ledger: the subnet's validators (a validator permit on chain), from a metagraph
    re-read every `refresh_s`, and at once (at most every `stale_s`) when a caller it does not know asks; until
    the first read, nobody."""

    def __init__(self, network: str, netuid: int, refresh_s: float = 60.0, stale_s: float = 5.0):
        self.network, self.netuid, self.refresh_s, self.stale_s = network, netuid, refresh_s, stale_s
        self.hotkeys: frozenset[str] = frozenset()
        self._task: asyncio.Task | None = None
        self._read_at = 0.0
        self._pending: asyncio.Task | None = None

    def __call__(self, hotkey: str) -> bool:
        if hotkey not in self.hotkeys and time.monotonic() - self._read_at > self.stale_s and \
                (self._pending is None or self._pending.done()):
            self._pending = asyncio.create_task(self._refresh())  # a new validator: known for its next ask
        return hotkey in self.hotkeys

    async def start(self) -> None:
        await self._refresh()
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _refresh(self) -> None:
        self._read_at = time.monotonic()
        try:
            async with connect(self.network) as chain:
                meta = await asyncio.wait_for(chain.metagraph(self.netuid), 30.0)
            self.hotkeys = frozenset(n.hotkey for n in meta.validators)
        except (ChainError, asyncio.TimeoutError, OSError) as e:  # keep the last list: a validator stays a reader
            log.warning("could not re-read the subnet's validators (ledger readers): %s", e)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self._refresh()


async def serve_until_signalled(info: dict, ready_file: str) -> None:
    """Say the process serves (`info` as JSON on stdout, and atomically in `ready_file` when given), then wait
    for SIGTERM or SIGINT."""
    if ready_file:
        tmp = Path(ready_file).with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(ready_file)
    print(json.dumps(info), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The stage miner; `prog` names it in usage and error lines (the miner's entry point passes its own)."""
    prog = prog or program_name("k3-miner", "neurons.stage_miner")
    settings = read_stage_miner_settings(argv, prog=prog, description=__doc__)
    problems = settings.problems()
    if problems:
        for problem in problems:
            print(f"{prog}: error: {problem}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    log.debug("settings: %s", describe_values(stage_miner_options(), dataclasses.asdict(settings)))
    if settings.block.threads:
        torch.set_num_threads(settings.block.threads)
    try:
        asyncio.run(run(settings))
    except (CheckpointError, ChainError, ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
