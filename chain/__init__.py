"""Chain access for neurons and scripts: one interface (`Chain`), two implementations.

`connect("devnet:PATH")` opens the embedded devnet; `connect("finney" | "test" | "local" | "ws://...")`
opens a subtensor node through the bittensor SDK 11.
"""
from chain.interface import (AlreadyRegistered, Chain, ChainConnectionError, ChainError, Endpoint,  # noqa: F401
                             Hyperparameters, InvalidWeights, MetagraphSnapshot, NeuronInfo, NotEnoughStake,
                             NotRegistered, NoValidatorPermit, RateLimited, RegistrationFailed, SetWeightsOutcome,
                             SubnetNotFound, connect)
