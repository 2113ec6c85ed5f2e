"""Where the model computes and in which dtype: `--device cpu|cuda|cuda:N` and `--dtype auto|float32|bfloat16`.

    device = resolve_device("cuda:1")          # torch.device, or DeviceError (one line) when it cannot be used
    dtype = resolve_dtype("auto", device)      # bf16 on a GPU, fp32 on the CPU

Every entry point that builds a model (the miner's engine, the stage miner's block, the validator's reference,
`k3 generate`, the benchmarks) reads its device and dtype through these two, so the spelling, the defaults and the
error a user sees when CUDA is asked for and absent are the same everywhere (docs/engine.md, section GPUs).
"""
from __future__ import annotations

import re

import torch

DEVICE_CHOICES = ("cpu", "cuda", "cuda:N")
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16}
WEIGHT_DTYPES = ("auto", "float32", "bfloat16")  # what a command line offers; "auto": bf16 on a GPU, fp32 on a CPU
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


class DeviceError(ValueError):
    """A device that cannot be used here, with what to do about it (one line)."""


def device_problem(text: str) -> str | None:
    """Why `text` is not a device this machine can compute on, or None."""
    if not isinstance(text, str) or not _DEVICE.fullmatch(text.strip()):
        return f"device {text!r} is not one of cpu, cuda, cuda:N"
    text = text.strip()
    if text == "cpu":
        return None
    if not torch.cuda.is_available():
        return (f"device {text} asked for, but torch.cuda.is_available() is false on this machine (no GPU, no driver, "
                f"or a CPU-only build of PyTorch {torch.__version__}); use --device cpu or install a CUDA build")
    index = int(text.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        return f"device {text} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def resolve_device(text: str | torch.device | None) -> torch.device:
    """`text` ("cpu", "cuda", "cuda:N"; None: the CPU) as a torch.device; DeviceError when it cannot be used."""
    if text is None:
        return torch.device("cpu")
    if isinstance(text, torch.device):
        text = str(text)
    problem = device_problem(text)
    if problem:
        raise DeviceError(problem)
    text = text.strip()
    return torch.device("cuda", torch.cuda.current_device()) if text == "cuda" else torch.device(text)


def resolve_dtype(name: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """The weights dtype: "auto" is bf16 on a GPU (its tensor cores and half the bytes per step) and fp32 on a CPU
    (the reference numerics, and bf16 matmuls are slow on most CPUs); any other name is taken as given."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPE_NAMES:
        raise DeviceError(f"dtype {name!r} is not one of auto, {', '.join(DTYPE_NAMES)}")
    return DTYPE_NAMES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """"float32", "bfloat16", "float16": the names numerics are declared by."""
    return str(dtype).replace("torch.", "")


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a timing must not stop the clock before a GPU has finished)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's materialised tensors (a stage's skeleton keeps the others on meta); a model that
    holds its tensors only while it computes (inference.model.lazy) names its device as `home_device`."""
    home = getattr(model, "home_device", None)
    if home is not None:
        return torch.device(home)
    for t in model.parameters():
        if not t.is_meta:
            return t.device
    for t in model.buffers():
        if not t.is_meta:
            return t.device
    return torch.device("cpu")


__all__ = ["DEVICE_CHOICES", "DTYPE_NAMES", "WEIGHT_DTYPES", "DeviceError", "device_problem", "dtype_name",
           "model_device", "resolve_device", "resolve_dtype", "synchronize"]
