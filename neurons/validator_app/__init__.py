"""The validator: settings (settings.py), rounds that measure, verify, score and set weights (rounds.py), the
SQLite store (store.py) and the status report (status.py). What is audited and what weights are set are
scoring's (scoring.audit_sequence, scoring.weights).

The package itself imports nothing: `k3-validator status` reads the database with store.py and status.py alone,
without loading the rounds, the gateway and torch."""
