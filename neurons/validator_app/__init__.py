"""The validator: settings, rounds (measure, verify, score, set weights), the weights policy, the
SQLite store and the status report."""
from neurons.validator_app.rounds import (CpuStats, MinerRound, RankedMiner, RoundReport, Validator, ValidatorLoop,
                                          ValidatorState, build_validator, reference_capabilities, run_validator)
from neurons.validator_app.settings import (SCORING_PROFILES, AuditSettings, RoundSettings, ScoringSettings,
                                            ValidatorSettings, ValidatorSetupError, WeightSettings,
                                            read_validator_settings, validator_options)
from neurons.validator_app.status import STATUS_COLUMNS, status_report
from neurons.validator_app.store import LastWeights, StoredMiner, ValidatorStore, ValidatorStoreError
from neurons.validator_app.weights import submitted_weights

__all__ = [
    "CpuStats", "MinerRound", "RankedMiner", "RoundReport", "Validator", "ValidatorLoop", "ValidatorState",
    "build_validator", "reference_capabilities", "run_validator",
    "SCORING_PROFILES", "AuditSettings", "RoundSettings", "ScoringSettings", "ValidatorSettings",
    "ValidatorSetupError", "WeightSettings", "read_validator_settings", "validator_options",
    "STATUS_COLUMNS", "status_report",
    "LastWeights", "StoredMiner", "ValidatorStore", "ValidatorStoreError",
    "submitted_weights",
]
