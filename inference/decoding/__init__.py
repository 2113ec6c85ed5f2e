"""Decoding: turning the model's logits into tokens. The sampler (temperature, top-k, top-p, stops,
logprobs), speculative decoding (drafters propose tokens, the target verifies them in one forward, the
sequence caches rewind past rejected ones) and the distilled draft table.

It sits on the model (inference.model) and below everything that decodes: the serving engine, the sharded
runtime's callers and the swarm stage."""
