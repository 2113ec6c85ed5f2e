"""What every neuron process shares: one way to read settings (flags, K3_* environment, files) and open
wallets, logging and the metrics server, and the per-caller rate limiter."""
