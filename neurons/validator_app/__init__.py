"""The validator: settings, rounds, the SQLite store, status."""
