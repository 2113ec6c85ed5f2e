"""Command-line helpers shared by `python -m chain` (k3-chain) and the local testnet (k3-localnet)."""
from __future__ import annotations

import argparse
import sys


class DeprecatedFlag(argparse.Action):
    """An old flag spelling: still sets the value, and says on stderr what to use instead."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is deprecated, use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)
