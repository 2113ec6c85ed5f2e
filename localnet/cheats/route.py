"""A cheating route driver, for the local swarm: `python -m localnet.cheats.route ROUTE_MINER_FLAGS` is the
route miner (neurons/route_miner.py, same flags, same honest routes), whose work reports to the validator
(--report-work) also claim sessions the stages never served: each real step is claimed a second time under a
fresh session id, its receipts re-signed by the driver's own key in the stages' names (`ReceiptForger`). It
would inflate the route work credited to the stages it routes through; the validator's audit finds receipts not
signed by the stages they name and blames the driver.
"""
from __future__ import annotations

import secrets
import sys

from neurons.route_miner import WorkReport, main as route_miner_main
from protocol.stage import sign_receipt

MODULE = "localnet.cheats.route"


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


def main(argv: list[str] | None = None) -> int:
    return route_miner_main(argv, prog=f"python -m {MODULE}", report=ReceiptForger)


if __name__ == "__main__":
    sys.exit(main())
