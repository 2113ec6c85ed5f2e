"""The swarm's stage compute: one contiguous block of Kimi K3 layers with per-session state (no wire here;
the stage wire is protocol/stage.py, the servers and the route driver are neurons/swarm/)."""
