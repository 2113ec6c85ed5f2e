"""Cheating miners, stage miners and route drivers that the local testnet and the tests run against the real
validator. Each one is a process like its honest counterpart with one dishonest change."""
