"""Speculative decoding: drafters propose tokens, the target model verifies them in one forward, and
the sequence caches rewind past rejected ones (inference.model.k3.SequenceCache.mark / rewind)."""

# The serving engine imports this package's speculation, which uses serving's sampler: load serving first so
# that importing `inference.speculative.speculation` before `inference.serving` works too.
import inference.serving  # noqa: E402,F401  isort:skip
