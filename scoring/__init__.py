"""Scoring for the validator: workloads, verification tiers, measurements, rewards and weights.

Uses `protocol/` (to query miners) and `inference/` (tokenizer, reference engine); computes
weights but never sets them. One round for one miner, as the neuron drives it:

    items = plan_round(rng, capabilities, config, tokenizer=tokenizer, canaries=pool)        # workloads
    singles, bursts = group_bursts(items)        # send a burst's streams at the same time
    result = await client.generate(url, hotkey, item.request)      # or a MinerError (e.partial)
    checked = await sequence.check(item, result, capabilities, uid=uid, hotkey=hotkey, coldkey=coldkey,
                                   new_or_suspect=window.is_new_or_suspect(...))          # audit_sequence
    window.add(measure_request(uid, hotkey, item, result_or_error, checked.verification, config,
                               in_flight=..., capacity=capabilities.max_concurrent_streams))   # metrics
    window.add(measure_burst(uid, hotkey, [(item, result_or_error, verification), ...], config))
    window.prune(now)
    scores = score_miners(window, config, now, hotkeys, coldkeys)                           # rewards
    ema = update_ema(ema, scores, config.ema_alpha)
    submitted = weights_to_submit(WeightEvidence(ema, ...), config)                          # weights

The checks: tier0 (every answer, CPU), tier1 (teacher-forced audits and their references), auditors (miner
auditors), canaries (tier 2), audit_sequence (their order for one answer). Persist `window.to_rows()`
(COLUMNS), the EMA entries, the canary pool's `used` set.
"""
from .audit_sequence import (AuditSequence, CheckedAnswer, Verification, audit_probability, check_answer, draw_audit,
                             verify_item)
from .canaries import Canary, CanaryPool, CanaryPoolError, Tier2Result, check_tier2
from .config import ScoringConfig, ScoringConfigError
from .failures import Failure
from .metrics import (BURST_AGGREGATE, COLUMNS, OUTCOMES, Measurement, MeasurementWindow, classify_error,
                      decode_tokens_per_s, measure_burst, measure_request, ttft_per_1k)
from .rewards import EmaEntry, MinerScore, score_miners, update_ema
from .tier0 import check_tier0, validator_prompt_ids
from .tier1 import (AuditResult, ConsensusReference, MinerScoreReference, Reference, ReferenceDisagreement, audit_tier1,
                    outside_top_k_bound)
from .weights import (StageEvidence, WeightEvidence, miner_weights, submitted_weights, weights_from_ema,
                      weights_to_submit)
from .workloads import (KINDS, PROBE_KINDS, Expectation, WorkItem, WorkloadError, canary_item, canary_prompts,
                        group_bursts, plan_round)
