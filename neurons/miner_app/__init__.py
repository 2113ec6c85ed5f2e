"""The miner: settings, access control (the validator gate and caller budgets), metrics and the
signed HTTP server; `localnet.cheats.miner` holds the cheating engines tests use."""
from neurons.miner_app.access import (CallerBudget, CallerBudgets, Refusal, ValidatorAccess, engine_refusal,
                                      public_message, wire_code)
from neurons.miner_app.metrics import MinerMetrics
from neurons.miner_app.server import Admission, MinerServer, load_tokenizer_for, open_wallet, prompt_token_ids, serve
from neurons.miner_app.settings import (METRICS_HOST, AccessSettings, MinerSettings, MinerSetupError, ServerSettings,
                                        miner_options, read_miner_settings)

__all__ = [
    "CallerBudget", "CallerBudgets", "Refusal", "ValidatorAccess", "engine_refusal", "public_message", "wire_code",
    "MinerMetrics",
    "Admission", "MinerServer", "load_tokenizer_for", "open_wallet", "prompt_token_ids", "serve",
    "METRICS_HOST", "AccessSettings", "MinerSettings", "MinerSetupError", "ServerSettings", "miner_options",
    "read_miner_settings",
]
