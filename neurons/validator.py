#!/usr/bin/env python3
"""Kimi K3 subnet validator: measures and verifies miners, sets weights on chain.

    python neurons/validator.py run --network devnet:/tmp/k3/devnet.sqlite --netuid 1 \\
        --wallet-name validator --wallet-hotkey default --wallet-path ~/.bittensor/wallets \\
        --checkpoint ckpt/tiny --reference-engine --db ~/.k3-subnet/validator.sqlite
    python neurons/validator.py status --db ~/.k3-subnet/validator.sqlite [--json]
    python neurons/validator.py self-check --checkpoint ckpt/tiny --dtype bfloat16 --audits 100
    python neurons/validator.py self-check --checkpoint ckpt/tiny --endpoint http://127.0.0.1:8091 \\
        --miner-hotkey 5F... --wallet-name validator --audits 60
    python neurons/validator.py canaries --checkpoint ckpt/tiny --count 200 --out canaries.json

`run` options: `python neurons/validator.py run --help` (every flag also has an environment
variable; a flag wins). SIGINT or SIGTERM stops it after the current round's requests are cut;
a restart resumes from --db. `status` prints the validator's current view per miner from the
database (it works while the validator runs). `self-check` runs this validator's tier-1 rules on
answers of the checkpoint served in another precision (and with GPU-style kernels), against its own
fp32 reference, and prints the false-positive rate (exit 1 on any hard failure or over 1% soft).
With `--endpoint` it sends ordinary rounds to a served miner instead (signed with --wallet-*, for
the miner's --miner-hotkey), runs tiers 0-2 on every answer against the local fp32 reference and
prints the failures and a verdict (exit 0 pass, 1 fail, 2 cannot run). `canaries` writes the canary pool a
validator without a reference engine reads (--canary-pool), computed on any engine (--engine, as the miner's).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neurons.base.settings import (Option, WalletSettings, bind_defaults, describe_values, expanded_path,  # noqa: E402
                                   flag, open_wallet, optional_text, positive_float, program_name, read_options,
                                   wallet_options)
from neurons.validator_app.status import age, status_report  # noqa: E402
from neurons.validator_app.store import ValidatorStore, ValidatorStoreError  # noqa: E402

# `status` only reads the database: the rounds, the gateway and the reference engine (torch) are imported by the
# commands that need them, so that `status` answers in about a second.

STATUS_OPTIONS = (
    Option("db", "--db", "K3_VALIDATOR_DB", expanded_path, "the validator's database", group="status", metavar="FILE",
           default="~/.k3-subnet/validator.sqlite"),
    Option("json", "--json", None, flag, "print JSON instead of a table", group="status", default=False),
)
SELF_CHECK_OPTIONS = (
    Option("checkpoint", "--checkpoint", "K3_VALIDATOR_CHECKPOINT", expanded_path,
           "the model's checkpoint directory (it must fit in memory twice)", group="self-check", metavar="DIR",
           default=None),
    Option("dtype", "--dtype", None, str, "the honest miner's precision to check", group="self-check",
           choices=("bfloat16", "float16", "float32"), default="bfloat16"),
    Option("audits", "--audits", None, int, "audits per variant (with --endpoint: requests, each audited)",
           group="self-check", metavar="N", default=100),
    Option("endpoint", "--endpoint", None, optional_text, "audit this served miner (http://HOST:PORT) instead of "
           "in-process numerics", group="self-check", metavar="URL", default=None),
    Option("miner_hotkey", "--miner-hotkey", None, optional_text, "with --endpoint: the ss58 address of the hotkey "
           "the miner serves with (requests are signed for it)", group="self-check", metavar="SS58", default=None),
    Option("canaries", "--canaries", None, int, "with --endpoint: canaries computed by the reference and sent",
           group="self-check", metavar="N", default=8),
    Option("profile", "--scoring-profile", None, str, "with --endpoint: the scoring numbers to plan and judge by",
           group="self-check", choices=("production", "local_testnet"), default="production"),
    Option("overrides", "--scoring-overrides", None, optional_text, "with --endpoint: JSON object of "
           "scoring/config.py fields to change", group="self-check", metavar="JSON", default=None),
    Option("timeout_s", "--timeout-s", None, positive_float, "with --endpoint: longest wait for one answer",
           group="self-check", metavar="S", default=300.0),
    Option("seed", "--seed", None, int, "with --endpoint: seed of the planned work (default: random)",
           group="self-check", metavar="N", default=None),
) + bind_defaults(WalletSettings, wallet_options(), "wallet")
# the honest variants of scoring.envelope that a miner in each precision stands for
SELF_CHECK_VARIANTS = {"bfloat16": ("bf16", "bf16-gpu-kernels"), "float16": ("fp16",),
                       "float32": ("fp32-batched", "fp32-gpu-kernels")}
COMMANDS = ("run", "status", "self-check", "canaries")


def validator_program() -> str:
    return program_name("k3-validator", "neurons.validator")


def _number(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_status(report: dict) -> str:
    header = ("uid", "hotkey", "ttft_s/1k", "tok/s", "burst_tok/s", "long_ctx", "quality", "fails", "committed",
              "opened/failed", "score", "ema", "weight", "last failure", "why weight 0")
    rows = []
    for m in report["miners"]:
        rows.append((str(m["uid"]), m["hotkey"][:12] + "…" if len(m["hotkey"] or "") > 12 else m["hotkey"] or "",
                     _number(m["ttft_per_1k_s"]), _number(m["decode_tps"], 1), _number(m["burst_tps"], 1),
                     _number(m["long_context_share"], 2), _number(m["quality"], 2), str(m["failures"]),
                     _number(m.get("committed"), 2), f"{m.get('openings', 0)}/{m.get('openings_failed', 0)}",
                     _number(m["score"], 4), _number(m["ema"], 4), _number(m["weight"], 4),
                     (f"{age(m.get('last_failure_at'))}: {m['last_failure']}" if m["last_failure"] else "")[:80],
                     (m.get("zero_weight_reason") or "")[:70]))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    weights = "never" if report["weights_block"] is None else (
        f"at block {report['weights_block']}, {report['weights_set_at_utc'] or '?'} ({age(report['weights_set_at'])}; "
        f"version key {report['version_key']})")
    lines = [f"validator database {report['db']}: round {report['round']} "
             f"(completed {report['completed_round']}); weights last set {weights}",
             "  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    if not rows:
        lines.append("(no miners evaluated yet)")
    stages = report.get("stage_miners") or []
    if stages:
        lines += ["", "swarm stage miners:",
                  "uid  layers  checked  outside  unchecked  tokens  step_ms  weight  zeroed because"]
        lines += [f"{s['uid']:<4} {s['layers']:<7} {s['checked']:<8} {s['outside']:<8} {s['unchecked']:<10} "
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


def self_check(argv: list[str]) -> int:
    values = read_options(SELF_CHECK_OPTIONS, argv, prog="neurons/validator.py self-check",
                          description="The false-positive rate of this validator's tier-1 rules on honest answers.")
    if not values["checkpoint"] or not Path(values["checkpoint"], "config.json").exists():
        print("error: --checkpoint must name a checkpoint directory (with config.json)", file=sys.stderr)
        return 2
    if values["audits"] < 1:
        print("error: --audits must be at least 1", file=sys.stderr)
        return 2
    if values["endpoint"]:
        return self_check_endpoint(values)
    from scoring.envelope import measure_envelope, rate_table  # noqa: PLC0415 - loads torch

    report = measure_envelope(values["checkpoint"], audits_per_variant=values["audits"], max_tokens=24,
                              prompt_lengths=(16, 128), long_length=512, long_share=0.15, sharded=False,
                              only=SELF_CHECK_VARIANTS[values["dtype"]])
    print("\n".join(rate_table(report)))
    answers = sum(len(r.answers) for r in report.honest)
    hard = sum(r.rate("new_failures", True) * len(r.answers) for r in report.honest)
    soft = sum(r.rate("new_failures", False) * len(r.answers) for r in report.honest)
    print(f"\n{answers} honest {values['dtype']} audits against the fp32 reference: {hard:.0f} hard and {soft:.0f} "
          f"soft failures (false-positive rate {(hard + soft) / max(1, answers):.4f})")
    return 1 if hard or soft > 0.01 * answers else 0


def self_check_endpoint(values: dict) -> int:
    """`self-check --endpoint URL`: tiers 0-2 on a served miner against the local reference."""
    import asyncio  # noqa: PLC0415

    from neurons.base.settings import WalletNotFound  # noqa: PLC0415
    from neurons.validator_app.self_check import SelfCheckError, check_endpoint  # noqa: PLC0415 - loads torch
    from neurons.validator_app.settings import ScoringSettings, ValidatorSettings, ValidatorSetupError  # noqa: PLC0415
    from protocol.client import ClientTimeouts  # noqa: PLC0415

    url = values["endpoint"]
    if not url.startswith(("http://", "https://")):
        print(f"error: --endpoint {url!r} must be the miner's http://HOST:PORT", file=sys.stderr)
        return 2
    if not values["miner_hotkey"]:
        print("error: --endpoint needs --miner-hotkey, the ss58 address of the miner's hotkey (requests are signed "
              "for it)", file=sys.stderr)
        return 2
    if values["canaries"] < 0:
        print("error: --canaries must be 0 or more", file=sys.stderr)
        return 2
    try:
        wallet = open_wallet(WalletSettings(**values["wallet"]))
        config = ValidatorSettings(scoring=ScoringSettings(values["profile"], values["overrides"])).scoring_config()
    except (WalletNotFound, ValidatorSetupError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    limit = values["timeout_s"]
    timeouts = ClientTimeouts(connect=min(5.0, limit), first_byte=limit, between_events=min(30.0, limit), total=limit)
    try:
        check = asyncio.run(check_endpoint(url, values["miner_hotkey"], wallet, values["checkpoint"],
                                           requests=values["audits"], canaries=values["canaries"], config=config,
                                           timeouts=timeouts, seed=values["seed"],
                                           progress=lambda line: print(line, file=sys.stderr, flush=True)))
    except SelfCheckError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("\n".join(check.summary_lines()))
    return 0 if check.verdict()[0] else 1


def canaries(argv: list[str]) -> int:
    """`canaries`: write a canary pool computed on a reference deployment (neurons/validator_app/canary_pool.py)."""
    import asyncio  # noqa: PLC0415

    from inference.serving import EngineSpec  # noqa: PLC0415
    from neurons.base.settings import build_settings  # noqa: PLC0415
    from neurons.validator_app.canary_pool import (CANARY_OPTIONS, CanaryPoolSetupError,  # noqa: PLC0415 - torch
                                                   scoring_config, write_canary_pool)
    from neurons.validator_app.settings import ValidatorSetupError  # noqa: PLC0415

    values = read_options(CANARY_OPTIONS, argv, prog=f"{validator_program()} canaries",
                          description="Write the canary pool a validator without a reference engine reads "
                                      "(--canary-pool), computed on this engine.")
    try:
        config = scoring_config(values["profile"], values["overrides"])
        asyncio.run(write_canary_pool(build_settings(EngineSpec, values["engine"]), values["count"], values["out"],
                                      config, values["seed"], say=lambda line: print(line, flush=True)))
    except (CanaryPoolSetupError, ValidatorSetupError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def run(argv: list[str]) -> int:
    from neurons.base.observability import run_neuron  # noqa: PLC0415 (see the imports above)
    from neurons.validator_app.rounds import run_validator  # noqa: PLC0415
    from neurons.validator_app.settings import (ValidatorSetupError, read_validator_settings,  # noqa: PLC0415
                                                validator_options)

    settings = read_validator_settings(argv, prog=f"{validator_program()} run", description=__doc__)
    return run_neuron(settings, lambda: run_validator(settings), ValidatorSetupError, "k3.validator",
                      describe_values(validator_options(), dataclasses.asdict(settings)))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: {validator_program()} {{{','.join(COMMANDS)}}} [options]   (--help after a command lists "
              "its options)\n\n" + (__doc__ or ""), file=sys.stderr if argv and argv[0] not in ("-h", "--help")
              else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    return {"run": run, "status": status, "self-check": self_check, "canaries": canaries}[command](rest)


if __name__ == "__main__":
    sys.exit(main())
