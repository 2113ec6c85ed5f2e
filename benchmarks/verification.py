"""Re-measure the honest-numerics envelope of the tier-1 audits (scoring/envelope.py).

    python -m benchmarks.verification --checkpoint ckpt/tiny --audits 200
    python -m benchmarks.verification --random-tiny --audits 40 --no-sharded   # quick look
    python -m benchmarks.verification --load run*.pkl --write-envelope envelope.json   # the per-model bounds
    python -m benchmarks.verification --load run*.pkl --envelope envelope.json         # judged by them
    python -m benchmarks.verification --load run*.pkl --write-replay envelope.json     # its replay section
    python -m benchmarks.verification --checkpoint ckpt/tiny --device cuda --write-envelope envelope.json

Prints, per variant (honest numerics and cheaters) and statistic, the median, the 99th percentile and
the worst value; the false-positive rate of the old and the new rules per honest variant; the
detection rate and requests-to-detect per cheater; and the replay of sampled answers (k3-gumbel/1) per
variant: tokens that are not the replayed one, and answers failed.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", nargs="+", help="re-judge saved measurements (--save files) under today's rules")
    source.add_argument("--checkpoint", help="checkpoint directory (its fp32 model is the reference)")
    source.add_argument("--random-tiny", action="store_true", help="a seeded random tiny checkpoint")
    parser.add_argument("--audits", type=int, default=200, help="audits per variant (slow variants run fewer)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--long-length", type=int, default=768, help="bytes of a long-context prompt")
    parser.add_argument("--long-share", type=float, default=0.2, help="share of long-context prompts")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(16, 256), help="short prompt size range")
    parser.add_argument("--no-sharded", action="store_true", help="skip the sharded variants (two processes each)")
    parser.add_argument("--only", "--variants", nargs="*", help="only these variants (by name)")
    parser.add_argument("--other-checkpoint", help="the cheaters' other model (default: a random model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--greedy-share", type=float, default=0.35, help="share of greedy requests (the rest sampled)")
    parser.add_argument("--temperatures", type=float, nargs=2, default=(0.3, 1.0),
                        help="range of the sampled requests' temperatures")
    parser.add_argument("--save", help="also write the measured statistics here (to re-judge with --load)")
    parser.add_argument("--envelope", help="judge by this per-model envelope file (ScoringConfig.logprob_gap_envelope)")
    parser.add_argument("--write-envelope", help="write the per-model envelope measured by the honest variants here "
                                                 "(JSON, scoring/model_envelope.py)")
    parser.add_argument("--write-replay", metavar="ENVELOPE",
                        help="set the replay section (near-tie allowance and honest rate per precision, from the "
                             "honest variants' sampled answers) of this envelope file, measured on the same model")
    parser.add_argument("--holdout", action="store_true", help="also check the envelope on audits it was not "
                                                                "measured on (two halves, each judged by the other's)")
    parser.add_argument("--markdown", action="store_true", help="also print the rate tables as markdown (the docs)")
    parser.add_argument("--device", default="cpu", help="cuda or cuda:N: the honest variants include the miner on "
                                                        "that GPU, fp32 and bf16 (the reference stays fp32 on the CPU)")
    args = parser.parse_args(argv)

    from inference.model import device_problem  # noqa: PLC0415
    from scoring.config import ScoringConfig  # noqa: PLC0415
    from scoring.envelope import (format_report, load_reports, markdown_tables, measure_envelope,  # noqa: PLC0415
                                  save_report)
    if device_problem(args.device):
        parser.error(device_problem(args.device))
    started = time.perf_counter()
    config = ScoringConfig.local_testnet(logprob_gap_envelope=args.envelope)
    if args.load:
        report = load_reports(args.load, config)
        print(format_report(report))
        if args.markdown:
            print("\n" + "\n".join(markdown_tables(report)))
        if args.holdout:
            from scoring.envelope import holdout_table  # noqa: PLC0415
            print("\n== the envelope on held-out audits (built from one half of each variant, judging the other)")
            print("\n".join(holdout_table(report)))
        print(f"\n{sum(len(r.answers) for r in report.results)} audits re-judged")
        write(report, args.write_envelope)
        write_replay(report, args.write_replay)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if args.random_tiny:
            from inference.model import ModelConfig, make_random_checkpoint  # noqa: PLC0415
            checkpoint = f"{tmp}/tiny"
            make_random_checkpoint(ModelConfig.tiny(), checkpoint, seed=args.seed, progress=False)
        report = measure_envelope(checkpoint, device=args.device, audits_per_variant=args.audits,
                                  max_tokens=args.max_tokens,
                                  long_length=args.long_length, sharded=not args.no_sharded, seed=args.seed,
                                  only=args.only, other_checkpoint=args.other_checkpoint,
                                  prompt_lengths=tuple(args.prompt_tokens), long_share=args.long_share, config=config,
                                  greedy_share=args.greedy_share, temperatures=tuple(args.temperatures),
                                  progress=lambda line: print(line, file=sys.stderr, flush=True),
                                  on_variant=(lambda partial: save_report(partial, args.save)) if args.save else None)
        if args.save:
            save_report(report, args.save)
        print(format_report(report))
        if args.markdown:
            print("\n" + "\n".join(markdown_tables(report)))
    print(f"\n{sum(len(r.answers) for r in report.results)} audits in {time.perf_counter() - started:.0f} s")
    write(report, args.write_envelope)
    write_replay(report, args.write_replay)
    return 0


def write(report, path) -> None:
    if not path:
        return
    import json  # noqa: PLC0415

    from scoring.envelope import envelope_file  # noqa: PLC0415
    data = envelope_file(report)
    with open(path, "w") as out:
        json.dump(data, out, indent=1)
        out.write("\n")
    for key, entry in data["precisions"].items():
        bins = ", ".join(f"{b['prompt_tokens'][0]}-{b['prompt_tokens'][1]} tokens: soft {b['soft']:g} "
                         f"({b['audits']} audits, worst {b['worst']:g})" for b in entry["bins"])
        print(f"envelope {key}: {bins}")
    print(f"wrote {path}")


def write_replay(report, path) -> None:
    """Set the replay section of the envelope file at `path` (its other sections stay as they are)."""
    if not path:
        return
    import json  # noqa: PLC0415

    from inference.model import fingerprint  # noqa: PLC0415
    from scoring.envelope import replay_section  # noqa: PLC0415
    from scoring.model_envelope import ModelEnvelopeError, parse_envelope, with_replay  # noqa: PLC0415
    try:
        data = json.loads(open(path).read())
        measured_on = parse_envelope(data, path).fingerprint
    except (OSError, ValueError, ModelEnvelopeError) as error:
        raise SystemExit(f"error: cannot use {path} as an envelope file: {error}") from None
    model = fingerprint(report.checkpoint)
    if measured_on != model:
        raise SystemExit(f"error: {path} was measured on model {measured_on}, these replays on {model}")
    section = replay_section(report)
    with open(path, "w") as out:
        json.dump(with_replay(data, section), out, indent=1)
        out.write("\n")
    for key, entry in section["precisions"].items():
        print(f"replay {key}: delta {entry['delta']:g} nats, rate_95 {entry['rate_95']:.2e} "
              f"({entry['positions']} sampled tokens, {entry['mismatches']} mismatched, worst gap {entry['worst_gap']:g})")
    print(f"wrote the replay section of {path}")


if __name__ == "__main__":
    sys.exit(main())
