"""The validator's settings and its flag table (the gateway's flags included)."""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from inference.serving import EngineSpec
from neurons.gateway.settings import GatewaySettings, gateway_options
from neurons.settings import (ChainSettings, Option, WalletSettings, bind_defaults, build_settings, chain_options,
                              engine_options, expanded_path, flag, logging_options, non_negative_int, optional_int,
                              optional_text, port_number, positive_float, read_options, wallet_options)
from protocol.client import ClientTimeouts
from scoring.config import ScoringConfig, ScoringConfigError

SCORING_PROFILES = ("production", "local_testnet")


class ValidatorSetupError(RuntimeError):
    """The validator cannot start as configured; the message says what to change."""


@dataclass(frozen=True)
class RoundSettings:
    interval_s: float = 60.0
    requests_per_miner: Optional[int] = None  # None: the scoring profile's round_requests
    concurrency: int = 64
    miner_concurrency: int = 8
    sample_size: int = 0  # 0: every serving miner each round
    miners_at_once: int = 0  # 0: every chosen miner at the same time
    deadline_s: float = 600.0
    capabilities_refresh_s: float = 600.0
    capabilities_timeout_s: float = 10.0
    max_rounds: int = 0  # 0: run until stopped
    seed: Optional[int] = None  # None: unpredictable workloads (production)
    uids: Optional[str] = None  # "3,5": evaluate only these uids (debugging one miner); None: all
    stage_challenges: int = 2  # per swarm stage miner per round (needs --reference-engine); 0: no stage checks


    def only_uids(self) -> Optional[set[int]]:
        if not self.uids:
            return None
        try:
            return {int(part) for part in self.uids.split(",") if part.strip()}
        except ValueError:
            raise ValidatorSetupError(f"--uids {self.uids!r} must be comma-separated integers, e.g. 3,5") from None


@dataclass(frozen=True)
class AuditSettings:
    rate: Optional[float] = None  # None: the scoring profile's
    rate_new: Optional[float] = None
    canary_pool: Optional[str] = None
    canaries: int = 64
    timeout_s: float = 120.0  # one tier-1 audit on the reference; past it the audit reaches no verdict


@dataclass(frozen=True)
class ScoringSettings:
    profile: str = "production"
    overrides: Optional[str] = None  # JSON object of ScoringConfig fields


@dataclass(frozen=True)
class WeightSettings:
    enabled: bool = True
    check_s: float = 12.0
    retry_s: float = 2.0
    retry_max_s: float = 120.0


@dataclass(frozen=True)
class ValidatorSettings:
    chain: ChainSettings = field(default_factory=ChainSettings)
    wallet: WalletSettings = field(default_factory=WalletSettings)
    engine: EngineSpec = field(default_factory=EngineSpec)
    reference_engine: bool = False
    db: str = "~/.k3-subnet/validator.sqlite"
    rounds: RoundSettings = field(default_factory=RoundSettings)
    timeouts: ClientTimeouts = field(default_factory=ClientTimeouts)  # every call to a miner
    audits: AuditSettings = field(default_factory=AuditSettings)
    scoring: ScoringSettings = field(default_factory=ScoringSettings)
    weights: WeightSettings = field(default_factory=WeightSettings)
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    metrics: bool = True
    metrics_port: int = 9092
    log_level: str = "INFO"
    log_format: str = "text"

    def scoring_config(self) -> ScoringConfig:
        """The profile, then --scoring-overrides, then the explicit round and audit flags."""
        if self.scoring.profile not in SCORING_PROFILES:
            raise ValidatorSetupError(f"--scoring-profile {self.scoring.profile!r} is not one of {SCORING_PROFILES}")
        changes: dict[str, Any] = {}
        if self.scoring.overrides:
            try:
                changes = json.loads(self.scoring.overrides)
            except json.JSONDecodeError as error:
                raise ValidatorSetupError(f"--scoring-overrides is not JSON: {error}") from None
            if not isinstance(changes, dict):
                raise ValidatorSetupError("--scoring-overrides must be a JSON object of ScoringConfig fields")
            known = set(ScoringConfig.__dataclass_fields__)
            unknown = sorted(set(changes) - known)
            if unknown:
                raise ValidatorSetupError(f"--scoring-overrides names unknown fields {unknown}; see scoring/config.py")
            changes = {k: tuple(v) if isinstance(v, list) else v for k, v in changes.items()}
        for name, value in (("round_requests", self.rounds.requests_per_miner), ("audit_rate", self.audits.rate),
                            ("audit_rate_new_or_suspect", self.audits.rate_new)):
            if value is not None:
                changes[name] = value
        try:
            if self.scoring.profile == "local_testnet":
                return ScoringConfig.local_testnet(**changes)
            return ScoringConfig(**changes)
        except (ScoringConfigError, TypeError) as error:
            raise ValidatorSetupError(str(error)) from None

    def problems(self) -> list[str]:
        out = list(self.gateway.problems())
        if not self.engine.checkpoint:
            out.append("--checkpoint is required: the model's checkpoint directory (config.json, tokenizer, "
                       "k3_manifest.json; the weights too with --reference-engine)")
        elif not (Path(self.engine.checkpoint) / "config.json").exists():
            out.append(f"--checkpoint {self.engine.checkpoint} has no config.json; make one with "
                       "scripts/make_checkpoint.py or point it at the model's directory")
        if self.reference_engine:
            out += [p for p in self.engine.problems() if "checkpoint" not in p]
        r, w = self.rounds, self.weights
        try:
            r.only_uids()
        except ValidatorSetupError as error:
            out.append(str(error))
        if r.concurrency < 1 or r.miner_concurrency < 1:
            out.append("--concurrency and --miner-concurrency must be at least 1")
        if r.requests_per_miner is not None and r.requests_per_miner < 1:
            out.append("--requests-per-miner must be at least 1")
        for name, value in (("--audit-rate", self.audits.rate), ("--audit-rate-new", self.audits.rate_new)):
            if value is not None and not 0 <= value <= 1:
                out.append(f"{name} must lie in [0, 1], got {value}")
        if self.audits.canary_pool and not Path(self.audits.canary_pool).exists():
            out.append(f"--canary-pool {self.audits.canary_pool} does not exist")
        if not 0 <= self.chain.netuid <= 65535:
            out.append(f"--netuid {self.chain.netuid} is not a netuid (0..65535)")
        if w.retry_max_s < w.retry_s:
            out.append("--weights-retry-max-s must be at least --weights-retry-s")
        try:
            self.scoring_config()
        except ValidatorSetupError as error:
            out.append(str(error))
        return out


def validator_options() -> tuple[Option, ...]:
    p = "K3_VALIDATOR_"
    g_round, g_time, g_audit, g_weights = "rounds", "timeouts", "verification", "weights"
    return bind_defaults(ValidatorSettings, wallet_options() + chain_options() + engine_options("K3_REFERENCE_")
                         + gateway_options() + (
        Option("reference_engine", "--reference-engine", f"{p}REFERENCE_ENGINE", flag,
               "run the model from --checkpoint (or --engine remote/sharded) as this validator's own reference "
               "for tier-1 audits and tier-2 canaries; without it audits go to two other miners on different "
               "coldkeys", group="engine"),
        Option("db", "--db", f"{p}DB", expanded_path,
               "SQLite file of everything the validator learns (measurements, audits, failures, EMA, weights); "
               "a restart resumes from it", group="store", metavar="FILE"),
        Option("rounds.interval_s", "--round-interval-s", f"{p}ROUND_INTERVAL_S", positive_float,
               "seconds from the start of one round to the start of the next (a longer round is followed at once)",
               group=g_round),
        Option("rounds.requests_per_miner", "--requests-per-miner", f"{p}REQUESTS_PER_MINER", optional_int,
               "requests per miner per round (a burst of N streams counts N); default: the scoring profile's",
               group=g_round),
        Option("rounds.concurrency", "--concurrency", f"{p}CONCURRENCY", int,
               "requests in flight at once over all miners", group=g_round),
        Option("rounds.miner_concurrency", "--miner-concurrency", f"{p}MINER_CONCURRENCY", int,
               "requests in flight at once to one miner (never above its declared capacity; a burst may use it all)",
               group=g_round),
        Option("rounds.sample_size", "--sample-size", f"{p}SAMPLE_SIZE", non_negative_int,
               "miners evaluated per round, least recently evaluated first (0: all serving miners)", group=g_round),
        Option("rounds.miners_at_once", "--miners-at-once", f"{p}MINERS_AT_ONCE", non_negative_int,
               "miners evaluated at the same time (0: all of a round's miners together); fewer keeps miners that "
               "share one machine, as on a local testnet, from slowing each other down", group=g_round),
        Option("rounds.deadline_s", "--round-deadline-s", f"{p}ROUND_DEADLINE_S", positive_float,
               "a miner's requests must all end within this many seconds of its evaluation starting (all "
               "start together unless --miners-at-once is set); what is still in flight then is cut and "
               "measured as a timeout", group=g_round),
        Option("rounds.capabilities_refresh_s", "--capabilities-refresh-s", f"{p}CAPABILITIES_REFRESH_S",
               positive_float, "how long a miner's /v1/capabilities answer is reused", group=g_round),
        Option("rounds.max_rounds", "--max-rounds", f"{p}MAX_ROUNDS", non_negative_int,
               "stop after this many rounds (0: run until SIGINT/SIGTERM)", group=g_round),
        Option("rounds.seed", "--seed", f"{p}SEED", optional_int,
               "seed of workloads and audit draws, for reproducible tests (unset: unpredictable, as production "
               "needs)", group=g_round),
        Option("rounds.uids", "--uids", f"{p}UIDS", optional_text,
               "comma-separated uids to evaluate, e.g. 3,5 (to debug a miner); the others keep their window "
               "scores (default: every serving miner)", group=g_round, metavar="UIDS"),
        Option("rounds.stage_challenges", "--stage-challenges", f"{p}STAGE_CHALLENGES", non_negative_int,
               "challenges per swarm stage miner per round, against this validator's own copy of the weights "
               "(with --reference-engine; plus one relayed route audit); 0: stage miners are not checked",
               group=g_round),
        Option("timeouts.connect", "--connect-timeout-s", f"{p}CONNECT_TIMEOUT_S", positive_float,
               "TCP connect to a miner", group=g_time),
        Option("timeouts.first_byte", "--first-byte-timeout-s", f"{p}FIRST_BYTE_TIMEOUT_S", positive_float,
               "from sending a request to its first event (covers the prefill)", group=g_time),
        Option("timeouts.between_events", "--between-events-timeout-s", f"{p}BETWEEN_EVENTS_TIMEOUT_S", positive_float,
               "longest silence between two events of a stream", group=g_time),
        Option("timeouts.total", "--request-timeout-s", f"{p}REQUEST_TIMEOUT_S", positive_float, "whole request",
               group=g_time),
        Option("rounds.capabilities_timeout_s", "--capabilities-timeout-s", f"{p}CAPABILITIES_TIMEOUT_S",
               positive_float, "a /v1/capabilities call", group=g_time),
        Option("audits.timeout_s", "--audit-timeout-s", f"{p}AUDIT_TIMEOUT_S", positive_float,
               "one tier-1 audit on the reference (past it the audit reaches no verdict)", group=g_time),
        Option("audits.rate", "--audit-rate", f"{p}AUDIT_RATE", optional_float,
               "share of answers given a tier-1 audit (default: the profile's, 0.10)", group=g_audit, metavar="X"),
        Option("audits.rate_new", "--audit-rate-new", f"{p}AUDIT_RATE_NEW", optional_float,
               "audit share for new or suspect miners (default: the profile's, 0.20)", group=g_audit, metavar="X"),
        Option("audits.canary_pool", "--canary-pool", f"{p}CANARY_POOL", optional_text,
               "tier-2 canary pool file (k3-canaries JSON from a reference deployment); without it and with "
               "--reference-engine the validator computes its own canaries", group=g_audit, metavar="FILE"),
        Option("audits.canaries", "--canaries", f"{p}CANARIES", non_negative_int,
               "with --reference-engine and no pool file: canaries to keep ready (computed on the reference)",
               group=g_audit),
        Option("scoring.profile", "--scoring-profile", f"{p}SCORING_PROFILE", str,
               "scoring numbers: production (docs/subnet.md) or local_testnet (tiny model on CPUs)", group="scoring",
               choices=SCORING_PROFILES),
        Option("scoring.overrides", "--scoring-overrides", f"{p}SCORING_OVERRIDES", optional_text,
               "JSON object of scoring/config.py fields to change, e.g. '{\"chat_max_tokens\": [64, 128]}'",
               group="scoring", metavar="JSON"),
        Option("weights.enabled", "--set-weights", f"{p}SET_WEIGHTS", flag,
               "set weights on chain once per epoch window (off: score only)", group=g_weights),
        Option("weights.check_s", "--weights-check-s", f"{p}WEIGHTS_CHECK_S", positive_float,
               "how often the weight task asks the chain whether weights are due", group=g_weights),
        Option("weights.retry_s", "--weights-retry-s", f"{p}WEIGHTS_RETRY_S", positive_float,
               "first backoff after a transient chain error at set-weights (doubles each time)", group=g_weights),
        Option("weights.retry_max_s", "--weights-retry-max-s", f"{p}WEIGHTS_RETRY_MAX_S", positive_float,
               "longest backoff between set-weights attempts", group=g_weights),
        Option("metrics", "--metrics", f"{p}METRICS", flag,
               "serve Prometheus /metrics on 127.0.0.1 (validator, gateway and reference engine)", group="metrics"),
        Option("metrics_port", "--metrics-port", f"{p}METRICS_PORT", port_number,
               "Prometheus port, bound to 127.0.0.1 only (0 picks a free one)", group="metrics"),
    ) + logging_options())


def optional_float(text: str) -> Optional[float]:
    if text.strip() == "":
        return None
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


optional_float.__name__ = "number"


def read_validator_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
                            prog: str | None = None, description: str | None = None) -> ValidatorSettings:
    values = read_options(validator_options(), argv, environ, prog=prog, description=description)
    return build_settings(ValidatorSettings, values)
