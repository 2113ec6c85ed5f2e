"""Chain access for neurons and scripts: one interface (`Chain`), two implementations.

`connect("devnet:PATH")` opens the embedded devnet; `connect("finney" | "test" | "local" | "ws://...")`
opens a subtensor node through the bittensor SDK 11.
"""
from chain.interface import (AlreadyRegistered, Chain, ChainConnectionError, ChainError, Endpoint,  # noqa: F401
                             Hyperparameters, InvalidWeights, MetagraphSnapshot, NeuronInfo, NotEnoughStake,
                             NotRegistered, NoValidatorPermit, RateLimited, RegistrationFailed, SetWeightsOutcome,
                             SubnetNotFound)


def connect(spec: str, **kwargs) -> Chain:
    """Open a chain by name: `devnet:PATH` (embedded SQLite devnet), or `finney`, `test`,
    `local`, `ws://...`/`wss://...` (a subtensor node through the bittensor SDK). Each implementation is
    imported when asked for, so a devnet user never loads the SDK's substrate client."""
    if spec.startswith("devnet:"):
        from chain.devnet import DevnetChain

        return DevnetChain(spec[len("devnet:"):], **kwargs)
    if spec in ("finney", "test", "local") or spec.startswith(("ws://", "wss://")):
        from chain.subtensor import SubtensorChain

        return SubtensorChain(spec, **kwargs)
    raise ValueError(
        f"unknown chain {spec!r}: use devnet:PATH, finney, test, local, or a ws:// / wss:// URL"
    )
