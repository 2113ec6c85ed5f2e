"""Speculative decoding: drafters propose tokens, the target model verifies them in one forward, and
the sequence caches rewind past rejected ones (inference.model.k3.SequenceCache.mark / rewind)."""
