"""The stage wire: messages between swarm parties (route drivers and stage miners), receipts, capabilities.

Every request is signed with btauth/1 over the exact body bytes (protocol.auth: receiver-bound, fresh, no
replay). Control messages (open, rewind, fork, close) are compact JSON. A forward, and the result the last
stage sends to the route driver, is a binary frame:

    b"K3SW" | version u8 (1) | header length u32 LE | header (UTF-8 JSON) | body

The header names the tensors in the body in order (`tensors`: name, dtype, shape); the body is their raw
little-endian bytes back to back, nothing else (its length must equal the sum exactly). Residual-state
tensors are float32 or bfloat16 [N, D]; the first stage's input is int32 token ids [N].

Route: driver -> stage 1 -> ... -> stage N -> driver. Each stage answers its sender 202 once the forward is
validated (4xx otherwise, the session untouched), computes, and sends its output to the next hop (or the
head's result to the driver); a stage that cannot compute or reach its next hop sends the driver an error
result naming the hop. Each stage appends a signed receipt (route, session, step, layer range, fingerprint,
sha256 of the input state, sha256 of the output state) to the frame header; the receipts chain: the output
hash of stage i is the input hash of stage i+1, the driver's input hash is that of the token-id frame.

A forward may carry a rewind (`ForwardHeader.rewind` = P): every stage first returns its session to position P,
exactly as the rewind message would (same bounds: 0 <= P <= the session's position, 400 otherwise; 409 when P
is older than the stage can rewind to), and then runs the forward, which must start at P. So after a rejected
speculative draft the driver's next forward takes the rewind along and no separate round trip is needed. A
refused forward leaves the session as it was, rewind included. Stages that understand it say so in their
capabilities (`capacity["forward_rewind"] == 1`); the field is left out of headers that carry no rewind, so
stages that predate it still parse every other forward, and the rewind message stays.

`state_sha256(specs, body)` hashes a state as sent: the canonical JSON of its tensor specs, then the body.
"""
from __future__ import annotations

import hashlib
import json
import struct
from typing import Any, Literal, Optional

import numpy as np
from bittensor.sp_core import CRYPTO_SR25519, verify as sp_core_verify
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .schemas import describe_validation_error

STAGE_PROTOCOL = "k3-stage/1"
OPEN_PATH = "/stage/open"
FORWARD_PATH = "/stage/forward"
REWIND_PATH = "/stage/rewind"
FORK_PATH = "/stage/fork"
CLOSE_PATH = "/stage/close"
CAPABILITIES_PATH = "/stage/capabilities"
HEALTH_PATH = "/stage/health"
LEDGER_PATH = "/stage/ledger"
RESULT_PATH = "/route/result"
FRAME_CONTENT_TYPE = "application/x-k3-stage-frame"

FRAME_MAGIC = b"K3SW"
FRAME_VERSION = 1
_PREFIX = struct.Struct("<4sBI")
MAX_HEADER_BYTES = 256 * 1024
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_TENSORS = 64
MAX_TOKENS = 1 << 16
MAX_WIDTH = 1 << 16
MAX_RECEIPTS = 128
MAX_TOP_K = 20
WIRE_DTYPES = {"float32": 4, "bfloat16": 2, "int32": 4}
STAGE_NUMERICS = ("float32", "bfloat16", "float16")  # what a stage computes its block in (its weights' dtype)
MAX_LEDGER_STEPS = 4096
RECEIPT_DOMAIN = b"k3-subnet/stage-receipt/v1\n"
CAPABILITIES_DOMAIN = b"k3-subnet/stage-capabilities/v1\n"

_ID = r"^[A-Za-z0-9._:\-]+$"
_HEX64 = r"^[0-9a-f]{64}$"
_SS58 = r"^[1-9A-HJ-NP-Za-km-z]{40,60}$"


class StageWireError(Exception):
    """A message the receiver refuses: answer `status` with `code` and `message`."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Hop(_Msg):
    url: str = Field(min_length=8, max_length=256, pattern=r"^https?://[A-Za-z0-9.\-\[\]:]+$")
    hotkey: str = Field(pattern=_SS58)


class WireSampling(_Msg):
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1 << 20)
    logprobs: int = Field(0, ge=0, le=MAX_TOP_K)


class OpenRequest(_Msg):
    protocol: Literal["k3-stage/1"] = STAGE_PROTOCOL
    route_id: str = Field(min_length=1, max_length=128, pattern=_ID)
    session: str = Field(min_length=1, max_length=128, pattern=_ID)
    position: int = Field(0, ge=0, le=0)  # a session opens empty; fork makes a copy at a position
    upstream: str = Field(pattern=_SS58)  # the hotkey that will send forwards
    downstream: Optional[Hop] = None  # the next stage; None on the last stage (its output goes to reply_to)
    reply_to: Hop  # the route driver
    sampling: WireSampling = WireSampling()
    seed: int = Field(0, ge=0, lt=2**64)  # the request's seed: the head samples under k3-gumbel/1 with it
    prompt_tokens: int = Field(0, ge=0, le=2**31 - 1)  # the head samples position p as generated-token index p - this


class RewindRequest(_Msg):
    session: str = Field(min_length=1, max_length=128, pattern=_ID)
    position: int = Field(ge=0, le=2**31 - 1)


class ForkRequest(_Msg):
    session: str = Field(min_length=1, max_length=128, pattern=_ID)
    new_session: str = Field(min_length=1, max_length=128, pattern=_ID)


class CloseRequest(_Msg):
    session: str = Field(min_length=1, max_length=128, pattern=_ID)


class WireTensorSpec(_Msg):
    name: str = Field(min_length=1, max_length=32, pattern=r"^[a-z_]+(\.[0-9]{1,3})?$")
    dtype: Literal["float32", "bfloat16", "int32"]
    shape: list[int] = Field(min_length=1, max_length=2)

    @property
    def nbytes(self) -> int:
        n = WIRE_DTYPES[self.dtype]
        for s in self.shape:
            n *= s
        return n


class Receipt(_Msg):
    route_id: str = Field(min_length=1, max_length=128, pattern=_ID)
    session: str = Field(min_length=1, max_length=128, pattern=_ID)
    step: int = Field(ge=0, le=2**31 - 1)
    layers: list[int] = Field(min_length=2, max_length=2)  # [start, stop)
    fingerprint: str = Field(min_length=1, max_length=64, pattern=_ID)
    input_sha256: str = Field(pattern=_HEX64)
    output_sha256: str = Field(pattern=_HEX64)
    stage: str = Field(pattern=_SS58)
    driver: str = Field(pattern=_SS58)  # who opened the session: the only party the work may be credited to
    signature: str = Field(default="", max_length=256, pattern=r"^[0-9a-f]*$")

    def payload(self) -> bytes:
        fields = self.model_dump(exclude={"signature"})
        return RECEIPT_DOMAIN + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


class ForwardHeader(_Msg):
    kind: Literal["forward"] = "forward"
    route_id: str = Field(min_length=1, max_length=128, pattern=_ID)
    session: str = Field(min_length=1, max_length=128, pattern=_ID)
    step: int = Field(ge=0, le=2**31 - 1)
    position: int = Field(ge=0, le=2**31 - 1)
    # verify (speculative decoding): the tokens are the last one then k drafts, `targets` the k drafts; the
    # head accepts or rejects them and answers the emitted tokens (the driver then rewinds every stage)
    mode: Literal["none", "sample", "score", "verify"] = "none"
    targets: Optional[list[int]] = Field(None, max_length=MAX_TOKENS)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)
    # first return the session to this position (the rewind message's bounds); the forward then starts there
    rewind: Optional[int] = Field(None, ge=0, le=2**31 - 1)
    receipts: list[Receipt] = Field(default_factory=list, max_length=MAX_RECEIPTS)
    tensors: list[WireTensorSpec] = Field(min_length=1, max_length=MAX_TENSORS)


class ResultError(_Msg):
    code: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9_]+$")
    message: str = Field(max_length=1024)
    stage: str = Field(pattern=_SS58)  # who reports
    blame: str = Field("", max_length=256)  # the hop that failed (url or hotkey), "" when the reporter itself


class ResultHeader(_Msg):
    kind: Literal["result"] = "result"
    route_id: str = Field(min_length=1, max_length=128, pattern=_ID)
    session: str = Field(min_length=1, max_length=128, pattern=_ID)
    step: int = Field(ge=0, le=2**31 - 1)
    receipts: list[Receipt] = Field(default_factory=list, max_length=MAX_RECEIPTS)
    error: Optional[ResultError] = None
    tensors: list[WireTensorSpec] = Field(default_factory=list, max_length=0)


class StageCapabilities(_Msg):
    protocol: Literal["k3-stage/1"] = STAGE_PROTOCOL
    model_id: str = Field(min_length=1, max_length=128)
    config_hash: str = Field(min_length=1, max_length=128, pattern=_ID)
    num_layers: int = Field(ge=1, le=4096)
    hidden_size: int = Field(ge=1, le=MAX_WIDTH)
    vocab_size: int = Field(ge=2, le=2**31 - 1)
    layers: list[int] = Field(min_length=2, max_length=2)  # [start, stop)
    embedding: bool
    head: bool
    fingerprint: str = Field(min_length=1, max_length=64, pattern=_ID)
    capacity: dict[str, int] = Field(max_length=16)  # sessions, tokens_per_forward, context
    step_ms: Optional[float] = Field(None, ge=0.0, le=1e7)  # measured single-token forward
    # the numerics it computes in and sends on: a validator judges its outputs against the honest envelope of
    # these, and a route through it declares the worst numerics of its stages
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    wire_dtype: Literal["float32", "bfloat16"] = "float32"
    retain_s: float = Field(0.0, ge=0.0, le=7 * 24 * 3600.0)  # how long it keeps its ledger (LEDGER_PATH)
    max_body_bytes: int = Field(ge=1, le=2**40)
    url: str = Field(min_length=8, max_length=256)
    hotkey: str = Field(pattern=_SS58)
    software_version: str = Field(min_length=1, max_length=64)
    signed_at: float
    signature: str = Field(default="", max_length=256, pattern=r"^[0-9a-f]*$")

    def payload(self) -> bytes:
        fields = self.model_dump(exclude={"signature"})
        return CAPABILITIES_DOMAIN + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


class LedgerRequest(_Msg):
    """Ask a stage for what it computed in one session: every step's input and output as sent, with its
    receipt (`LedgerHeader`). Steps from `from_step` on, as many as fit the answer's body limit."""

    route_id: str = Field(min_length=1, max_length=128, pattern=_ID)
    session: str = Field(min_length=1, max_length=128, pattern=_ID)
    from_step: int = Field(0, ge=0, le=2**31 - 1)


class LedgerStep(_Msg):
    step: int = Field(ge=0, le=2**31 - 1)
    position: int = Field(ge=0, le=2**31 - 1)
    mode: Literal["none", "sample", "score", "verify"] = "none"
    targets: Optional[list[int]] = Field(None, max_length=MAX_TOKENS)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)
    rewind: Optional[int] = Field(None, ge=0, le=2**31 - 1)
    inputs: list[WireTensorSpec] = Field(min_length=1, max_length=MAX_TENSORS)
    outputs: list[WireTensorSpec] = Field(default_factory=list, max_length=MAX_TENSORS)  # none: a head's JSON
    output_bytes: int = Field(ge=0, le=2**40)  # the head's answer is JSON: its length is not in its specs
    receipt: Receipt


class LedgerHeader(_Msg):
    """A stage's record of one session (`LedgerRequest`): the sampling it was opened with, then per step the
    forward's header fields, the specs of its input and output and the receipt it signed. The body holds each
    step's input bytes then output bytes, step after step; every pair hashes (`state_sha256`) to its receipt's
    input and output hashes, so a record can be checked against receipts others hold."""

    kind: Literal["ledger"] = "ledger"
    route_id: str = Field(min_length=1, max_length=128, pattern=_ID)
    session: str = Field(min_length=1, max_length=128, pattern=_ID)
    layers: list[int] = Field(min_length=2, max_length=2)
    sampling: WireSampling = WireSampling()
    seed: int = Field(0, ge=0, lt=2**63)
    steps: list[LedgerStep] = Field(default_factory=list, max_length=MAX_LEDGER_STEPS)
    more: bool = False  # steps after these did not fit: ask again from the next step
    tensors: list[WireTensorSpec] = Field(default_factory=list, max_length=0)


# ---------------------------------------------------------------- signing
def _sign(keypair, payload: bytes) -> str:
    if getattr(keypair, "crypto_type", CRYPTO_SR25519) != CRYPTO_SR25519:
        raise ValueError("stage signatures use sr25519")
    return bytes(keypair.sign(payload)).hex()


def _verify(payload: bytes, signature: str, hotkey: str) -> bool:
    try:
        return bool(sp_core_verify(payload, bytes.fromhex(signature), hotkey, CRYPTO_SR25519))
    except ValueError:
        return False


def sign_receipt(keypair, **fields) -> Receipt:
    receipt = Receipt(stage=keypair.ss58_address, **fields)
    return receipt.model_copy(update={"signature": _sign(keypair, receipt.payload())})


def verify_receipt(receipt: Receipt, expected_hotkey: str | None = None) -> bool:
    if expected_hotkey is not None and receipt.stage != expected_hotkey:
        return False
    return bool(receipt.signature) and _verify(receipt.payload(), receipt.signature, receipt.stage)


def verify_receipt_chain(receipts: list[Receipt], route_id: str, session: str, step: int, input_sha256: str,
                         hotkeys: list[str] | None = None, driver: str | None = None) -> str | None:
    """None when the receipts are a valid chain from `input_sha256` for this route, session and step (and
    from these stage hotkeys in order, and for this driver's session, if given), else what is wrong."""
    h = input_sha256
    if hotkeys is not None and [r.stage for r in receipts] != list(hotkeys):
        return f"receipts come from {[r.stage for r in receipts]}, the route is {hotkeys}"
    for i, r in enumerate(receipts):
        if (r.route_id, r.session, r.step) != (route_id, session, step):
            return f"receipt {i} is for another route, session or step"
        if driver is not None and r.driver != driver:
            return f"receipt {i} ({r.stage}) names {r.driver} as the session's driver, not {driver}"
        if r.input_sha256 != h:
            return f"receipt {i} ({r.stage}) does not start where the previous one ended"
        if not verify_receipt(r):
            return f"receipt {i} ({r.stage}) has a bad signature"
        h = r.output_sha256
    return None


def sign_capabilities(keypair, **fields) -> StageCapabilities:
    caps = StageCapabilities(hotkey=keypair.ss58_address, **fields)
    return caps.model_copy(update={"signature": _sign(keypair, caps.payload())})


def verify_capabilities(caps: StageCapabilities, expected_hotkey: str | None = None) -> bool:
    if expected_hotkey is not None and caps.hotkey != expected_hotkey:
        return False
    return bool(caps.signature) and _verify(caps.payload(), caps.signature, caps.hotkey)


# ---------------------------------------------------------------- frames
def state_sha256(specs: list[WireTensorSpec], body: bytes) -> str:
    h = hashlib.sha256(json.dumps([s.model_dump() for s in specs], separators=(",", ":")).encode())
    h.update(body)
    return h.hexdigest()


def encode_frame(header: BaseModel, body: bytes = b"") -> bytes:
    # a forward without a rewind leaves the field out, so that stages predating it parse the header
    skip = {"rewind"} if isinstance(header, ForwardHeader) and header.rewind is None else None
    raw = header.model_dump_json(exclude=skip).encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"frame header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    return _PREFIX.pack(FRAME_MAGIC, FRAME_VERSION, len(raw)) + raw + body


def split_frame(frame: bytes, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> tuple[dict, memoryview]:
    """(header dict, body) of a frame; StageWireError (400/413) when it is not a well-formed frame."""
    if len(frame) < _PREFIX.size:
        raise StageWireError(400, "bad_frame", "the body is too short to be a stage frame")
    magic, version, hlen = _PREFIX.unpack_from(frame)
    if magic != FRAME_MAGIC:
        raise StageWireError(400, "bad_frame", "the body is not a stage frame (bad magic)")
    if version != FRAME_VERSION:
        raise StageWireError(400, "unsupported_version", f"frame version {version}; this side speaks {FRAME_VERSION}")
    if hlen > MAX_HEADER_BYTES:
        raise StageWireError(413, "header_too_large", f"frame header of {hlen} bytes exceeds {MAX_HEADER_BYTES}")
    end = _PREFIX.size + hlen
    if end > len(frame):
        raise StageWireError(400, "bad_frame", "the frame ends inside its header")
    if len(frame) - end > max_body_bytes:
        raise StageWireError(413, "body_too_large", f"frame body exceeds {max_body_bytes} bytes")
    try:
        header = json.loads(bytes(frame[_PREFIX.size:end]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StageWireError(400, "bad_header", f"frame header is not JSON: {exc.__class__.__name__}") from None
    if not isinstance(header, dict):
        raise StageWireError(400, "bad_header", "frame header must be a JSON object")
    return header, memoryview(frame)[end:]


def parse_model(model: type[BaseModel], data: Any, what: str) -> Any:
    try:
        if isinstance(data, (bytes, bytearray, memoryview)):
            return model.model_validate_json(bytes(data))
        return model.model_validate(data)
    except ValidationError as exc:
        message, _ = describe_validation_error(exc)
        raise StageWireError(400, "invalid_message", f"{what}: {message}") from None


def decode_forward(frame: bytes, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
                   ) -> tuple[ForwardHeader, list[tuple[WireTensorSpec, memoryview]], memoryview]:
    """Parse and bound-check a forward frame; returns (header, [(spec, bytes)], body)."""
    raw, body = split_frame(frame, max_body_bytes)
    header = parse_model(ForwardHeader, raw, "forward header")
    tensors, offset = [], 0
    for spec in header.tensors:
        if any(s < 0 for s in spec.shape) or spec.shape[0] > MAX_TOKENS or (len(spec.shape) == 2 and spec.shape[1] > MAX_WIDTH):
            raise StageWireError(400, "bad_shape", f"tensor {spec.name} has shape {spec.shape} outside the bounds "
                                                   f"(tokens <= {MAX_TOKENS}, width <= {MAX_WIDTH})")
        n = spec.nbytes
        if offset + n > len(body):
            raise StageWireError(400, "bad_body", f"the body ends inside tensor {spec.name}")
        tensors.append((spec, body[offset:offset + n]))
        offset += n
    if offset != len(body):
        raise StageWireError(400, "bad_body", f"{len(body) - offset} bytes after the last tensor")
    if len({s.name for s, _ in tensors}) != len(tensors):
        raise StageWireError(400, "bad_header", "tensor names repeat")
    for spec, data in tensors:
        if spec.dtype != "int32" and not all_finite(spec.dtype, data):
            raise StageWireError(400, "non_finite", f"tensor {spec.name} holds NaN or infinite values")
    return header, tensors, body


def all_finite(dtype: str, data: memoryview) -> bool:
    if dtype == "float32":
        return bool(np.isfinite(np.frombuffer(data, dtype="<f4")).all())
    if dtype == "bfloat16":  # exponent bits all ones is inf or NaN
        return not bool(((np.frombuffer(data, dtype="<u2") & 0x7F80) == 0x7F80).any())
    return True


# ---------------------------------------------------------------- the chain announcement
class StageAnnouncement(BaseModel):
    """What a stage miner publishes on chain (as its hotkey's commitment, beside its axon endpoint): which model
    and which layer block it serves. One line of text, at most 384 bytes (the Commitments pallet's 3 Raw fields of
    128; about 150 in practice):

        k3-stage/1 config=<config hash> model=<model fingerprint or -> layers=<A>-<B> fp=<stage fingerprint>

    `layers` is inclusive, as `--serve-layers` takes it. The route driver lists the stage miners of a subnet from
    these and then checks each one's signed capabilities against its announcement."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config_hash: str = Field(min_length=1, max_length=128, pattern=_ID)
    model_fingerprint: str = Field("", max_length=64, pattern=r"^[A-Za-z0-9._:\-]*$")
    start: int = Field(ge=0, le=4095)
    stop: int = Field(ge=1, le=4096)  # exclusive
    fingerprint: str = Field(min_length=1, max_length=64, pattern=_ID)

    def text(self) -> str:
        line = (f"{STAGE_PROTOCOL} config={self.config_hash} model={self.model_fingerprint or '-'} "
                f"layers={self.start}-{self.stop - 1} fp={self.fingerprint}")
        if len(line.encode()) > 384:
            raise ValueError(f"stage announcement is {len(line.encode())} bytes; a commitment holds 384")
        return line

    @classmethod
    def parse(cls, text: str) -> Optional["StageAnnouncement"]:
        """The announcement in a commitment, or None when the text is not one (another subnet tool's, garbage)."""
        parts = (text or "").split()
        if len(parts) != 5 or parts[0] != STAGE_PROTOCOL:
            return None
        fields = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        try:
            a, b = fields["layers"].split("-")
            model = fields["model"]
            return cls(config_hash=fields["config"], model_fingerprint="" if model == "-" else model,
                       start=int(a), stop=int(b) + 1, fingerprint=fields["fp"])
        except (KeyError, ValueError, ValidationError):
            return None

    def matches(self, caps: StageCapabilities) -> bool:
        """The capabilities a stage serves are the ones it announced."""
        return (caps.config_hash == self.config_hash and list(caps.layers) == [self.start, self.stop]
                and caps.fingerprint == self.fingerprint)
