"""A stage's ledger: what it computed in each recent session, kept so that a validator can check any session
after it ended.

Every receipt a stage signs commits it to the exact bytes it took in and sent on (their sha256). The ledger keeps
those bytes, with the forward's header fields, for `retain_s` seconds and at most `max_bytes` in all (the oldest
sessions go first). A validator picks sessions to check only after they ran and asks for their records
(protocol.stage.LEDGER_PATH): the stage cannot tell at compute time which of its sessions will be looked at, and
what it answers must hash to what it signed. The same bytes are also in its neighbours' ledgers (its input is
the previous stage's output, its output the next stage's input), so a record can be had even from a stage that
will not give its own.
"""
from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field

import aiohttp

from neurons.swarm.signed_http import post_signed
from protocol.stage import (LEDGER_PATH, MAX_LEDGER_STEPS, Hop, LedgerHeader, LedgerRequest, LedgerStep, Receipt,
                            StageWireError, WireSampling, WireTensorSpec, encode_frame, parse_model, split_frame)


@dataclass
class LedgerEntry:
    step: LedgerStep
    input_body: bytes
    output_body: bytes

    @property
    def nbytes(self) -> int:
        return len(self.input_body) + len(self.output_body)


@dataclass
class SessionRecord:
    route_id: str
    session: str
    sampling: WireSampling
    seed: int
    entries: list[LedgerEntry] = field(default_factory=list)
    touched: float = 0.0
    nbytes: int = 0


class StageLedger:
    """The records of the stage's recent sessions, bounded in age and bytes."""

    def __init__(self, layers: tuple[int, int], retain_s: float = 900.0, max_bytes: int = 256 << 20):
        self.layers = list(layers)
        self.retain_s = retain_s
        self.max_bytes = max_bytes
        self.sessions: collections.OrderedDict[tuple[str, str], SessionRecord] = collections.OrderedDict()
        self.nbytes = 0
        self.dropped = 0  # sessions forgotten before retain_s for want of room

    def open(self, route_id: str, session: str, sampling: WireSampling, seed: int) -> None:
        key = (route_id, session)
        self._forget(key)
        self.sessions[key] = SessionRecord(route_id, session, sampling, seed, touched=time.monotonic())
        self._bound()

    def add(self, route_id: str, session: str, *, step: int, position: int, mode: str, targets, top_k: int,
            rewind, input_specs: list[WireTensorSpec], input_body: bytes, output_specs: list[WireTensorSpec],
            output_body: bytes, receipt: Receipt) -> None:
        record = self.sessions.get((route_id, session))
        if record is None or len(record.entries) >= MAX_LEDGER_STEPS:
            return  # opened before a restart, or longer than any answer could hold: not kept
        entry = LedgerEntry(LedgerStep(step=step, position=position, mode=mode, targets=targets, top_k=top_k,
                                       rewind=rewind, inputs=list(input_specs), outputs=list(output_specs),
                                       output_bytes=len(output_body), receipt=receipt),
                            bytes(input_body), bytes(output_body))
        record.entries.append(entry)
        record.nbytes += entry.nbytes
        record.touched = time.monotonic()
        self.nbytes += entry.nbytes
        self.sessions.move_to_end((route_id, session))
        self._bound()

    def answer(self, route_id: str, session: str, from_step: int, max_body_bytes: int) -> bytes | None:
        """The ledger frame for one session from `from_step` (as many steps as fit `max_body_bytes`, at least
        one), or None when the session is not (or no longer) held."""
        self._expire()
        record = self.sessions.get((route_id, session))
        if record is None:
            return None
        steps, parts, size, more = [], [], 0, False
        for e in record.entries:
            if e.step.step < from_step:
                continue
            if steps and size + e.nbytes > max_body_bytes:
                more = True
                break
            steps.append(e.step)
            parts += [e.input_body, e.output_body]
            size += e.nbytes
        header = LedgerHeader(route_id=route_id, session=session, layers=self.layers, sampling=record.sampling,
                              seed=record.seed, steps=steps, more=more)
        return encode_frame(header, b"".join(parts))

    def _forget(self, key) -> None:
        record = self.sessions.pop(key, None)
        if record is not None:
            self.nbytes -= record.nbytes

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.retain_s
        while self.sessions:
            key, record = next(iter(self.sessions.items()))
            if record.touched >= cutoff:
                break
            self._forget(key)

    def _bound(self) -> None:
        self._expire()
        while self.nbytes > self.max_bytes and len(self.sessions) > 1:
            self._forget(next(iter(self.sessions)))
            self.dropped += 1


def split_ledger(header: LedgerHeader, body: bytes) -> list[tuple[LedgerStep, bytes, bytes]]:
    """(step, input bytes, output bytes) of each step of a ledger frame; ValueError when the body does not hold
    exactly what the steps say."""
    out, offset = [], 0
    for s in header.steps:
        n_in = sum(t.nbytes for t in s.inputs)
        n_out = s.output_bytes
        if s.outputs and n_out != sum(t.nbytes for t in s.outputs):
            raise ValueError(f"step {s.step}: output specs hold {sum(t.nbytes for t in s.outputs)} bytes, "
                             f"{n_out} said")
        if offset + n_in + n_out > len(body):
            raise ValueError(f"step {s.step}: the body ends inside it")
        out.append((s, bytes(body[offset:offset + n_in]), bytes(body[offset + n_in:offset + n_in + n_out])))
        offset += n_in + n_out
    if offset != len(body):
        raise ValueError(f"{len(body) - offset} bytes after the last step")
    return out


class LedgerUnavailable(Exception):
    """A stage did not give a session's record: unreachable, slow, refused, not retained or malformed. A fault
    (what a validator checks with comes from the neighbours instead), not evidence of a lie."""


async def read_ledger(http: aiohttp.ClientSession, keypair, hop: Hop, route_id: str, session: str,
                      timeout_s: float, max_pages: int = 64) -> tuple[LedgerHeader, list[tuple[LedgerStep, bytes, bytes]]]:
    """A stage's whole record of one session (page after page while it says there is more), or
    LedgerUnavailable. The bytes are not checked here against the receipts: the caller does."""
    header, steps, from_step = None, [], 0
    for _ in range(max_pages):
        body = LedgerRequest(route_id=route_id, session=session, from_step=from_step).model_dump_json().encode()
        try:
            status, answer = await post_signed(http, keypair, hop, LEDGER_PATH, body, timeout_s, "application/json")
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
            raise LedgerUnavailable(f"{hop.url} unreachable: {type(e).__name__}") from None
        if status != 200:
            raise LedgerUnavailable(f"{hop.url} answered {status}: {answer[:200].decode(errors='replace')}")
        try:
            head, raw = split_frame(answer, max(len(answer), 1))
            page = parse_model(LedgerHeader, head, "ledger")
            steps += split_ledger(page, bytes(raw))
        except (StageWireError, ValueError) as e:
            raise LedgerUnavailable(f"{hop.url} sent a malformed ledger: {e}") from None
        header = header or page
        if not page.more or not page.steps:
            return header, steps
        from_step = page.steps[-1].step + 1
    raise LedgerUnavailable(f"{hop.url}: the session's record did not end within {max_pages} pages")


__all__ = ["LedgerEntry", "LedgerUnavailable", "SessionRecord", "StageLedger", "read_ledger", "split_ledger"]
