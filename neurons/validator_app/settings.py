"""The validator's settings and its flag table (the gateway's flags included).

Each setting is stated once, on its dataclass field; the flag table is derived from the fields."""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from inference.model import WEIGHT_DTYPES, CheckpointError, device_problem, fingerprint
from inference.model.device import DTYPE_NAMES
from inference.serving import EngineSpec
from neurons.base.settings import (CHAIN, LOG_FORMAT, LOG_LEVEL, WALLET, ChainSettings, Option, Section, Setting,
                                   WalletSettings, build_settings, engine_section, expanded_path, non_negative_float,
                                   non_negative_int, port_number, positive_float, positive_rate,
                                   read_options, setting, settings_options)
from neurons.gateway.settings import GATEWAY, GatewaySettings, host_problem, public_url_problems
from protocol.client import ClientTimeouts
from scoring.config import ScoringConfig, ScoringConfigError
from scoring.model_envelope import ModelEnvelopeError, load_envelope, shipped_envelope

SCORING_PROFILES = ("production", "local_testnet")
DEFAULT_REFERENCE_MEMORY_GB = 8.0  # the block reference's budget when only --reference-engine is given
ENV_PREFIX = "K3_VALIDATOR_"


class ValidatorSetupError(RuntimeError):
    """The validator cannot start as configured; the message says what to change."""


@dataclass(frozen=True)
class RoundSettings:
    interval_s: float = setting(60.0, "seconds from the start of one round to the start of the next (a longer round "
                                "is followed at once)", flag="--round-interval-s", read=positive_float)
    requests_per_miner: Optional[int] = setting(None, "requests per miner per round (a burst of N streams counts N); "
                                                "default: the scoring profile's")
    concurrency: int = setting(64, "requests in flight at once over all miners")
    miner_concurrency: int = setting(8, "requests in flight at once to one miner (never above its declared capacity; "
                                     "a burst may use it all)")
    sample_size: int = setting(0, "miners evaluated per round, least recently evaluated first (0: all serving "
                               "miners)", read=non_negative_int)
    miners_at_once: int = setting(0, "miners evaluated at the same time (0: all of a round's miners together); fewer "
                                  "keeps miners that share one machine, as on a local testnet, from slowing each "
                                  "other down", read=non_negative_int)
    deadline_s: float = setting(600.0, "a miner's requests must all end within this many seconds of its evaluation "
                                "starting (all start together unless --miners-at-once is set); what is still in "
                                "flight then is cut and measured as a timeout", flag="--round-deadline-s",
                                read=positive_float)
    capabilities_refresh_s: float = setting(600.0, "how long a miner's /v1/capabilities answer is reused",
                                            read=positive_float)
    capabilities_timeout_s: float = setting(10.0, "a /v1/capabilities call", read=positive_float, group="timeouts")
    max_rounds: int = setting(0, "stop after this many rounds (0: run until SIGINT/SIGTERM)", read=non_negative_int)
    seed: Optional[int] = setting(None, "seed of workloads and audit draws, for reproducible tests (unset: "
                                  "unpredictable, as production needs)")
    uids: Optional[str] = setting(None, "comma-separated uids to evaluate, e.g. 3,5 (to debug a miner); the others "
                                  "keep their window scores (default: every serving miner)", metavar="UIDS")
    stage_sessions: int = setting(2, "sessions this validator drives through the swarm's stage miners per round, "
                                  "each checked after it ran against its block reference (with --reference-memory "
                                  "or --reference-engine); 0: stage miners are not checked", read=non_negative_int)

    def only_uids(self) -> Optional[set[int]]:
        if not self.uids:
            return None
        try:
            return {int(part) for part in self.uids.split(",") if part.strip()}
        except ValueError:
            raise ValidatorSetupError(f"--uids {self.uids!r} must be comma-separated integers, e.g. 3,5") from None


@dataclass(frozen=True)
class AuditSettings:
    rate: Optional[float] = setting(None, "share of answers given a tier-1 audit (default: the profile's, 0.10)",
                                    flag="--audit-rate", metavar="X")
    rate_new: Optional[float] = setting(None, "audit share for new or suspect miners (default: the profile's, 0.20)",
                                        flag="--audit-rate-new", metavar="X")
    canary_pool: Optional[str] = setting(None, "tier-2 canary pool file (k3-canaries JSON from a reference "
                                         "deployment); without it and with --reference-engine the validator "
                                         "computes its own canaries", metavar="FILE")
    canaries: int = setting(64, "with --reference-engine and no pool file: canaries to keep ready (computed on the "
                            "reference)", read=non_negative_int)
    timeout_s: float = setting(120.0, "one tier-1 audit on the reference (past it the audit reaches no verdict)",
                               flag="--audit-timeout-s", read=positive_float, group="timeouts")
    opening_rate: float = setting(0.1, "share of answers carrying a state commitment that are opened: one block of "
                                  "the answer re-run on the block reference (with --reference-memory or "
                                  "--reference-engine; docs/verification.md)", flag="--opening-rate", metavar="X")
    opening_rate_new: float = setting(0.25, "the same for new or suspect miners", flag="--opening-rate-new",
                                      metavar="X")


@dataclass(frozen=True)
class ScoringSettings:
    profile: str = setting("production", "scoring numbers: production (docs/subnet.md) or local_testnet (tiny model "
                           "on CPUs)", flag="--scoring-profile", choices=SCORING_PROFILES)
    overrides: Optional[str] = setting(None, "JSON object of scoring/config.py fields to change, e.g. "
                                       "'{\"chat_max_tokens\": [64, 128]}'", flag="--scoring-overrides",
                                       metavar="JSON")


@dataclass(frozen=True)
class WeightSettings:
    enabled: bool = setting(True, "set weights on chain once per epoch window (off: score only)", flag="--set-weights")
    check_s: float = setting(12.0, "how often the weight task asks the chain whether weights are due",
                             flag="--weights-check-s", read=positive_float)
    retry_s: float = setting(2.0, "first backoff after a transient chain error at set-weights (doubles each time)",
                             flag="--weights-retry-s", read=positive_float)
    retry_max_s: float = setting(120.0, "longest backoff between set-weights attempts", flag="--weights-retry-max-s",
                                 read=positive_float)


LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def layer_block(text: str, what: str = "a layer block") -> tuple[int, int]:
    """"A-B" (inclusive, as stage miners announce it) -> (A, B + 1); ValidatorSetupError otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text)
    if match is None or int(match.group(1)) > int(match.group(2)):
        raise ValidatorSetupError(f"{what} {text!r} is not a layer block A-B with A <= B, e.g. 6-8")
    return int(match.group(1)), int(match.group(2)) + 1


@dataclass(frozen=True)
class StageSettings:
    """Swarm stage checks (neurons/validator_app/stage_rounds.py); on with a block reference (--reference-memory
    or --reference-engine) and --stage-sessions > 0."""

    max_tokens: int = setting(48, "longest completion of a session the validator drives (lengths are drawn "
                              "uniformly from 4 up to it)", flag="--stage-max-tokens", read=non_negative_int)
    work_audit_rate: float = setting(0.25, "share of the sessions outside route drivers claim that are checked after "
                                     "the fact", flag="--stage-work-audit-rate", read=non_negative_float, metavar="X")
    timeout_s: float = setting(15.0, "one hop of the validator's route, and reading one stage ledger",
                               flag="--stage-timeout-s", read=positive_float, group="timeouts")
    blame_s: float = setting(24 * 3600.0, "how long a blamed stage miner stays at weight 0 (and out of the gateway's "
                             "routes)", flag="--stage-blame-s", read=positive_float)
    window_s: float = setting(24 * 3600.0, "window of verified stage work the weights count",
                              flag="--stage-window-s", read=positive_float)
    decoys: Optional[str] = setting(None, "blocks this validator serves itself under --stage-decoy-hotkey, to catch "
                                    "stage miners that hand their work to another stage: comma-separated "
                                    "LAYERS:PORT, e.g. 6-8:9310,0-2:9311", flag="--stage-decoys",
                                    metavar="A-B:PORT,...")
    decoy_hotkey: Optional[str] = setting(None, "hotkey (of the validator's wallet) the decoys sign as; must not be "
                                          "the validator's own", flag="--stage-decoy-hotkey", metavar="NAME")
    sink_host: str = setting("127.0.0.1", "address the result endpoint of the validator's route driver binds to (the "
                             "last stage of each of its routes sends the head's answers there)",
                             flag="--stage-sink-host", metavar="HOST")
    sink_port: int = setting(0, "port of that endpoint (0 picks a free one; give a fixed one with --stage-sink-url)",
                             flag="--stage-sink-port", read=port_number)
    sink_url: Optional[str] = setting(None, "address stage miners reach that endpoint at, http(s)://HOST:PORT "
                                      "(needed when stages run on other machines; default: "
                                      "http://--stage-sink-host:PORT)", flag="--stage-sink-url", metavar="URL")
    work_port: Optional[int] = setting(None, "port (on --stage-sink-host; 0 picks a free one) where outside route "
                                       "drivers submit the receipts of the steps they drove (POST /route/work, "
                                       "signed): the stages are credited that work, a driver whose receipts the "
                                       "stages never signed is blamed and zeroed; unset: no such endpoint",
                                       flag="--stage-work-port", read=port_number, metavar="PORT")

    def decoy_ports(self) -> dict[tuple[int, int], int]:
        """{(start, stop): port} from --stage-decoys; ValidatorSetupError with what is wrong."""
        out: dict[tuple[int, int], int] = {}
        for part in (self.decoys or "").split(","):
            if not part.strip():
                continue
            block, sep, port = part.strip().rpartition(":")
            if not sep or not port.strip().isdigit() or not 1 <= int(port) <= 65535:
                raise ValidatorSetupError(f"--stage-decoys entry {part.strip()!r} is not LAYERS:PORT with a port in "
                                          "1..65535, e.g. 6-8:9310")
            key = layer_block(block, "--stage-decoys block")
            if key in out:
                raise ValidatorSetupError(f"--stage-decoys names block {block.strip()} twice")
            if int(port) in out.values() or int(port) in (self.sink_port, self.work_port):
                raise ValidatorSetupError(f"--stage-decoys port {int(port)} is used twice")
            out[key] = int(port)
        return out

    def problems(self) -> list[str]:
        out = []
        if self.max_tokens < 4:
            out.append(f"--stage-max-tokens must be at least 4 (the shortest session's completion), got "
                       f"{self.max_tokens}")
        if not 0.0 <= self.work_audit_rate <= 1.0:
            out.append(f"--stage-work-audit-rate must lie in [0, 1], got {self.work_audit_rate}")
        try:
            self.decoy_ports()
        except ValidatorSetupError as error:
            out.append(str(error))
        if self.decoys and not self.decoy_hotkey:
            out.append("--stage-decoys needs --stage-decoy-hotkey NAME: the decoys sign as another hotkey of the "
                       "validator's wallet (stage miners must not recognise the validator)")
        if self.work_port and self.work_port == self.sink_port:
            out.append(f"--stage-work-port {self.work_port} is also --stage-sink-port: give each its own port")
        problem = host_problem(self.sink_host, "--stage-sink-host")
        if problem:
            out.append(problem)
        if self.sink_url:
            out += public_url_problems(self.sink_url, self.sink_port, "--stage-sink-url", "--stage-sink-port")
        elif self.sink_host in ("0.0.0.0", "::", ""):
            out.append(f"--stage-sink-host {self.sink_host!r} binds every interface but is no address a stage can "
                       "reach: give --stage-sink-url http(s)://PUBLIC_HOST:PORT (and a fixed --stage-sink-port)")
        return out


# Every call to a miner (protocol.client.ClientTimeouts: its defaults, our flags).
MINER_TIMEOUTS = Section(group="timeouts", fields=dict(
    connect=Setting("TCP connect to a miner", flag="--connect-timeout-s", read=positive_float),
    first_byte=Setting("from sending a request to its first event (covers the prefill)", flag="--first-byte-timeout-s",
                       read=positive_float),
    between_events=Setting("longest silence between two events of a stream", flag="--between-events-timeout-s",
                           read=positive_float),
    total=Setting("whole request", flag="--request-timeout-s", read=positive_float),
    prefill_tokens_per_s=Setting("the first event's deadline grows by prompt tokens / this rate (the slowest prefill "
                                 "allowed; inf: a flat --first-byte-timeout-s)", read=positive_rate, metavar="RATE"),
))


@dataclass(frozen=True)
class ValidatorSettings:
    wallet: WalletSettings = WALLET.field(WalletSettings)
    chain: ChainSettings = CHAIN.field(ChainSettings)
    # the reference is the audits' oracle: fp32 on every device unless --dtype says otherwise (the honest envelope
    # is measured against fp32; a bf16 reference would add its own rounding to every miner's)
    engine: EngineSpec = engine_section("K3_REFERENCE_").field(EngineSpec, dtype="float32")
    gateway: GatewaySettings = GATEWAY.field(GatewaySettings)
    reference_engine: bool = setting(False, "run the whole model from --checkpoint (or --engine remote/sharded) as "
                                     "this validator's own reference for tier-1 audits and tier-2 canaries; without "
                                     "it audits go to two other miners on different coldkeys", group="engine")
    reference_memory: float = setting(0.0, "GB of weights this validator's block reference may hold: it re-runs one "
                                      "block of layers at a time, read from --checkpoint on disk as checks need it "
                                      "(stage checks, openings of whole-model miners' state commitments), never the "
                                      "whole model, on --device (a GPU's memory with cuda); 0: 8 GB with "
                                      "--reference-engine, else no block checks",
                                      read=non_negative_float, metavar="GB", group="engine")
    db: str = setting("~/.k3-subnet/validator.sqlite", "SQLite file of everything the validator learns "
                      "(measurements, audits, failures, EMA, weights); a restart resumes from it", read=expanded_path,
                      group="store", metavar="FILE")
    rounds: RoundSettings = Section(group="rounds").field(RoundSettings)
    timeouts: ClientTimeouts = MINER_TIMEOUTS.field(ClientTimeouts)
    audits: AuditSettings = Section(group="verification").field(AuditSettings)
    scoring: ScoringSettings = Section(group="scoring").field(ScoringSettings)
    weights: WeightSettings = Section(group="weights").field(WeightSettings)
    stages: StageSettings = Section(group="swarm stage checks").field(StageSettings)
    metrics: bool = setting(True, "serve Prometheus /metrics (validator, gateway and reference engine) on "
                            "--metrics-host:--metrics-port", group="metrics")
    metrics_port: int = setting(9092, "Prometheus port (0 picks a free one)", read=port_number, group="metrics")
    metrics_host: str = setting("127.0.0.1", "address the metrics port binds; 0.0.0.0 (or a private address) lets a "
                                "Prometheus on another host or container scrape it: firewall it from the world",
                                group="metrics")
    log_level: str = LOG_LEVEL.field("INFO")
    log_format: str = LOG_FORMAT.field("text")

    @property
    def block_checks(self) -> bool:
        """Whether this validator re-runs blocks itself (stage checks, state openings): --reference-memory or
        --reference-engine."""
        return self.reference_memory > 0 or self.reference_engine

    @property
    def reference_memory_bytes(self) -> int:
        gb = self.reference_memory or DEFAULT_REFERENCE_MEMORY_GB
        return int(gb * 2**30)

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
        changes.update(self.envelope_override(changes.get("logprob_gap_envelope")))
        if not changes.get("logprob_gap_envelope"):  # nothing measured on this model: no statistical judgements
            changes.setdefault("statistical_checks", False)
        try:
            if self.scoring.profile == "local_testnet":
                config = ScoringConfig.local_testnet(**changes)
            else:
                config = ScoringConfig(**changes)
            config = self.measured_probes(config, changes)
        except (ScoringConfigError, TypeError) as error:
            raise ValidatorSetupError(str(error)) from None
        return config

    @staticmethod
    def measured_probes(config: ScoringConfig, changes: Mapping[str, Any]) -> ScoringConfig:
        """The answer probes to score, from the served model's envelope file when it records what the model
        answers: a kind it was measured to answer at this profile's prompt sizes is scored, any other is not,
        and misses are judged against the measured miss rate's 95% bound. --scoring-overrides' probes_scored
        and probe_miss_rate win."""
        if not config.logprob_gap_envelope:
            return config
        measured = load_envelope(config.logprob_gap_envelope)  # ScoringConfig has read it once already
        if not measured.probes:
            return config
        found: dict[str, Any] = {"probes_scored": measured.answered_probes(config.chat_prompt_tokens)}
        miss_rate = measured.probe_miss_rate(config.chat_prompt_tokens)
        if miss_rate is not None:
            found["probe_miss_rate"] = min(miss_rate, 0.5)
        return config.replace(**{k: v for k, v in found.items() if k not in changes})

    def envelope_override(self, given: Optional[str]) -> dict[str, str]:
        """The honest-numerics envelope measured on the served model: a given file must have been measured on the
        checkpoint's model; with none given, a shipped one measured on it is used (scoring/envelopes/)."""
        try:
            model = fingerprint(self.engine.checkpoint) if self.engine.checkpoint else None
        except (CheckpointError, OSError, KeyError, TypeError):
            model = None  # no manifest to name the model by: problems() and the engine say what is missing
        if given is None:
            shipped = shipped_envelope(model) if model else None
            return {"logprob_gap_envelope": str(shipped)} if shipped else {}
        try:
            measured_on = load_envelope(str(given)).fingerprint
        except ModelEnvelopeError:
            return {}  # ScoringConfig's own check names the bad file
        if model and measured_on and measured_on != model:
            raise ValidatorSetupError(f"logprob_gap_envelope {given} was measured on model {measured_on}, but "
                                      f"--checkpoint {self.engine.checkpoint} is model {model}: measure the served "
                                      "model's with benchmarks/verification.py --write-envelope FILE")
        return {}

    def problems(self) -> list[str]:
        out = list(self.gateway.problems()) + self.stages.problems()
        if not self.engine.checkpoint:
            out.append("--checkpoint is required: the model's checkpoint directory (config.json, tokenizer, "
                       "k3_manifest.json; the weights too with --reference-engine)")
        elif not (Path(self.engine.checkpoint) / "config.json").exists():
            out.append(f"--checkpoint {self.engine.checkpoint} has no config.json; make one with "
                       "k3-checkpoint or point it at the model's directory")
        if self.reference_engine:
            out += [p for p in self.engine.problems() if "checkpoint" not in p]
        elif self.block_checks:  # the block reference computes on --device in --dtype too
            problem = device_problem(self.engine.device)
            out += [problem] if problem else []
            if self.engine.dtype not in WEIGHT_DTYPES and self.engine.dtype not in DTYPE_NAMES:
                out.append(f"dtype {self.engine.dtype!r} is not one of {list(WEIGHT_DTYPES)}")
        if not self.reference_engine and not self.audits.canary_pool:
            out.append("neither --reference-engine nor --canary-pool: tier-1 audits would rest on other miners alone, "
                       "who could frame honest miners or shield a partner with nothing to settle it, and tier-2 "
                       "canaries could not run; run the model as this validator's reference (--reference-engine, "
                       "--engine remote for a GPU server) or give it a canary pool from a reference deployment")
        if self.gateway.enabled and self.gateway.route != "off" and not (self.block_checks
                                                                          and self.rounds.stage_sessions):
            out.append("--gateway-route needs the validator's stage checks (--reference-memory GB or "
                       "--reference-engine, and --stage-sessions > 0): the route's work is checked before it is "
                       "credited")
        r, w = self.rounds, self.weights
        try:
            r.only_uids()
        except ValidatorSetupError as error:
            out.append(str(error))
        if r.concurrency < 1 or r.miner_concurrency < 1:
            out.append("--concurrency and --miner-concurrency must be at least 1")
        if r.requests_per_miner is not None and r.requests_per_miner < 1:
            out.append("--requests-per-miner must be at least 1")
        for name, value in (("--audit-rate", self.audits.rate), ("--audit-rate-new", self.audits.rate_new),
                            ("--opening-rate", self.audits.opening_rate),
                            ("--opening-rate-new", self.audits.opening_rate_new)):
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
    """Every flag of the validator (the gateway's included), derived from ValidatorSettings' fields."""
    return settings_options(ValidatorSettings, ENV_PREFIX)


def read_validator_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
                            prog: str | None = None, description: str | None = None) -> ValidatorSettings:
    values = read_options(validator_options(), argv, environ, prog=prog, description=description)
    return build_settings(ValidatorSettings, values)
