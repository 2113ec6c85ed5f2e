"""`python -m neurons.swarm.stage_miner --checkpoint DIR --serve-layers A-B ...`: serve one layer block.

Loads only the block's tensors, measures its single-token step time, and serves the stage wire on
--host/--port, signed with the wallet's hotkey. With --ready-file it writes {"url", "hotkey", "pid",
"layers", "fingerprint"} there once it listens (for scripts and tests that start it with --port 0).
SIGTERM/SIGINT stop it.

With --network and --netuid it announces itself on that chain (its hotkey must be registered there): its
endpoint (ServeAxon: --external-ip/--external-port, default the listening address) and, as its hotkey's
commitment, a `StageAnnouncement` naming the model (config hash and checkpoint fingerprint), its layer block and
its stage fingerprint; route drivers find it from these (`MetagraphDirectory`). An identical entry already on
chain is left as it is (no quota spent); a rate-limited re-publish keeps the old one and says so.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

import torch

from chain.interface import ChainError, RateLimited
from inference.model.checkpoint import CheckpointError, fingerprint, read_config
from inference.swarm.stage import LayerRange, Stage, StageLimits
from neurons.swarm.stage_server import StageServer, StageServerSettings
from protocol.stage import DEFAULT_MAX_BODY_BYTES, StageAnnouncement

log = logging.getLogger("k3.stage_miner")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stage_miner", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (only the block's tensors are read)")
    p.add_argument("--serve-layers", required=True, help="inclusive layer range A-B (0 includes the embedding, "
                                                         "the last layer the head)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--public-url", default="", help="URL others reach this stage at (default http://host:port)")
    p.add_argument("--network", default="", help="chain to announce on (devnet:PATH, local, finney, ws://...); "
                                                  "empty: announce nothing")
    p.add_argument("--netuid", type=int, default=None)
    p.add_argument("--external-ip", default="", help="IP published on chain (default: --host)")
    p.add_argument("--external-port", type=int, default=0, help="port published on chain (default: the listening one)")
    p.add_argument("--wallet-name", default="default")
    p.add_argument("--wallet-hotkey", default="default")
    p.add_argument("--wallet-path", default="~/.bittensor/wallets")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--wire-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--max-sessions", type=int, default=16)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--max-tokens-per-forward", type=int, default=512)
    p.add_argument("--idle-expiry-s", type=float, default=300.0)
    p.add_argument("--max-snapshots", type=int, default=16, help="KDA state snapshots kept per session (rewind)")
    p.add_argument("--rewind-window", type=int, default=1024, help="positions of recorded inputs kept per session")
    p.add_argument("--hop-timeout-s", type=float, default=5.0)
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    p.add_argument("--ready-file", default="")
    p.add_argument("--log-level", default="WARNING")
    return p


def load_wallet(args):
    """The wallet, with its hotkey opened (a SystemExit naming the key when it cannot be)."""
    import bittensor as bt  # noqa: PLC0415 (slow import)

    wallet = bt.Wallet(args.wallet_name, args.wallet_hotkey, path=os.path.expanduser(args.wallet_path))
    try:
        wallet.hotkey
    except Exception as e:  # noqa: BLE001 (the SDK raises several kinds for a missing/locked key)
        raise SystemExit(f"stage_miner: cannot open hotkey {args.wallet_name}/{args.wallet_hotkey} under "
                         f"{args.wallet_path}: {e}") from None
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


async def run(args) -> None:
    config = read_config(args.checkpoint)
    layers = LayerRange.parse(args.serve_layers, config.num_layers)
    limits = StageLimits(max_sessions=args.max_sessions, max_context=args.max_context,
                         max_tokens_per_forward=args.max_tokens_per_forward, idle_expiry_s=args.idle_expiry_s,
                         max_snapshots=args.max_snapshots, rewind_window=args.rewind_window)
    stage = Stage.from_checkpoint(args.checkpoint, layers, _DTYPES[args.dtype], limits)
    wallet = load_wallet(args)
    server = StageServer(stage, wallet.hotkey, StageServerSettings(
        host=args.host, port=args.port, public_url=args.public_url, max_body_bytes=args.max_body_bytes,
        hop_timeout_s=args.hop_timeout_s, wire_dtype=args.wire_dtype))
    server.warm_up()
    await server.start()
    if args.network:
        from chain import connect  # noqa: PLC0415

        port = args.external_port or server.port
        async with connect(args.network) as chain:
            await announce(chain, wallet, args.netuid, args.external_ip or args.host, port,
                           announcement_for(args.checkpoint, stage))
    info = {"url": server.url, "hotkey": server.hotkey, "pid": os.getpid(), "layers": str(layers),
            "fingerprint": stage.fingerprint, "step_ms": stage.decode_ms}
    await serve_until_signalled(info, args.ready_file)
    await server.close()


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


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.network and args.netuid is None:
        p.error("--network needs --netuid")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        asyncio.run(run(args))
    except (CheckpointError, ChainError, ValueError) as e:
        print(f"stage_miner: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
