"""The validator: settings, rounds (measure, verify, score, set weights), the SQLite store and the status
report. What is audited and what weights are set are scoring's (scoring.audit_sequence, scoring.weights)."""
from neurons.validator_app.rounds import (CpuStats, MinerRound, RankedMiner, RoundReport, Validator, ValidatorLoop,
                                          ValidatorState, build_validator, reference_capabilities, run_validator)
from neurons.validator_app.settings import (SCORING_PROFILES, AuditSettings, RoundSettings, ScoringSettings,
                                            ValidatorSettings, ValidatorSetupError, WeightSettings,
                                            read_validator_settings, validator_options)
from neurons.validator_app.status import STATUS_COLUMNS, status_report
from neurons.validator_app.store import LastWeights, StoredMiner, ValidatorStore, ValidatorStoreError

__all__ = [
    "CpuStats", "MinerRound", "RankedMiner", "RoundReport", "Validator", "ValidatorLoop", "ValidatorState",
    "build_validator", "reference_capabilities", "run_validator",
    "SCORING_PROFILES", "AuditSettings", "RoundSettings", "ScoringSettings", "ValidatorSettings",
    "ValidatorSetupError", "WeightSettings", "read_validator_settings", "validator_options",
    "STATUS_COLUMNS", "status_report",
    "LastWeights", "StoredMiner", "ValidatorStore", "ValidatorStoreError",
]
