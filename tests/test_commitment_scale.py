"""The stage announcement's commitment against the real chain's SCALE, not only this project's fake substrate.

Vectors (tests/subtensor_vectors/commitments.json) are data from bactensor/turbobt (BSD-3-Clause) at the commit the
file names: a real subtensor runtime metadata blob (V15, spec 318; stored gzipped) and the CommitmentOf storage
values (and one storage key) its mocked node answers, with the values they decode to. The SCALE codec is the one
the bittensor SDK itself uses (`bittensor_core.Runtime`, through the SDK's `RuntimeCodec`), loaded with that
metadata. Checked here:

- the runtime's own limits are the ones chain/interface.py assumes (Commitments.MaxFields, MaxSpace's default,
  Data::Raw0..Raw128 at variant indices 1..129 and no larger Raw);
- the real CommitmentOf values decode to the records the vectors give, and their storage key is the vector's;
- the CommitmentInfo our adapter sends (`commitment_info`, the params of the SDK call it composes) encodes, with
  the real metadata, to exactly the bytes the SCALE rules give by hand (pallet and call index, u16 netuid,
  compact field count, one variant byte n + 1 and n bytes per Raw field), at 0, 1, 4, 127, 128, 129 and 384
  bytes, multi-byte UTF-8 across a field edge included; malformed fields are refused by the codec;
- the records the fake substrate stores for the adapter's commitments are the real codec's decoding of those
  bytes (Raw0 decodes to an empty list, not "0x"), and the SDK's reader gives back the text (also for the turbobt
  records, read through the adapter).
"""
from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import struct
from pathlib import Path

import pytest
from bittensor._transport.codec import RuntimeCodec
from fake_substrate import FakeSubstrate

from chain.interface import (COMMITMENT_FIELD_BYTES, COMMITMENT_MAX_FIELDS, COMMITMENT_MAX_SPACE, commitment_data,
                             commitment_fields, commitment_info)
from chain.subtensor import SubtensorChain

VECTORS = json.loads((Path(__file__).parent / "subtensor_vectors" / "commitments.json").read_text())
NETUID = 1


@pytest.fixture(scope="module")
def codec() -> RuntimeCodec:
    meta = VECTORS["metadata"]
    blob = gzip.decompress((Path(__file__).parent / "subtensor_vectors" / meta["file"]).read_bytes())
    assert hashlib.sha256(blob).hexdigest() == meta["sha256"]
    return RuntimeCodec(blob, spec_version=meta["spec_version"], transaction_version=1)


def compact(n: int) -> bytes:
    """SCALE compact integer (the single- and two-byte modes are all a field list needs)."""
    if n < 1 << 6:
        return bytes([n << 2])
    assert n < 1 << 14
    return struct.pack("<H", (n << 2) | 1)


def expected_call(pallet: int, call: int, netuid: int, fields: list[bytes]) -> bytes:
    """set_commitment(netuid: u16, info: CommitmentInfo { fields: BoundedVec<Data> }) by the SCALE rules."""
    out = bytes([pallet, call]) + struct.pack("<H", netuid) + compact(len(fields))
    for raw in fields:
        out += bytes([len(raw) + 1]) + raw  # Data::None is 0, Data::Raw<n> is n + 1
    return out


def expected_record(deposit: int, block: int, fields: list[bytes]) -> bytes:
    """CommitmentOf's Registration { deposit: u64, block: u32, info: CommitmentInfo }."""
    out = struct.pack("<QI", deposit, block) + compact(len(fields))
    for raw in fields:
        out += bytes([len(raw) + 1]) + raw
    return out


def pallet_of(codec: RuntimeCodec, name: str) -> dict:
    return next(p for p in codec._rt.metadata_ir()["pallets"] if p["name"] == name)


def variants(codec: RuntimeCodec, path: list[str]) -> dict[str, int]:
    types = json.loads(codec._rt.registry_json())["types"]
    [entry] = [t for t in types if t["type"].get("path") == path]
    return {v["name"]: v["index"] for v in entry["type"]["def"]["variant"]["variants"]}


def test_the_metadata_is_subtensor_spec_318(codec):
    version = codec._rt.constant("System", "Version")
    assert version["spec_name"] == "node-subtensor" and version["spec_version"] == VECTORS["metadata"]["spec_version"]


def test_the_runtime_limits_are_ours(codec):
    assert codec._rt.constant("Commitments", "MaxFields") == COMMITMENT_MAX_FIELDS
    space = codec._rt.storage_entry("Commitments", "MaxSpace")
    assert codec.decode(space.value_type, bytes(space.default_bytes)) == COMMITMENT_MAX_SPACE
    data = variants(codec, ["pallet_commitments", "types", "Data"])
    assert data["None"] == 0
    assert all(data[f"Raw{n}"] == n + 1 for n in range(COMMITMENT_FIELD_BYTES + 1))
    raws = sorted(int(name[3:]) for name in data if name.startswith("Raw") and name[3:].isdigit())
    assert raws[-1] == COMMITMENT_FIELD_BYTES
    errors = {e["name"] for e in pallet_of(codec, "Commitments")["errors"]}
    assert {"TooManyFieldsInCommitmentInfo", "AccountNotAllowedCommit", "SpaceLimitExceeded"} <= errors


@pytest.mark.parametrize("vector", VECTORS["commitment_of"], ids=lambda v: str(v["decoded"]["block"]))
def test_real_commitment_of_values(codec, vector):
    entry = codec._rt.storage_entry("Commitments", "CommitmentOf")
    value = bytes.fromhex(vector["value"].removeprefix("0x"))
    record = codec.decode(entry.value_type, value)
    assert record == vector["decoded"]
    assert value == expected_record(record["deposit"], record["block"], field_bytes(record))
    assert codec.encode(entry.value_type, record) == value
    if "key" in vector:
        key = codec._rt.storage_key("Commitments", "CommitmentOf", vector["key_params"])
        assert "0x" + bytes(key).hex() == vector["key"]


def test_the_real_set_commitment_params(codec):
    """turbobt's set_commitment params (its field list nested once more) compose to the bytes the rules give."""
    pallet = pallet_of(codec, "Commitments")
    call_index = [c["name"] for c in pallet["calls"]].index("set_commitment")
    for vector in VECTORS["set_commitment"]:
        params = vector["params"]
        got = codec.compose_call("Commitments", "set_commitment", params).data
        assert got == expected_call(pallet["index"], call_index, params["netuid"], [bytes([0, 1, 2, 3])])


TEXTS = ["", "k", "k3-s", "a" * 127, "b" * 128, "c" * 129, "d" * 384,
         "k3-stage/1 " + "é" * 70,  # a two-byte character across the 128-byte field edge
         "k3-stage/1 {\"layers\": [24, 48], \"fingerprint\": \"0123456789abcdef\"}"]


@pytest.mark.parametrize("text", TEXTS, ids=lambda t: f"{len(t.encode())}B")
def test_our_commitment_info_is_real_scale(codec, text):
    pallet = pallet_of(codec, "Commitments")
    call_index = [c["name"] for c in pallet["calls"]].index("set_commitment")
    fields = commitment_fields(text)
    assert b"".join(fields) == text.encode() and len(fields) <= COMMITMENT_MAX_FIELDS
    assert all(len(f) <= COMMITMENT_FIELD_BYTES for f in fields)
    info = commitment_info(text)
    got = codec.compose_call("Commitments", "set_commitment", {"netuid": 300, "info": info}).data
    assert got == expected_call(pallet["index"], call_index, 300, fields)
    # what the chain stores, and what a reader sees of it
    entry = codec._rt.storage_entry("Commitments", "CommitmentOf")
    stored = expected_record(0, 1234, fields)
    record = codec.decode(entry.value_type, stored)
    assert record["deposit"] == 0 and record["block"] == 1234
    assert [next(iter(f)) for f in record["info"]["fields"]] == [next(iter(f)) for f in info["fields"]]
    assert field_bytes(record) == fields
    assert commitment_data(field_bytes(record)) == text
    assert codec.encode(entry.value_type, record) == stored


def field_bytes(record: dict) -> list[bytes]:
    """The Raw fields' bytes of a decoded CommitmentOf record (the codec gives Raw0 as an empty list, the rest as
    0x-hex)."""
    return [bytes(v) if isinstance(v, list) else bytes.fromhex(v.removeprefix("0x"))
            for f in record["info"]["fields"] for v in f.values()]


def test_the_codec_refuses_malformed_fields(codec):
    for info in ({"fields": [{"Raw4": "0x000102"}]}, {"fields": [{"Raw4": "0x0001020304"}]},
                 {"fields": [{"Raw129": "0x" + "00" * 129}]}):
        with pytest.raises(ValueError):
            codec.compose_call("Commitments", "set_commitment", {"netuid": NETUID, "info": info})
    with pytest.raises(ValueError):
        commitment_fields("x" * (COMMITMENT_MAX_FIELDS * COMMITMENT_FIELD_BYTES + 1))


def test_commitment_data_reads_as_the_sdk_does():
    assert commitment_data([b"k3-", b"stage"]) == "k3-stage"
    assert commitment_data([b"\xff\x00"]) == "0xff00"  # not UTF-8: hex, as the SDK's reader gives it


# ------------------------------------------------------------------ through the adapter and the fake substrate
@pytest.fixture(scope="module")
def wallets(tmp_path_factory, make_wallets):
    return make_wallets(tmp_path_factory.mktemp("commitment_scale"), ("owner", "miner"))


@pytest.fixture(autouse=True)
def symbol_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BTCLI_TOKEN_SYMBOLS_CACHE", str(tmp_path / "symbols.json"))  # not under ~/.bittensor


def test_the_adapter_and_the_fake_agree_with_the_real_codec(codec, wallets):
    async def run():
        fake = FakeSubstrate(head=1000, block_time=0.005)
        owner, miner = (wallets[n].hotkey.ss58_address for n in ("owner", "miner"))
        fake.add_subnet(NETUID, owner, wallets["owner"].coldkeypub.ss58_address, tempo=100)
        fake.add_neuron(NETUID, miner, wallets["miner"].coldkeypub.ss58_address)
        chain = SubtensorChain("local", substrate=fake, timeout_s=2.0, write_timeout_s=5.0, retries=1,
                               backoff_s=0.01)
        entry = codec._rt.storage_entry("Commitments", "CommitmentOf")
        pallet = pallet_of(codec, "Commitments")
        call_index = [c["name"] for c in pallet["calls"]].index("set_commitment")
        for text in TEXTS:
            await chain.publish_commitment(wallets["miner"], NETUID, text)
            call = fake.composed_calls("set_commitment")[-1]
            assert call.params == {"netuid": NETUID, "info": commitment_info(text)}
            fields = commitment_fields(text)
            sent = codec.compose_call(call.module, call.function, call.params).data
            assert sent == expected_call(pallet["index"], call_index, NETUID, fields)
            stored = fake.commitments[(NETUID, miner)]
            assert stored == codec.decode(entry.value_type, expected_record(0, stored["block"], fields))
            fake.head += 101  # past the metagraph lag, and into the next epoch (the space quota starts again)
            assert (await chain.commitments(NETUID))[miner].data == text
        # the real chain's records, as the SDK decodes them, read through the adapter
        for vector in VECTORS["commitment_of"]:
            fake.commitments[(NETUID, miner)] = codec.decode(entry.value_type,
                                                             bytes.fromhex(vector["value"].removeprefix("0x")))
            found = (await chain.commitments(NETUID))[miner]
            assert found.block == vector["decoded"]["block"] and found.data == "\x00\x01\x02\x03"
        await chain.close()
    asyncio.run(run())
