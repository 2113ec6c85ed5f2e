"""The local testnet: the whole subnet (devnet chain, miners, validator, gateway, optionally a swarm of stage
miners and a route miner) on one machine, and the cheaters it can field against the real validator
(localnet/cheats/). Tooling on top of the neurons; nothing of the neurons imports it."""
