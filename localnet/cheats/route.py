"""Cheating route drivers, for the local swarm: `python -m localnet.cheats.route --cheat KIND ROUTE_MINER_FLAGS`
is the route miner (neurons/route_miner.py, same flags, same honest routes) with one dishonest habit:

- `forge-receipts`: its work reports (--report-work) also claim sessions the stages never served: each real step
  is claimed a second time under a fresh session id, its receipts re-signed by the driver's own key in the
  stages' names (`ReceiptForger`). The validator finds receipts not signed by the stages they name and blames the
  driver.
- `self-driver`: drives sessions nobody asked for through one route it keeps (the stages it favours: say, its
  operator's own) and claims their genuine receipts, under the id of the last request a validator really sent it
  (`SelfDriver`). Receipts prove work was done, not that anyone wanted it: the validator credits route work only
  for requests it sent this driver, and at most the tokens it measured for each, so the extra sessions earn the
  favoured stages nothing.
"""
from __future__ import annotations

import asyncio
import logging
import random
import secrets
import sys

from inference.decoding.sampling import SamplingParams
from neurons.route_miner import WorkReport, main as route_miner_main
from protocol.stage import sign_receipt

MODULE = "localnet.cheats.route"
log = logging.getLogger("k3.cheat.route")


class ReceiptForger(WorkReport):
    """Claims every real step, and each one again in a session that never ran, with receipts it signed itself."""

    def claims(self, records: list):
        real = super().claims(records)
        forged, sessions = [], {}
        for step in real:
            session = sessions.setdefault(step.session, secrets.token_hex(12))
            receipts = [sign_receipt(self.keypair, **(r.model_dump(exclude={"stage", "signature"})
                                                       | {"session": session})).model_copy(update={"stage": r.stage})
                        for r in step.receipts]
            forged.append(step.model_copy(update={"session": session, "receipts": receipts}))
        return [x for pair in zip(real, forged) for x in pair]


class SelfDriver(WorkReport):
    """Besides the real sessions, one session of its own every `every_s` / 2 through the route it keeps, claimed
    like the rest (module doc)."""

    async def run(self) -> None:
        self.driver.balance = False  # keep one route: the favoured stages get every session it drives itself
        driving = asyncio.create_task(self._drive())
        try:
            await super().run()
        finally:
            driving.cancel()

    async def _drive(self) -> None:
        rng = random.Random(secrets.randbits(64))
        vocab = self.driver.config.vocab_size
        while True:
            await asyncio.sleep(max(0.2, self.every_s / 2))
            prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(24, 96))]
            asked = next((r.request_id for r in reversed(self.driver.records) if r.request_id), "")
            try:
                rs = await self.driver.open(SamplingParams(), rng.getrandbits(62), request_id=asked)
                try:
                    await self.driver.run(rs, [(prompt, "sample", None)])
                finally:
                    await self.driver.close(rs)
            except Exception as e:  # noqa: BLE001 (no route right now: try again later)
                log.debug("self-driven session failed: %s", e)


DRIVER_CHEATS = {"forge-receipts": ReceiptForger, "self-driver": SelfDriver}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    kind = "forge-receipts"
    if argv[:1] == ["--cheat"] and len(argv) > 1:
        kind, argv = argv[1], argv[2:]
    if kind not in DRIVER_CHEATS:
        print(f"{MODULE}: error: --cheat must be one of {sorted(DRIVER_CHEATS)}", file=sys.stderr)
        return 2
    return route_miner_main(argv, prog=f"python -m {MODULE} --cheat {kind}", report=DRIVER_CHEATS[kind])


if __name__ == "__main__":
    sys.exit(main())
