"""Response signatures: a miner's non-repudiable statement of what it answered.

The digest (docs/subnet.md section 2) is 64 bytes:

    sha256(request body bytes, exactly as received) || sha256(token ids)

where the token ids are every generated token in stream order (the
concatenation of all token events' `token_ids`), each encoded as an unsigned
32-bit little-endian integer, concatenated with no length prefix (no tokens:
the sha256 of the empty string).

The hotkey signs, with sr25519, `RESPONSE_SIGNATURE_DOMAIN + digest`, followed,
when the final event reports the seed the sampler ran with, by that seed as an
unsigned 64-bit little-endian integer (8 bytes): the answer is bound to its seed,
so a validator can replay it and the miner cannot disown it. The two forms differ
in length, so neither can pass for the other. The domain prefix keeps a response
signature from ever being valid as any other message the same hotkey signs (a
btauth/1 payload, an extrinsic).

An answer that carries a state commitment (`FinalMessage.state_commitment`)
appends its 32-byte root to the digest (96 bytes, before the seed): the root
cannot be changed or dropped without breaking the signature.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Optional

from bittensor.sp_core import CRYPTO_SR25519, verify as sp_core_verify

from .schemas import ResponseSignature

RESPONSE_SIGNATURE_DOMAIN = b"k3-subnet/response/v1\n"


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Canonical bytes of a token id list: u32 little-endian each."""
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error:
        raise ValueError("token ids must be integers in 0..2**32-1") from None


def response_digest(request_body: bytes, token_ids: Sequence[int], state_root: Optional[str] = None) -> bytes:
    """sha256(request_body) || sha256(encode_token_ids(token_ids)), 64 bytes; || the state commitment's root
    (32 bytes) when the answer carries one."""
    digest = hashlib.sha256(request_body).digest() + hashlib.sha256(encode_token_ids(token_ids)).digest()
    return digest + bytes.fromhex(state_root) if state_root is not None else digest


def signed_message(digest: bytes, seed: int | None) -> bytes:
    """The bytes a response signature signs: the domain, the digest, and the seed when one is reported."""
    if seed is None:
        return RESPONSE_SIGNATURE_DOMAIN + digest
    if not 0 <= seed < 2**64:
        raise ValueError("a seed must be an integer in 0..2**64-1")
    return RESPONSE_SIGNATURE_DOMAIN + digest + struct.pack("<Q", seed)


def sign_response(hotkey_keypair, request_body: bytes, token_ids: Sequence[int],
                  seed: int | None = None, state_root: Optional[str] = None) -> ResponseSignature:
    """Sign a finished generation with the miner's hotkey (an sr25519 Keypair); `seed`: the seed the sampler
    ran with, as the final event reports it; `state_root`: the hex root of its state commitment, when it has one."""
    if getattr(hotkey_keypair, "crypto_type", CRYPTO_SR25519) != CRYPTO_SR25519:
        raise ValueError("response signatures use sr25519; this hotkey has another crypto type")
    digest = response_digest(request_body, token_ids, state_root)
    signature = bytes(hotkey_keypair.sign(signed_message(digest, seed)))
    return ResponseSignature(
        hotkey=hotkey_keypair.ss58_address,
        request_sha256=digest[:32].hex(),
        tokens_sha256=digest[32:64].hex(),
        signature=signature.hex(),
    )


def verify_response(
    signature: ResponseSignature,
    request_body: bytes,
    token_ids: Sequence[int],
    expected_hotkey_ss58: str,
    seed: int | None = None,
    state_root: Optional[str] = None,
) -> bool:
    """True when `signature` is `expected_hotkey_ss58`'s signature over this exact
    request body, these exact token ids, this reported seed (None: none reported)
    and (when given) this state commitment root."""
    if signature.hotkey != expected_hotkey_ss58:
        return False
    try:
        digest = response_digest(request_body, token_ids, state_root)
    except ValueError:
        return False
    if digest[:32].hex() != signature.request_sha256 or digest[32:64].hex() != signature.tokens_sha256:
        return False
    try:
        message = signed_message(digest, seed)
    except ValueError:  # a seed outside u64
        return False
    try:
        return bool(
            sp_core_verify(
                message,
                bytes.fromhex(signature.signature),
                expected_hotkey_ss58,
                CRYPTO_SR25519,
            )
        )
    except ValueError:  # undecodable address or signature bytes
        return False


def verify_final(final, request_body: bytes, token_ids: Sequence[int], expected_hotkey_ss58: str) -> bool:
    """`verify_response` for a final event (schemas.FinalMessage) as it came: its signature over this request and
    these tokens with the seed and the state commitment root it reports."""
    committed = final.state_commitment
    return final.signature is not None and verify_response(
        final.signature, request_body, token_ids, expected_hotkey_ss58, final.seed,
        state_root=committed.root if committed is not None else None)
