"""`python -m neurons.swarm.stage_miner --checkpoint DIR --serve-layers A-B ...`: serve one layer block.

Loads only the block's tensors, measures its single-token step time, and serves the stage wire on
--host/--port, signed with the wallet's hotkey. With --ready-file it writes {"url", "hotkey", "pid",
"layers", "fingerprint"} there once it listens (for scripts and tests that start it with --port 0).
SIGTERM/SIGINT stop it.
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

from inference.model.checkpoint import CheckpointError, read_config
from inference.swarm.stage import LayerRange, Stage, StageLimits
from neurons.swarm.stage_server import StageServer, StageServerSettings
from protocol.stage import DEFAULT_MAX_BODY_BYTES

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


def load_hotkey(args):
    import bittensor as bt  # noqa: PLC0415 (slow import)

    wallet = bt.Wallet(args.wallet_name, args.wallet_hotkey, path=os.path.expanduser(args.wallet_path))
    try:
        return wallet.hotkey
    except Exception as e:  # noqa: BLE001 (the SDK raises several kinds for a missing/locked key)
        raise SystemExit(f"stage_miner: cannot open hotkey {args.wallet_name}/{args.wallet_hotkey} under "
                         f"{args.wallet_path}: {e}") from None


async def run(args) -> None:
    config = read_config(args.checkpoint)
    layers = LayerRange.parse(args.serve_layers, config.num_layers)
    limits = StageLimits(max_sessions=args.max_sessions, max_context=args.max_context,
                         max_tokens_per_forward=args.max_tokens_per_forward, idle_expiry_s=args.idle_expiry_s,
                         max_snapshots=args.max_snapshots, rewind_window=args.rewind_window)
    stage = Stage.from_checkpoint(args.checkpoint, layers, _DTYPES[args.dtype], limits)
    server = StageServer(stage, load_hotkey(args), StageServerSettings(
        host=args.host, port=args.port, public_url=args.public_url, max_body_bytes=args.max_body_bytes,
        hop_timeout_s=args.hop_timeout_s, wire_dtype=args.wire_dtype))
    server.warm_up()
    await server.start()
    info = {"url": server.url, "hotkey": server.hotkey, "pid": os.getpid(), "layers": str(layers),
            "fingerprint": stage.fingerprint, "step_ms": stage.decode_ms}
    if args.ready_file:
        tmp = Path(args.ready_file).with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(args.ready_file)
    print(json.dumps(info), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.close()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        asyncio.run(run(args))
    except (CheckpointError, ValueError) as e:
        print(f"stage_miner: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
