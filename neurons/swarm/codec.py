"""Tensors of the stage wire to and from the model's types: token ids, `ResidualState`, the head's output."""
from __future__ import annotations

import json

import torch

from inference.model.k3 import ResidualState
from inference.swarm.stage import HeadOutput
from protocol.stage import StageWireError, WireTensorSpec

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int32": torch.int32}


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def encode_ids(ids: list[int]) -> tuple[list[WireTensorSpec], bytes]:
    t = torch.tensor(ids, dtype=torch.int32)
    return [WireTensorSpec(name="token_ids", dtype="int32", shape=[len(ids)])], _raw(t)


def encode_state(state: ResidualState, dtype: str = "float32") -> tuple[list[WireTensorSpec], bytes]:
    """Block sums then the partial sum, each [N, D], as `dtype` (float32 or bfloat16)."""
    tensors = [(f"blocks.{i}", b) for i, b in enumerate(state.blocks)] + [("partial", state.partial)]
    specs, parts = [], []
    for name, t in tensors:
        t = t.to(TORCH_DTYPES[dtype])
        specs.append(WireTensorSpec(name=name, dtype=dtype, shape=list(t.shape)))
        parts.append(_raw(t))
    return specs, b"".join(parts)


def _tensor(spec: WireTensorSpec, data: memoryview) -> torch.Tensor:
    if not data:
        return torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.dtype])
    return torch.frombuffer(bytearray(data), dtype=TORCH_DTYPES[spec.dtype]).reshape(spec.shape)


def decode_inputs(tensors: list[tuple[WireTensorSpec, memoryview]], first_stage: bool, hidden_size: int):
    """Token ids [N] (first stage) or a ResidualState (any other); StageWireError 400 on the wrong kind."""
    names = [s.name for s, _ in tensors]
    if first_stage:
        if names != ["token_ids"] or tensors[0][0].dtype != "int32" or len(tensors[0][0].shape) != 1:
            raise StageWireError(400, "bad_input", "the first stage takes one int32 tensor `token_ids` [N]")
        return _tensor(*tensors[0]).to(torch.long)
    if names[-1:] != ["partial"] or names[:-1] != [f"blocks.{i}" for i in range(len(names) - 1)]:
        raise StageWireError(400, "bad_input", "a residual state is blocks.0 .. blocks.k then partial")
    for spec, _ in tensors:
        if spec.dtype == "int32" or len(spec.shape) != 2 or spec.shape[1] != hidden_size:
            raise StageWireError(400, "bad_shape", f"state tensor {spec.name} must be float32/bfloat16 "
                                                   f"[N, {hidden_size}], got {spec.dtype} {spec.shape}")
    values = [_tensor(s, d).float() for s, d in tensors]
    n = values[-1].shape[0]
    if any(v.shape[0] != n for v in values):
        raise StageWireError(400, "bad_shape", "state tensors disagree on the number of tokens")
    return ResidualState((int(n),), values[:-1], values[-1])


def decode_wire(specs, body: bytes, first_stage: bool, hidden_size: int):
    """What a frame's body holds, decoded as its receiver would: token ids (the first stage's input), a
    ResidualState, or (no specs) the head's answer."""
    if not specs:
        return decode_head_output(body)
    view, tensors, offset = memoryview(body), [], 0
    for spec in specs:
        tensors.append((spec, view[offset:offset + spec.nbytes]))
        offset += spec.nbytes
    return decode_inputs(tensors, first_stage, hidden_size)


def encode_head_output(out: HeadOutput) -> bytes:
    return json.dumps({"mode": out.mode, "token_id": out.token_id, "logprob": out.logprob, "top": out.top,
                       "logprobs": out.logprobs, "row_tops": out.row_tops, "verified": out.verified,
                       "accepted": out.accepted}, separators=(",", ":")).encode()


def decode_head_output(body: bytes) -> HeadOutput:
    d = json.loads(bytes(body).decode())
    return HeadOutput(d["mode"], token_id=d["token_id"], logprob=d["logprob"],
                      top=[(int(a), float(b)) for a, b in d["top"]],
                      logprobs=d["logprobs"], row_tops=[[(int(a), float(b)) for a, b in r] for r in d["row_tops"]],
                      verified=[(int(t), float(lp), [(int(a), float(b)) for a, b in top])
                                for t, lp, top in d.get("verified", [])],
                      accepted=int(d.get("accepted", 0)))
