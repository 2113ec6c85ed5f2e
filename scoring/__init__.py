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

The package itself imports nothing: import the module that holds a name (`from scoring.tier0 import
check_tier0`), so that a light user (the validator's `status`, which reads its database) does not load the
model and torch with the reference-engine code.
"""
