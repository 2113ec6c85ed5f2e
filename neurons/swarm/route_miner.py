"""`python -m neurons.swarm.route_miner --network devnet:PATH --netuid N --checkpoint DIR ...`: one Kimi K3 served
over a route of stage miners, behind the signed miner protocol.

A `RouteDriver` finds the subnet's stage miners from the chain (`MetagraphDirectory`: their commitments announce
model and layer block, their axons say where) and a `RouteEngine` serves generate / score across them, so
validators and the gateway talk to it as to any whole-model miner. The checkpoint directory is read for the
config and the tokenizer only (no weights are loaded). It publishes its own endpoint like a miner, and takes the
miner's wallet, chain, server and validator flags (btcli's -w/-H/--wallet-path, -n/--network, --netuid, BT_*;
its own settings from K3_ROUTE_*; --help lists each with its variable). With --metrics, the miner's Prometheus
metrics on 127.0.0.1:--metrics-port. With --ready-file it writes {"url", "hotkey", "pid", "route", "health"}
there once it serves. SIGTERM/SIGINT stop it.
"""
from __future__ import annotations

import dataclasses
import os
import sys

from chain import connect
from chain.interface import ChainError
from inference.model.checkpoint import CheckpointError, fingerprint, read_config
from inference.model.tokenizer import load_tokenizer
from neurons.miner_app import MinerServer
from neurons.observability import run_neuron
from neurons.settings import describe_values, open_wallet, program_name
from neurons.swarm.route import MetagraphDirectory, RouteDriver, RouteEngine
from neurons.swarm.settings import RouteMinerSettings, read_route_miner_settings, route_miner_options
from neurons.swarm.stage_miner import serve_until_signalled
from protocol.auth import SQLiteNonceStore

MODULE = "neurons.swarm.route_miner"


def speculation_config(drafter: str, draft_tokens: int):
    # imported here: inference.speculative and inference.serving import each other, serving must come first
    from inference.speculative.speculation import SpeculationConfig  # noqa: PLC0415

    return SpeculationConfig(drafter=drafter, max_draft_tokens=draft_tokens)


async def run(settings: RouteMinerSettings) -> int:
    r, c = settings.route, settings.chain
    config = read_config(r.checkpoint)
    try:
        model_fp = fingerprint(r.checkpoint)
    except CheckpointError:
        model_fp = ""
    miner_settings = settings.miner_settings()
    wallet = open_wallet(settings.wallet)
    chain = connect(c.network)
    nonce_store = SQLiteNonceStore(os.path.expanduser(settings.server.nonce_store))
    try:
        directory = MetagraphDirectory(chain, c.netuid, config_hash=config.config_hash(),
                                       model_fingerprint=model_fp or None)
        driver = RouteDriver(directory, wallet.hotkey, config, host=settings.server.host,
                             hop_timeout_s=r.hop_timeout_s, refresh_s=c.metagraph_refresh_s)
        engine = RouteEngine(driver, load_tokenizer(r.checkpoint, config), model_fingerprint=model_fp,
                             max_context=r.max_context, max_concurrent=r.max_concurrent,
                             prefill_chunk=r.prefill_chunk,
                             speculation=speculation_config(r.speculate, r.draft_tokens))
        server = MinerServer(miner_settings, engine=engine, tokenizer=engine.tokenizer, chain=chain, wallet=wallet,
                             nonce_store=nonce_store)
        await server.start()
        try:
            info = {"url": server.url, "hotkey": wallet.hotkey.ss58_address, "pid": os.getpid(),
                    "route": [s.describe() for s in driver.current], "health": engine.health().status}
            if server.metrics_port:
                info["metrics_url"] = f"http://127.0.0.1:{server.metrics_port}/metrics"
            await serve_until_signalled(info, r.ready_file)
        finally:
            await server.close(grace_s=0.0)
    finally:
        await chain.close()
        nonce_store.close()
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    prog = prog or program_name(f"python -m {MODULE}", MODULE)
    settings = read_route_miner_settings(argv, prog=prog, description=__doc__)
    problems = settings.problems()
    for problem in problems:
        print(f"{prog}: error: {problem}", file=sys.stderr)
    if problems:
        return 2
    return run_neuron(settings, lambda: run(settings), (CheckpointError, ChainError, ValueError, OSError),
                      "k3.route_miner", describe_values(route_miner_options(), dataclasses.asdict(settings)), prog)


if __name__ == "__main__":
    sys.exit(main())
