"""The miner: settings, access control, the signed HTTP server, and the cheats used by tests."""
