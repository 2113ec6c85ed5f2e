"""What every neuron process shares: one way to read settings (flags, K3_* environment, files) and open
wallets, logging and the metrics server, the per-caller rate limiter, and the one adapter between engine
events and wire messages (engine_wire)."""
