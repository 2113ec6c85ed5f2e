"""Every number of docs/subnet.md sections 3-5 (workloads, verification, scoring) as one setting.

`ScoringConfig()` holds the production values; `ScoringConfig.local_testnet()` the values for
the tiny random model on CPUs (smaller contexts and outputs; answer checks off, since a random
model never answers correctly). A field marked "(not in the spec)" is a choice this package had
to make where the spec is silent; its docstring says why.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .model_envelope import HONEST_PROBE_MISS_RATE, SCORABLE_PROBES, ModelEnvelopeError, load_envelope


class ScoringConfigError(ValueError):
    """A ScoringConfig whose values cannot work together."""


@dataclass(frozen=True)
class ScoringConfig:
    # ------------------------------------------------------------ section 3: workloads
    round_requests: int = 40
    """Requests per miner per round; a burst of N streams counts as N requests."""
    mix_chat: float = 0.45
    """Share of requests that are chat (short prompt, free-form answer)."""
    mix_long_context: float = 0.25
    """Share of requests that are long-context (planted fact, question at the end)."""
    mix_burst: float = 0.15
    """Share of requests sent as streams of concurrency bursts."""
    mix_probe: float = 0.15
    """Share of requests that are quality probes (canary, exact copy, planted-fact retrieval)."""

    chat_prompt_tokens: tuple[int, int] = (16, 4096)
    """Chat prompt size range in tokens (drawn log-uniformly). Probes and burst streams use it too."""
    chat_max_tokens: tuple[int, int] = (64, 2048)
    """max_tokens range of chat, burst and probe requests (drawn log-uniformly)."""
    temperature_range: tuple[float, float] = (0.0, 1.0)
    """Temperature range of every request."""
    greedy_fraction: float = 0.25
    """(not in the spec) Share of ordinary requests sent at temperature exactly 0. Canaries must be
    greedy; without plenty of greedy ordinary traffic, temperature 0 would mark them."""
    request_logprobs: int = 5
    """Top-k alternatives asked on every request, so that tier 0 can always check greedy tokens
    against the miner's own distribution. The same on every request, so it marks nothing."""
    prompt_format: str = "token_ids"
    """How every prompt is sent: "token_ids" (chat template applied by the validator) or "text".
    One format for all requests, so that the format marks nothing."""

    long_context_sizes: tuple[int, ...] = (16_384, 65_536, 131_072, 262_144, 524_288, 1_048_576)
    """Long-context prompt sizes in tokens; those that fit the miner's declared context are used,
    plus the largest prompt its declared maximum allows."""
    long_context_max_tokens: tuple[int, int] = (16, 48)
    """max_tokens range of long-context requests ("short outputs"). Kept at or under
    `buffering_min_tokens`, so that a long prefill never looks like a buffered stream."""
    planted_depth_range: tuple[float, float] = (0.05, 0.95)
    """Where the planted fact sits, as a fraction of the prompt (uniform in this range)."""
    planted_distractors: tuple[int, int] = (1, 3)
    """(not in the spec) How many other people's access codes are planted as distractors."""

    burst_capacity_fraction: tuple[float, float] = (0.5, 1.0)
    """Burst size N as a fraction of the miner's declared max_concurrent_streams (uniform)."""
    burst_streams: tuple[int, int] = (2, 64)
    """Bounds on N whatever the declared capacity (the upper bound protects the validator)."""

    probe_weights: tuple[float, float, float] = (1.0, 1.0, 1.0)
    """Relative frequency of canary, exact-copy and planted-fact probes (canaries only when a
    canary is available)."""
    copy_text_tokens: tuple[int, int] = (16, 48)
    """Size of the text an exact-copy task asks to repeat (must fit the smallest max_tokens)."""

    # ------------------------------------------------------------ section 4: verification
    audit_rate: float = 0.10
    """Share of responses given a tier-1 teacher-forced audit."""
    audit_rate_new_or_suspect: float = 0.20
    """Audit share for new or suspect miners."""
    long_context_audit_rate: float = 1.0
    """(not in the spec) Audit share of long-context responses: their success (component L) rests
    on the audit over the whole context, so by default every one is audited."""
    new_miner_requests: int = 25
    """(not in the spec) A miner with fewer verified requests than this in the window is new."""

    reference_logprob_floor: float = -13.0
    """Tier 1 fails when any output token has reference logprob at or below this."""
    outside_top_k: int = 10
    """Tier 1 counts output tokens outside the reference top-k with this k..."""
    max_outside_top_k: int = 3
    """...and fails when more than this many fall outside."""
    outside_top_k_sampling_sigmas: float | None = 4.0
    """(not in the spec) Sampled tokens fall outside the top-10 honestly (on the tiny model one in
    five at temperature 1). The allowance then grows by E + sigmas*sqrt(E), E an upper bound on
    the expected count at the request's temperature from the reference's own top-k (E = 0 at
    temperature 0). None applies the spec's "more than 3" literally."""
    max_greedy_mismatches: int = 3
    """(not in the spec) At temperature 0, tier 1 fails (soft) when more than this many output tokens
    trail the reference top-1 by more than `greedy_gap_soft`: teacher-forced on the miner's own prefix,
    an honest greedy token is the argmax up to the rounding of its numerics."""
    eos_ratio: float = 100.0
    """(spec value, now only recorded) p(eos)/p(chosen) above this at a token counts as an avoided EOS in
    the stored audit row. It no longer fails an audit by itself: an honest sampler passes such a
    position one time in a hundred or more, so the test below uses the whole answer's chance instead."""
    eos_no_stop_p_soft: float = 1e-4
    """(not in the spec) At temperature > 0, tier 1 fails (soft) when the chance that an honest sampler at
    the request's temperature went through every position of the answer without stopping is under this
    (a lower bound from the reference's top list: the stated false-positive rate is at most this)."""
    eos_no_stop_p_hard: float = 1e-12
    """(not in the spec) ...and hard under this (on a trusted reference)."""
    logprob_gap_soft: float = 0.75
    """(not in the spec) Tier 1 fails (soft) when the miner's reported logprobs of its own tokens differ
    from the reference's by more than this many nats on average. Honest numerics (bf16, fp16, other
    kernels, batching, chunking, sharding) stay far below (benchmarks/verification.py); another model,
    re-quantised experts or a truncated context are far above."""
    logprob_gap_envelope: str | None = None
    """(not in the spec) The envelope measured for the served model (a file written by
    `benchmarks/verification.py --write-envelope`; scoring/model_envelope.py): per declared precision and
    prompt length, the soft logprob-gap bound of that model's honest numerics (1.5x the worst honest audit
    measured). Where it covers the miner's precision and the prompt's length it replaces `logprob_gap_soft`,
    which was set on the random tiny model's flat distributions and lets a bf16 miner with half the experts or
    a truncated context pass on a trained one. None: the wide bound everywhere."""
    logprob_gap_hard: float = 1.5
    """(not in the spec) ...and hard above this on a trusted reference, at any temperature."""
    exact_precisions: tuple[str, ...] = ("fp32", "float32")
    """(not in the spec) Precisions a miner may declare (Capabilities.precision) that claim fp32 numerics.
    A miner is judged by the envelope of what it declares: fp32 with any kernel, thread count, batch,
    chunking or sharding reproduces the reference's logprobs to under 1e-4 nats (the envelope), so a
    claim of fp32 carries the tighter bound below; bf16, fp16 and anything else get the wide one."""
    logprob_gap_soft_exact: float = 0.005
    """(not in the spec) Tier 1 fails (soft, never hard) when a miner that declares an exact precision
    reports logprobs further than this from the reference's on average: 50x the worst honest fp32 variant
    measured, and under what a truncated context moves them on both tiny models (0.01-0.6 nats), which
    stays inside bf16's rounding there. A deployment that rounds more than fp32 must say so."""
    greedy_gap_soft: float = 2.0
    """(not in the spec) At temperature 0 a token counts as a mismatch when it trails the reference's top-1
    by more than this many nats (honest bf16 flips at near-ties trail by far less)."""
    greedy_gap_hard: float = 6.0
    """(not in the spec) A token trailing the reference's top-1 by more than this is far outside the
    envelope of honest numerics..."""
    greedy_hard_count: int = 3
    """...and this many such tokens in one answer make a hard failure (on a trusted reference)."""
    surprisal_z_soft: float = 5.0
    """(not in the spec) At temperature > 0 the sampled tokens' surprisal under the reference (among its
    top list) is standardised; an honest sampler gives about N(0, 1), so |z| above this fails (soft;
    about 6e-7 per audit for an exact sampler, the envelope's numerics shifts included)..."""
    surprisal_z_hard: float = 10.0
    """...and hard above this on a trusted reference."""
    surprisal_min_positions: int = 8
    """(not in the spec) The surprisal test needs this many sampled tokens inside the reference top list."""
    quality_min_positions: int = 16
    """Tier-1 quality needs at least this many sampled output positions (else no quality)."""
    quality_sample_positions: int = 64
    """At most this many output positions, drawn at random, enter the quality mean."""
    quality_full_margin: float = 0.125
    """Quality is 1 while mean |p_miner - p_reference| is at or below this..."""
    quality_zero_margin: float = 0.25
    """...and falls linearly to 0 at this."""
    audit_reference_top_k: int = 20
    """Alternatives asked of the reference per position (covers the top-10 test and p(eos))."""
    auditor_disagreement_margin: float = 0.05
    """(not in the spec) Two auditors disagree when they reach different verdicts or their
    probabilities of the miner's tokens differ by more than this on average."""
    canary_tokens: int = 64
    """Tier 2: length of a canary's known greedy continuation."""
    near_tie_margin: float = 0.1
    """Tier 2 (and greedy tier 1): a reference top-1 vs top-2 logprob margin under this is a
    near-tie, where a different token is accepted."""
    statistical_checks: bool = True
    """(not in the spec) Judge tier 1's statistical tests (logprob gap, surprisal, tokens outside the reference
    top-k, the reference logprob floor, EOS avoidance), whose thresholds assume honest numerics of a known
    envelope. The validator turns this off for a model without a measured envelope (scoring/envelopes/, matched
    by fingerprint) and says so at start: then its statistics are recorded but only exact checks judge (tier 0,
    canaries, the greedy check and the replay of sampled answers with the conservative values below)."""
    replay_p_soft: float = 1e-6
    """(not in the spec) A sampled answer of a miner declaring the sampler k3-gumbel/1 is replayed on the
    reference (scoring/replay.py); it fails (soft) when its tokens beyond a near-tie of the replayed ones would
    happen to an honest miner with chance under this (binomial tail against the measured honest rate's 95%
    bound): the stated false-positive budget per audit..."""
    replay_p_hard: float = 1e-12
    """...and hard under this on a trusted reference."""
    replay_delta_unmeasured: float = 2.0
    """(not in the spec) Near-tie allowance, in nats of logit, for a model or precision without a measured replay
    envelope: a replayed token trailing by less is excused. Set over the worst gap of honest bf16 on the random
    tiny model, whose numerics move logits the most of anything measured (benchmarks/verification.py)..."""
    replay_rate_unmeasured: float = 0.05
    """...and the share of honest sampled tokens beyond it assumed there (conservative: several times what
    honest bf16 on the random tiny model had)."""
    replay_resend_rate: float = 0.05
    """(not in the spec) Share of sampled chat requests sent again, later, to the same miner with another seed
    (and another request id): a miner that caches answers by prompt returns the cached tokens, which the replay
    of the new seed fails."""
    buffering_min_tokens: int = 60
    """Buffering detector: only streams with more than this many tokens are judged..."""
    buffering_head_fraction: float = 0.05
    """...by the time until this fraction of the tokens had arrived..."""
    buffering_time_fraction: float = 0.85
    """...being at least this fraction of the whole call."""
    logprob_tolerance: float = 1e-3
    """(not in the spec) Rounding allowed in tier 0's consistency checks of reported logprobs."""
    planted_fact_scored: bool = True
    """A long-context answer must contain the planted value to count as correct (off for the tiny models:
    the trained one finds a planted fact in prompts of up to 256 tokens, not 1-2k tokens back; then L rests on
    the audit and the time budget)."""
    probes_scored: tuple[str, ...] = ("copy", "planted_fact")
    """Answer probes whose answers are checked: "copy" (exact copy) and "planted_fact" (retrieval of a planted
    access code); misses are judged by their rate (probe_miss_rate, probe_gate_p). None for the local testnet
    profile; the validator sets those the served model was measured to answer (the "probes" of its envelope
    file, scoring/model_envelope.py) unless --scoring-overrides sets this."""
    long_context_budget_base_s: float = 20.0
    """(not in the spec) Time budget of a long-context request: this many seconds..."""
    long_context_budget_s_per_1k_tokens: float = 0.2
    """...plus this many per 1000 prompt tokens."""

    # ------------------------------------------------------------ section 5: scoring and weights
    window_s: float = 24 * 3600.0
    """Rolling window of measurements."""
    percentile: float = 30.0
    """D and F are the speed that (100 - percentile)% of a miner's requests reach: the 30th
    percentile of decode tokens/s, and the 70th percentile of TTFT per 1k tokens (lower is
    better, so its 30th percentile of performance)."""
    decode_min_tokens: int = 16
    """(not in the spec) Streams shorter than this give no decode speed (too noisy)."""
    component_floor: float = 0.3
    """Relative components are clipped to [floor, ceiling]."""
    component_ceiling: float = 1.0
    weight_decode: float = 0.30
    """Weight of D (decode tokens/s) in perf."""
    weight_ttft: float = 0.20
    """Weight of F (TTFT per 1k prompt tokens) in perf."""
    weight_burst: float = 0.30
    """Weight of C (burst aggregate tokens/s) in perf."""
    weight_long_context: float = 0.20
    """Weight of L (long-context success share) in perf."""
    quality_without_audits: float = 1.0
    """(not in the spec) Quality of a miner with no tier-1 quality measured yet."""
    hard_failure_s: float = 24 * 3600.0
    """A confirmed hard failure zeroes the miner for this long."""
    audit_failure_rate: float = 0.15
    """A miner failing at least this share of its audits is zeroed..."""
    audit_min_count: int = 10
    """...once it has at least this many audits."""
    long_audit_min_count: int = 2
    """(not in the spec) Long-context audits are also judged on their own: the same failure rate over
    at least this many of them zeroes the miner (each is audited, and a swap on long prompts only
    would otherwise hide among passed short audits)."""
    min_completed_requests: int = 25
    """The evidence a full EMA step needs: with n requests measured in the window, a round moves the
    EMA by ema_alpha * min(1, n / this). (The spec caps S at 0.25 under 25 completed requests; that cap
    jumped 4x in whichever round a miner crossed 25, so two identical miners crossing in different
    rounds ended far apart. Scaling the EMA step keeps "little evidence, little weight" without the
    jump; counting every measured request keeps a miner that stops answering from freezing its EMA.)"""
    probe_miss_rate: float = HONEST_PROBE_MISS_RATE
    """(not in the spec) The most answer probes an honest miner misses: a kind is scored only when the served
    model answered at least 1 - this of them in every honest numerics measured (scoring/model_envelope.py)."""
    probe_gate_p: float = 1e-4
    """(not in the spec) A miner is zeroed when its missed probes in the window would happen to a miner missing
    probe_miss_rate of them with less than this chance (binomial tail): a model that never answers is caught
    after 5 probes (at a rate of 0.1 to 0.15), an honest one that misses now and then is not."""
    one_hotkey_per_coldkey: bool = True
    """Several hotkeys of one coldkey keep only the best score."""
    ema_alpha: float = 0.2
    """EMA of S per uid, per round."""
    weight_exponent: float = 2.0
    """Weights are proportional to EMA(S) to this power."""
    uncommitted_weight_factor: float = 0.5
    """(not in the spec) A whole-model miner's weight is multiplied by c + (1 - c) x this, c being the share of its
    answers in the window that carried a state commitment (scoring.weights): a miner in front of an engine that
    cannot commit to its layer states (vLLM, SGLang) is verified by less (docs/verification.md, "Engines that
    cannot commit") and is paid at this discount until it commits. 1: no discount."""

    # ------------------------------------------------------------ presets
    @classmethod
    def local_testnet(cls, **overrides) -> "ScoringConfig":
        """The tiny models on a 2-core CPU (the local testnet): short rounds, 1k-2k contexts, short outputs, no
        answer checks of their own (a validator adds the probes its model's envelope file says it answers). Sized
        so that three miners and a validator with its own reference engine share two cores and the first weights
        land within minutes; long enough prompts that truncating to 512 tokens shows."""
        base = dict(
            round_requests=12,
            chat_prompt_tokens=(16, 256),
            chat_max_tokens=(64, 128),
            long_context_sizes=(1024, 2048),
            long_context_max_tokens=(16, 32),
            burst_streams=(2, 4),
            planted_fact_scored=False,
            probes_scored=(),
            long_context_budget_base_s=30.0,
            long_context_budget_s_per_1k_tokens=2.0,
            replay_resend_rate=0.2,  # rounds of 12 requests: a resend within a few rounds
        )
        base.update(overrides)
        return cls(**base)

    def replace(self, **changes) -> "ScoringConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------ derived values
    @property
    def mix(self) -> dict[str, float]:
        return {"chat": self.mix_chat, "long_context": self.mix_long_context,
                "burst": self.mix_burst, "probe": self.mix_probe}

    def long_context_budget_s(self, prompt_tokens: int) -> float:
        return self.long_context_budget_base_s + self.long_context_budget_s_per_1k_tokens * prompt_tokens / 1000.0

    def quality_from_margin(self, mean_abs_diff: float) -> float:
        """1 at or under the full margin, 0 at or over the zero margin, linear between."""
        if mean_abs_diff <= self.quality_full_margin:
            return 1.0
        if mean_abs_diff >= self.quality_zero_margin:
            return 0.0
        return (self.quality_zero_margin - mean_abs_diff) / (self.quality_zero_margin - self.quality_full_margin)

    # ------------------------------------------------------------ validation
    def __post_init__(self):
        problems = self.problems()
        if problems:
            raise ScoringConfigError("bad scoring config: " + "; ".join(problems))

    def problems(self) -> list[str]:
        out = []

        def fraction(name, low=0.0, high=1.0):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high):
                out.append(f"{name} must lie in [{low}, {high}], got {value!r}")

        def int_range(name, low=1):
            a, b = getattr(self, name)
            if not (isinstance(a, int) and isinstance(b, int) and low <= a <= b):
                out.append(f"{name} must be (min, max) integers with {low} <= min <= max, got {(a, b)!r}")

        def float_range(name, low, high):
            a, b = getattr(self, name)
            if not (low <= a <= b <= high):
                out.append(f"{name} must be (min, max) with {low} <= min <= max <= {high}, got {(a, b)!r}")

        if self.round_requests < 1:
            out.append(f"round_requests must be at least 1, got {self.round_requests}")
        for name in ("mix_chat", "mix_long_context", "mix_burst", "mix_probe"):
            fraction(name)
        if abs(sum(self.mix.values()) - 1.0) > 1e-9:
            out.append(f"the mix fractions must add up to 1, they add up to {sum(self.mix.values())}")
        int_range("chat_prompt_tokens")
        int_range("chat_max_tokens")
        int_range("long_context_max_tokens")
        int_range("copy_text_tokens")
        int_range("burst_streams")
        int_range("planted_distractors", low=0)
        float_range("temperature_range", 0.0, 2.0)
        float_range("planted_depth_range", 0.0, 1.0)
        float_range("burst_capacity_fraction", 0.0, 10.0)
        if not 0.0 < self.probe_miss_rate < 1.0 or not 0.0 < self.probe_gate_p < 1.0:
            out.append("probe_miss_rate and probe_gate_p must lie strictly between 0 and 1")
        for name in ("greedy_fraction", "audit_rate", "audit_rate_new_or_suspect", "long_context_audit_rate",
                     "buffering_head_fraction", "buffering_time_fraction", "audit_failure_rate", "ema_alpha"):
            fraction(name)
        if not 0 <= self.request_logprobs <= 20:
            out.append(f"request_logprobs must lie in 0..20, got {self.request_logprobs}")
        if self.prompt_format not in ("token_ids", "text"):
            out.append(f"prompt_format must be 'token_ids' or 'text', got {self.prompt_format!r}")
        if not self.long_context_sizes or any(s < 2 for s in self.long_context_sizes):
            out.append("long_context_sizes must hold at least one size of 2 tokens or more")
        unknown_probes = sorted(set(self.probes_scored) - set(SCORABLE_PROBES))
        if unknown_probes:
            out.append(f"probes_scored may name {list(SCORABLE_PROBES)}, not {unknown_probes}")
        if len(self.probe_weights) != 3 or min(self.probe_weights) < 0 or sum(self.probe_weights[1:]) <= 0:
            out.append("probe_weights must be three non-negative weights (canary, copy, planted fact), "
                       "with copy or planted fact above 0")
        if self.chat_max_tokens[0] < self.canary_tokens:
            out.append(f"chat_max_tokens must start at canary_tokens ({self.canary_tokens}) or above, so that a "
                       "canary request uses the ordinary max_tokens range")
        if self.copy_text_tokens[1] >= self.chat_max_tokens[0]:
            out.append("copy_text_tokens must stay below the smallest chat max_tokens")
        if not self.outside_top_k <= self.audit_reference_top_k <= 20:
            out.append("audit_reference_top_k must lie in outside_top_k..20")
        if self.outside_top_k_sampling_sigmas is not None and self.outside_top_k_sampling_sigmas < 0:
            out.append("outside_top_k_sampling_sigmas must be >= 0 or None")
        if not 0 < self.quality_full_margin < self.quality_zero_margin <= 1:
            out.append("need 0 < quality_full_margin < quality_zero_margin <= 1")
        if self.quality_sample_positions < self.quality_min_positions or self.quality_min_positions < 1:
            out.append("need 1 <= quality_min_positions <= quality_sample_positions")
        if self.eos_ratio <= 1:
            out.append("eos_ratio must exceed 1")
        if not 0.0 < self.replay_p_hard <= self.replay_p_soft < 1.0:
            out.append("need 0 < replay_p_hard <= replay_p_soft < 1")
        if not self.replay_delta_unmeasured > 0.0 or not 0.0 < self.replay_rate_unmeasured < 1.0:
            out.append("replay_delta_unmeasured must be > 0 and replay_rate_unmeasured in (0, 1)")
        fraction("replay_resend_rate")
        if self.canary_tokens < 1 or self.near_tie_margin < 0:
            out.append("canary_tokens must be >= 1 and near_tie_margin >= 0")
        if self.long_context_max_tokens[1] > self.buffering_min_tokens:
            out.append("long_context_max_tokens must stay at or under buffering_min_tokens: a long prefill "
                       "followed by a short answer would otherwise look like a buffered stream")
        if not 0 < self.percentile < 100:
            out.append(f"percentile must lie in (0, 100), got {self.percentile}")
        if not 0 <= self.component_floor <= self.component_ceiling:
            out.append("need 0 <= component_floor <= component_ceiling")
        weights = (self.weight_decode, self.weight_ttft, self.weight_burst, self.weight_long_context)
        if min(weights) < 0 or sum(weights) <= 0:
            out.append("component weights must be non-negative and not all zero")
        for name in ("window_s", "hard_failure_s"):
            if not getattr(self, name) > 0:
                out.append(f"{name} must be positive")
        if self.weight_exponent <= 0:
            out.append("weight_exponent must be positive")
        if not 0 <= self.uncommitted_weight_factor <= 1:
            out.append("uncommitted_weight_factor must lie in [0, 1]")
        if self.long_context_budget_base_s < 0 or self.long_context_budget_s_per_1k_tokens < 0:
            out.append("long-context budget settings must be non-negative")
        if self.logprob_gap_envelope is not None:
            try:
                load_envelope(str(self.logprob_gap_envelope))
            except ModelEnvelopeError as error:
                out.append(f"logprob_gap_envelope: {error}")
        return out


DEFAULT_CONFIG = ScoringConfig()  # the checks' default when a caller passes none

__all__ = ["DEFAULT_CONFIG", "ScoringConfig", "ScoringConfigError"]
