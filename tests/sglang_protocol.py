"""SGLang's own schema of its native HTTP API, imported from the `sglang` package on PyPI.

`sglang.api.v1.api_types` (generated from SGLang's `proto/sglang/api/v1`, the contract both its
Python and Rust servers check `/generate` bodies against) needs only msgspec, but importing it
through the package would run `sglang/__init__`, which pulls CUDA-only dependencies. So the wheel
is installed without dependencies into `.sglang-protocol/` (once, cached) and the module file is
loaded by path. Nothing in it is retyped here.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = Path(os.environ.get("K3_SGLANG_PROTOCOL_DIR", REPO / ".sglang-protocol"))
SGLANG_VERSION = "0.5.23"
MODULE_FILE = TARGET / "sglang" / "api" / "v1" / "api_types.py"


def load_api_types():
    if not MODULE_FILE.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(TARGET),
                        f"sglang=={SGLANG_VERSION}"], check=True, timeout=1800)
    name = "sglang_api_v1_types"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, MODULE_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
