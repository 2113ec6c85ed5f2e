"""Scoring for the validator: workloads, verification tiers, measurements, rewards.

Uses `protocol/` (to query miners) and `inference/` (tokenizer, reference engine); computes
weights but never sets them. One round for one miner, as the neuron drives it:

    items = plan_round(rng, capabilities, config, tokenizer=tokenizer, canaries=pool)
    singles, bursts = group_bursts(items)        # send a burst's streams at the same time
    result = await client.generate(url, hotkey, item.request)      # or a MinerError (e.partial)
    audit = rng.random() < audit_probability(item, config, new_or_suspect=window.is_new_or_suspect(...))
    verification = await verify_item(item, result, tokenizer=tokenizer, capabilities=capabilities,
                                      miner_hotkey=hotkey, config=config, reference=reference, audit=audit)
    window.add(measure_request(uid, hotkey, item, result_or_error, verification, config,
                               in_flight=..., capacity=capabilities.max_concurrent_streams))
    window.add(measure_burst(uid, hotkey, [(item, result_or_error, verification), ...], config))
    window.prune(now)
    scores = score_miners(window, config, now, hotkeys, coldkeys)
    ema = update_ema(ema, scores, config.ema_alpha)
    weights = weights_from_ema(ema, config.weight_exponent)

Persist `window.to_rows()` (COLUMNS), the EMA entries, the canary pool's `used` set.
"""
from .config import ScoringConfig, ScoringConfigError
from .metrics import (BURST_AGGREGATE, COLUMNS, OUTCOMES, Measurement, MeasurementWindow, classify_error,
                      decode_tokens_per_s, measure_burst, measure_request, ttft_per_1k)
from .rewards import EmaEntry, MinerScore, score_miners, update_ema, weights_from_ema
from .verify import (AuditResult, Canary, CanaryPool, CanaryPoolError, ConsensusReference, Failure, MinerScoreReference,
                     Reference, ReferenceDisagreement, Tier2Result, Verification, audit_probability, audit_tier1,
                     check_answer, check_tier0, check_tier2, outside_top_k_bound, validator_prompt_ids, verify_item)
from .workloads import (KINDS, PROBE_KINDS, Expectation, WorkItem, WorkloadError, canary_item, canary_prompts,
                        group_bursts, plan_round)
