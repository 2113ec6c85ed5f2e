"""Chain access for neurons and scripts: one interface (`Chain`), two implementations.

`connect("devnet:PATH")` opens the embedded devnet; `connect("finney" | "test" | "local" | "ws://...")`
opens a subtensor node through the bittensor SDK 11.
"""
from chain.interface import (  # noqa: F401
    AlreadyRegistered,
    Chain,
    ChainConnectionError,
    ChainError,
    Endpoint,
    Hyperparameters,
    InvalidWeights,
    MetagraphSnapshot,
    NeuronInfo,
    NoValidatorPermit,
    NotEnoughStake,
    NotRegistered,
    RateLimited,
    RegistrationFailed,
    SetWeightsOutcome,
    SubnetNotFound,
    connect,
)
