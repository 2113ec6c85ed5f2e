#!/usr/bin/env python3
"""Kimi K3 subnet validator: measures and verifies miners, sets weights on chain.

    python neurons/validator.py run --network devnet:/tmp/k3/devnet.sqlite --netuid 1 \\
        --wallet-name validator --wallet-hotkey default --wallet-path ~/.bittensor/wallets \\
        --checkpoint ckpt/tiny --reference-engine --db ~/.k3-subnet/validator.sqlite
    python neurons/validator.py status --db ~/.k3-subnet/validator.sqlite [--json]

`run` options: `python neurons/validator.py run --help` (every flag also has an environment
variable; a flag wins). SIGINT or SIGTERM stops it after the current round's requests are cut;
a restart resumes from --db. `status` prints the validator's current view per miner from the
database (it works while the validator runs).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neurons.observability import setup_logging  # noqa: E402
from neurons.settings import Option, describe_values, expanded_path, flag, program_name, read_options  # noqa: E402
from neurons.validator_app import (ValidatorSetupError, read_validator_settings, run_validator,  # noqa: E402
                                   status_report, validator_options)
from neurons.validator_app.store import ValidatorStore, ValidatorStoreError  # noqa: E402

STATUS_OPTIONS = (
    Option("db", "--db", "K3_VALIDATOR_DB", expanded_path, "the validator's database", group="status", metavar="FILE",
           default="~/.k3-subnet/validator.sqlite"),
    Option("json", "--json", None, flag, "print JSON instead of a table", group="status", default=False),
)
COMMANDS = ("run", "status")


def validator_program() -> str:
    return program_name("k3-validator", "neurons.validator")


def _number(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_status(report: dict) -> str:
    header = ("uid", "hotkey", "ttft_s/1k", "tok/s", "burst_tok/s", "long_ctx", "quality", "fails", "score", "ema",
              "weight", "last failure")
    rows = []
    for m in report["miners"]:
        rows.append((str(m["uid"]), m["hotkey"][:12] + "…" if len(m["hotkey"] or "") > 12 else m["hotkey"] or "",
                     _number(m["ttft_per_1k_s"]), _number(m["decode_tps"], 1), _number(m["burst_tps"], 1),
                     _number(m["long_context_share"], 2), _number(m["quality"], 2), str(m["failures"]),
                     _number(m["score"], 4), _number(m["ema"], 4), _number(m["weight"], 4),
                     (m["last_failure"] or "")[:70]))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = [f"validator database {report['db']}: round {report['round']} "
             f"(completed {report['completed_round']}); weights last set at block {report['weights_block']} "
             f"(version key {report['version_key']})",
             "  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    if not rows:
        lines.append("(no miners evaluated yet)")
    stages = report.get("stage_miners") or []
    if stages:
        lines += ["", "swarm stage miners:",
                  "uid  layers  challenges  failed  route audits  tokens  step_ms  weight  zeroed because"]
        lines += [f"{s['uid']:<4} {s['layers']:<7} {s['challenges']:<11} {s['failed']:<7} {s['route_audits']:<13} "
                  f"{s['tokens']:<7} {_number(s['step_ms'], 1):<8} {_number(s['weight'], 4):<7} "
                  f"{(s['reason'] or '')[:90]}" for s in stages]
    return "\n".join(lines)


def status(argv: list[str]) -> int:
    values = read_options(STATUS_OPTIONS, argv, prog=f"{validator_program()} status",
                          description="The validator's current view per miner, from its database.")
    try:
        with ValidatorStore(values["db"], readonly=True) as store:
            report = status_report(store)
    except ValidatorStoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if values["json"] else format_status(report))
    return 0


def run(argv: list[str]) -> int:
    settings = read_validator_settings(argv, prog=f"{validator_program()} run", description=__doc__)
    setup_logging(settings.log_level, settings.log_format)
    logging.getLogger("k3.validator").debug("settings: %s", describe_values(validator_options(), dataclasses.asdict(settings)))
    try:
        return asyncio.run(run_validator(settings))
    except ValidatorSetupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: {validator_program()} {{{','.join(COMMANDS)}}} [options]   (--help after a command lists "
              "its options)\n\n" + (__doc__ or ""), file=sys.stderr if argv and argv[0] not in ("-h", "--help")
              else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    return run(rest) if command == "run" else status(rest)


if __name__ == "__main__":
    sys.exit(main())
