#!/usr/bin/env python3
"""Kimi K3 subnet miner: serves signed generations to the subnet's validators.

    python neurons/miner.py --network devnet:/tmp/k3/devnet.sqlite --netuid 1 \\
        --wallet-name miner --wallet-hotkey default --wallet-path ~/.bittensor/wallets \\
        --engine reference --checkpoint ckpt/tiny --host 0.0.0.0 --port 8091 --external-ip 203.0.113.7

Every flag can also be set by the environment variable shown in --help; a flag wins over the
environment. SIGINT or SIGTERM stops it cleanly (a second one ends open streams at once).

    python neurons/miner.py --serve-layers 0-5 --checkpoint ckpt/tiny ...   (a swarm stage miner; with --network
        and --netuid it announces its endpoint and layer block on chain, see neurons/stage_miner.py)
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neurons.base.observability import run_neuron  # noqa: E402
from neurons.base.settings import describe_values, program_name  # noqa: E402
from neurons.miner_app import MinerSetupError, miner_options, read_miner_settings, serve  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--serve-layers" or a.startswith("--serve-layers=") for a in argv):
        # a swarm stage miner: one block of layers (neurons/stage_miner.py lists its flags)
        from neurons.stage_miner import main as stage_main  # noqa: PLC0415

        return stage_main(argv, prog=program_name("k3-miner", "neurons.miner"))
    settings, _ = read_miner_settings(argv, prog=program_name("k3-miner", "neurons.miner"), description=__doc__)
    return run_neuron(settings, lambda: serve(settings), MinerSetupError, "k3.miner",
                      describe_values(miner_options(), dataclasses.asdict(settings)))


if __name__ == "__main__":
    sys.exit(main())
