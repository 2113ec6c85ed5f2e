"""The standardized, reproducible benchmark of one endpoint serving Kimi K3.

Public claims such as "20 tokens/s on 80 GPUs" come without the prompt sizes, the concurrency,
the sampling settings or any check that the output came from the model. This script runs the
validator's kind of traffic once against one endpoint and writes all of that down:

- every combination of --prompt-lengths x --output-lengths x --concurrency, each `--repeats`
  waves of N simultaneous streams, with seeded prompts (the same seed and tokenizer give the
  same requests, byte for byte: `request_set_sha256` in the report says so);
- per workload: prefill speed (prompt tokens / TTFT), TTFT, decode tokens/s per stream (TTFT
  excluded), aggregate tokens/s of the waves, latency percentiles, errors by kind (a 429 beyond
  the endpoint's capacity is counted as such, not a crash);
- the quality checks that can run there: tier 0 on every response (usage, finish reason,
  logprobs, greedy top-1, stream buffering, and for miners the response signature); with
  --reference-checkpoint, teacher-forced tier-1 audits of sampled responses and tier-2 canaries
  against a local reference engine (meaningful when the endpoint serves that model); answer
  probes (exact copy, planted fact);
- the endpoint's declared capabilities, model fingerprint and precision.

As a serving benchmark (the terms and definitions of `vllm bench serve`):

- traffic: closed waves (--concurrency, --repeats), or open loop with --request-rate R (requests/s,
  inf = all at once; gaps gamma-distributed with shape --burstiness, 1 = Poisson) and
  --max-concurrency (in flight at most) over --num-prompts requests per workload;
- datasets (--dataset-name): random (seeded text of exactly --prompt-lengths tokens, or lengths
  drawn within --random-range-ratio), sharegpt (the first human turn and the reply's length of each
  conversation in --dataset-path), shared-prefix (prompts whose first --shared-prefix-tokens tokens
  are shared among --shared-prefix-groups groups, for prefix caches);
- metrics: TTFT, TPOT (end - first token) / (tokens - 1), ITL (every gap between tokens), E2EL, as
  mean, std and --metric-percentiles; request, output-token and total-token throughput; goodput
  (--goodput ttft:MS tpot:MS e2el:MS: requests/s meeting every SLO);
- --endpoint-type chat sends /v1/chat/completions (messages; token ids from the logprobs with
  `return_tokens_as_token_ids`), completions (the default) token ids to /v1/completions;
- --save-result writes requests.jsonl, one line per request, next to the report.

    # open loop at 4 requests/s, at most 16 in flight, over a ShareGPT file, with SLOs
    python -m benchmarks.endpoint --openai http://127.0.0.1:8000 --model moonshotai/Kimi-K3 \\
        --tokenizer-checkpoint ckpt/k3 --dataset-name sharegpt --dataset-path sharegpt.json --num-prompts 200 \\
        --request-rate 4 --max-concurrency 16 --goodput ttft:2000 tpot:100 --save-result --out-dir bench/sharegpt

    # a miner, through the signed protocol (the wallet's hotkey needs a validator permit and stake)
    python -m benchmarks.endpoint --miner http://203.0.113.7:8091 --miner-hotkey 5F... \\
        --wallet-name validator --wallet-hotkey default --tokenizer-checkpoint ckpt/k3 \\
        --prompt-lengths 128,1024,8192 --output-lengths 64,256 --concurrency 1,8,64 --out-dir bench/miner

    # any OpenAI-compatible server (vLLM, SGLang): completions with token ids and logprobs
    python -m benchmarks.endpoint --openai http://127.0.0.1:8000 --model moonshotai/Kimi-K3 \\
        --tokenizer-checkpoint ckpt/k3 --out-dir bench/vllm

The report is report.json and report.md in --out-dir; the Markdown table is printed at the end.
"""
from __future__ import annotations

import asyncio
import codecs
import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import aiohttp
import httpx
from httpx_sse import EventSource, SSEError
from httpx_sse._decoders import SSEDecoder, SSELineDecoder

from benchmarks.other_tokenizer import OtherModelTokenizer, OtherModelTokenizerError
from inference.model import read_config
from inference.model.checkpoint import CheckpointError
from inference.model.tokenizer import IM_END, load_tokenizer
from inference.serving import (EngineError, EngineSettings, FinalEvent as EngineFinal, GenerationRequest, LocalEngine,
                               RemoteEngine, RemoteSettings, TokenEvent as EngineToken)
from inference.serving.remote import (DRAIN_S, _drain, _error_from_status, _stream_error, _VLLMStream, event_chunk,
                                      openai_sampling_extras, parse_token_key)
from neurons.base.engine_wire import sampling_params, token_message, unsigned_final_message, wire_logprob
from neurons.base.observability import setup_logging
from neurons.base.settings import (LOG_FORMAT, LOG_LEVEL, WALLET, Option, Section, Setting, WalletNotFound,
                                   WalletSettings, build_parser, build_settings, non_negative_float, non_negative_int,
                                   open_wallet, positive_float, positive_rate, program_name, read_options, setting,
                                   settings_options)
from protocol.client import (ClientTimeouts, GenerateResult, MinerClient, MinerError, MinerHTTPError,
                             MinerProtocolError, MinerStreamError, MinerTimeout, MinerUnreachable, TimedEvent)
from protocol.errors import ErrorCode
from protocol.schemas import (LOGPROB_FLOOR, MAX_TOKEN_TEXT, Capabilities, FinalMessage, GenerateRequest, Timings,
                              TokenMessage, TopLogprob, encode_model)
from scoring import corpus
from scoring.audit_sequence import check_answer
from scoring.canaries import CanaryPool, check_tier2
from scoring.config import ScoringConfig
from scoring.metrics import decode_tokens_per_s
from scoring.tier0 import check_tier0
from scoring.tier1 import audit_tier1
from scoring.workloads import WorkloadError, plan_round

log = logging.getLogger("k3.benchmark")

REPORT_FORMAT = "k3-endpoint-benchmark"
REPORT_VERSION = 1
# What tier 0 cannot check on a plain OpenAI-compatible server: it signs nothing and declares no fingerprint.
NOT_APPLICABLE_ON_OPENAI = ("signature", "fingerprint")
NOT_APPLICABLE_IN_CHAT = ("usage_prompt",)
UNDECLARED = "undeclared"
MAX_CANARY_TOKENS = 64
# The warm-up opens a connection per stream of the widest workload, up to this many (beyond it, an
# unbounded open-loop burst, the first requests' connects are part of what is measured).
MAX_WARM_CONNECTIONS = 64
# The adapter's health polls (GET /v1/models) are the miner's; the benchmark reads /v1/models once and
# sends nothing else while it measures (a poll would take a pooled connection from a measured stream).
NO_HEALTH_POLLS_S = 86_400.0


class BenchmarkSetupError(RuntimeError):
    """The benchmark cannot run as asked; the message says what to change."""


# ---------------------------------------------------------------- settings
def _numbers(text: str, parse, what: str) -> tuple:
    """Comma-separated values read by `parse`; `what` names them in the error."""
    try:
        values = tuple(parse(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of {what}") from None
    if not values:
        raise ValueError(f"{text!r} lists no {what}")
    return values


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated positive integers: "128,1024,8192"."""
    values = _numbers(text, int, "integers")
    if min(values) < 1:
        raise ValueError(f"{text!r} must list positive integers")
    return values


int_list.__name__ = "list of integers"


def rate_list(text: str) -> tuple[float, ...]:
    """Request rates in requests/s, comma-separated; "inf" sends every request at once: "1,4,inf"."""
    values = _numbers(text, float, "rates (numbers or inf)")
    if any(math.isnan(v) or v <= 0 for v in values):
        raise ValueError(f"{text!r} must list positive rates (or inf)")
    return values


rate_list.__name__ = "list of rates"


def percentile_list(text: str) -> tuple[float, ...]:
    """Percentiles in (0, 100), comma-separated: "50,90,99,99.9"."""
    values = _numbers(text, float, "percentiles")
    if any(not 0 < v < 100 for v in values):
        raise ValueError(f"{text!r} must list percentiles strictly between 0 and 100")
    return tuple(sorted(set(values)))


percentile_list.__name__ = "list of percentiles"

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")  # as `vllm bench serve` names them
SLO_METRICS = ("ttft", "tpot", "e2el")


def metric_list(text: str) -> tuple[str, ...]:
    """Latency metrics, comma-separated, from ttft, tpot, itl, e2el."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in LATENCY_METRICS]
    if not names or unknown:
        raise ValueError(f"{text!r}: choose from {', '.join(LATENCY_METRICS)}")
    return names


metric_list.__name__ = "list of metrics"


def slo_list(text: str) -> tuple[tuple[str, float], ...]:
    """Service-level objectives in milliseconds: "ttft:500,tpot:50" (or space-separated)."""
    out = {}
    for part in text.replace(",", " ").split():
        name, sep, value = part.partition(":")
        try:
            limit = float(value)
        except ValueError:
            limit = float("nan")
        if not sep or name not in SLO_METRICS or not limit > 0 or math.isinf(limit):
            raise ValueError(f"{part!r} is not NAME:MILLISECONDS with NAME one of {', '.join(SLO_METRICS)}")
        out[name] = limit
    if not out:
        raise ValueError("give at least one NAME:MILLISECONDS")
    return tuple(sorted(out.items()))


slo_list.__name__ = "SLO list"


def percentile_key(q: float) -> str:
    return f"p{q:g}"


DATASETS = ("random", "sharegpt", "shared-prefix")
ENDPOINT_TYPES = ("completions", "chat")


@dataclass(frozen=True)
class TargetSettings:
    miner_url: Optional[str] = setting(None, "a miner's base URL (signed subnet protocol)", flag="--miner",
                                       metavar="URL")
    miner_hotkey: Optional[str] = setting(None, "the miner's SS58 hotkey", metavar="SS58")
    openai_url: Optional[str] = setting(None, "an OpenAI-compatible server's base URL (vLLM, SGLang; /v1 is added)",
                                        flag="--openai", metavar="URL")
    model: Optional[str] = setting(None, "with --openai: the model name the server serves", metavar="NAME")
    api_key: Optional[str] = setting(None, "with --openai: bearer token (prefer the environment variable)",
                                     secret=True, metavar="KEY")
    max_context: Optional[int] = setting(None, "with --openai: the server's context when /v1/models does not say "
                                         "(max_model_len)")


@dataclass(frozen=True)
class WorkloadSettings:
    prompt_lengths: tuple[int, ...] = setting((128, 1024, 8192), "prompt sizes in tokens, chat template included",
                                              read=int_list, metavar="N,N,...")
    output_lengths: tuple[int, ...] = setting((64, 256), "max_tokens of the requests", read=int_list,
                                              metavar="N,N,...")
    concurrency: tuple[int, ...] = setting((1, 8, 64), "simultaneous streams per wave", read=int_list,
                                           metavar="N,N,...")
    repeats: int = setting(3, "waves per workload")
    warmup: int = setting(1, "requests sent first and not counted (at most the concurrency at once, then a "
                          "one-token request per stream, so that each stream has its connection open)",
                          read=non_negative_int)
    seed: int = setting(0, "seed of the request set")
    temperature: float = setting(0.0, "sampling temperature of the workload requests", read=non_negative_float,
                                 metavar="X")
    top_p: float = setting(1.0, "nucleus sampling", read=positive_float, metavar="X")
    logprobs: int = setting(5, "top-k alternatives asked per token (tier 0 checks greedy tokens against them)",
                            read=non_negative_int)
    ignore_eos: bool = setting(False, "with --openai: generate max_tokens whatever the model says (vLLM's ignore_eos)")
    # the traffic: closed waves of --concurrency streams, or open-loop arrivals at these rates
    request_rates: Optional[tuple[float, ...]] = setting(
        None, "open-loop traffic: requests/s (inf: all at once), arrivals Poisson (see --burstiness); "
        "a list runs each; unset: closed waves of --concurrency", flag="--request-rate", read=rate_list,
        group="traffic", metavar="R,R,...")
    burstiness: float = setting(1.0, "with --request-rate: gamma-distributed gaps of this shape (1: Poisson, "
                                "<1 burstier, inf: even)", read=positive_float, group="traffic", metavar="X")
    max_concurrency: Optional[int] = setting(None, "with --request-rate: at most this many requests in flight "
                                             "(the rest wait here)", group="traffic")
    num_prompts: int = setting(100, "with --request-rate: requests per workload", group="traffic")
    endpoint_type: str = setting("completions", "with --openai: /v1/completions (token ids) or /v1/chat/completions "
                                 "(messages)", group="traffic", choices=ENDPOINT_TYPES)


@dataclass(frozen=True)
class DatasetSettings:
    name: str = setting("random", "random: seeded prompts of --prompt-lengths; sharegpt: first turns of "
                        "--dataset-path; shared-prefix: prompts of --prompt-lengths whose first "
                        "--shared-prefix-tokens are shared", flag="--dataset-name", choices=DATASETS)
    path: Optional[str] = setting(None, "sharegpt: a JSON list of {\"conversations\": [{\"from\": \"human\", "
                                  "\"value\": ...}, {\"from\": \"gpt\", ...}]}", flag="--dataset-path",
                                  metavar="FILE")
    random_range_ratio: float = setting(0.0, "random: prompt and output lengths drawn uniformly from "
                                        "[L(1-r), L(1+r)]", read=non_negative_float, metavar="R")
    sharegpt_output_len: Optional[int] = setting(None, "sharegpt: max_tokens of every request (default: the length "
                                                 "of the conversation's reply)")
    prefix_tokens: int = setting(64, "shared-prefix: tokens of the shared prefix (inside the prompt length)",
                                 flag="--shared-prefix-tokens")
    prefix_groups: int = setting(1, "shared-prefix: distinct prefixes, the prompts taking them in turn",
                                 flag="--shared-prefix-groups")


@dataclass(frozen=True)
class ResultSettings:
    percentiles: tuple[float, ...] = setting((50.0, 90.0, 99.0), "percentiles reported for every distribution",
                                             flag="--metric-percentiles", read=percentile_list, metavar="Q,Q,...")
    percentile_metrics: tuple[str, ...] = setting(LATENCY_METRICS, "latency metrics of the printed latency table "
                                                  "(ttft, tpot, itl, e2el)", read=metric_list, metavar="M,M,...")
    # SLOs in ms; a request meeting all of them is "good"
    goodput: tuple[tuple[str, float], ...] = setting((), "SLOs in ms, e.g. --goodput ttft:500 tpot:50 e2el:5000: "
                                                     "goodput counts the requests meeting all", read=slo_list,
                                                     metavar="NAME:MS")
    save_result: bool = setting(False, "also write requests.jsonl, one line per request (timings, tokens, errors), "
                                "to --out-dir (default: the current directory)")


@dataclass(frozen=True)
class QualitySettings:
    reference_checkpoint: Optional[str] = setting(None, "a local checkpoint of the served model: enables tier-1 "
                                                  "audits and tier-2 canaries", metavar="DIR")
    audits: int = setting(8, "workload responses given a teacher-forced audit (needs --reference-checkpoint)",
                          read=non_negative_int)
    canaries: int = setting(4, "greedy canaries checked against the reference (needs --reference-checkpoint)",
                            read=non_negative_int)
    probes: int = setting(4, "answer probes (exact copy, planted fact), greedy", read=non_negative_int)


# protocol.client.ClientTimeouts knows nothing of command lines: its flags are here.
BENCH_TIMEOUTS = Section(group="timeouts", fields=dict(
    connect=Setting("deadline to connect", flag="--connect-timeout-s", read=positive_float),
    first_byte=Setting("deadline for the first token (queueing and prefill): this floor plus prompt tokens / "
                       "--prefill-tokens-per-s", flag="--first-token-timeout-s", read=positive_float),
    between_events=Setting("deadline between two tokens", flag="--between-tokens-timeout-s", read=positive_float),
    total=Setting("deadline of one request", flag="--request-timeout-s", read=positive_float),
    prefill_tokens_per_s=Setting("the first token's deadline grows by prompt tokens / this rate (inf: a flat "
                                 "deadline)", read=positive_rate, metavar="RATE"),
))


@dataclass(frozen=True)
class BenchmarkSettings:
    target: TargetSettings = Section(group="target").field(TargetSettings)
    wallet: WalletSettings = WALLET.field(WalletSettings)
    workload: WorkloadSettings = Section(group="workload").field(WorkloadSettings)
    dataset: DatasetSettings = Section(group="dataset").field(DatasetSettings)
    result: ResultSettings = Section(group="result").field(ResultSettings)
    quality: QualitySettings = Section(group="quality").field(QualitySettings)
    # the validators' deadlines (protocol.client.ClientTimeouts), so the benchmark times out where they would
    timeouts: ClientTimeouts = BENCH_TIMEOUTS.field(ClientTimeouts)
    tokenizer_checkpoint: Optional[str] = setting(None, "checkpoint directory with the served model's config.json and "
                                                  "tokenizer (default: the reference)", metavar="DIR")
    out_dir: Optional[str] = setting(None, "where report.json and report.md go", metavar="DIR")
    log_level: str = LOG_LEVEL.field("WARNING")
    log_format: str = LOG_FORMAT.field("text")

    def problems(self) -> list[str]:
        t, w = self.target, self.workload
        out = []
        if bool(t.miner_url) == bool(t.openai_url):
            out.append("give exactly one target: --miner URL (with --miner-hotkey) or --openai URL (with --model)")
        if t.miner_url and not t.miner_hotkey:
            out.append("--miner needs --miner-hotkey: the miner's SS58 hotkey, which requests are signed for")
        if t.openai_url and not t.model:
            out.append("--openai needs --model: the model name the server serves")
        for url in (t.miner_url, t.openai_url):
            if url and not url.startswith(("http://", "https://")):
                out.append(f"{url!r} is not an http:// or https:// URL")
        if not (self.tokenizer_checkpoint or self.quality.reference_checkpoint):
            out.append("give --tokenizer-checkpoint DIR (config.json and tokenizer files of the served model) "
                       "or --reference-checkpoint DIR, to build the prompts and count tokens")
        if w.repeats < 1:
            out.append("--repeats must be at least 1")
        if not 0.0 <= w.temperature <= 2.0:
            out.append("--temperature must lie in [0, 2]")
        if not 0.0 < w.top_p <= 1.0:
            out.append("--top-p must lie in (0, 1]")
        if not 0 <= w.logprobs <= 20:
            out.append("--logprobs must lie in 0..20")
        d = self.dataset
        if d.name not in DATASETS:
            out.append(f"--dataset-name must be one of {', '.join(DATASETS)}")
        if d.name == "sharegpt" and not d.path:
            out.append("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT-format JSON list)")
        if d.path and d.name != "sharegpt":
            out.append("--dataset-path is read only with --dataset-name sharegpt")
        if not 0.0 <= d.random_range_ratio < 1.0:
            out.append("--random-range-ratio must lie in [0, 1)")
        if d.name == "shared-prefix" and (d.prefix_tokens < 1 or d.prefix_groups < 1):
            out.append("--shared-prefix-tokens and --shared-prefix-groups must be at least 1")
        if d.sharegpt_output_len is not None and d.sharegpt_output_len < 1:
            out.append("--sharegpt-output-len must be at least 1")
        if not w.burstiness > 0:
            out.append("--burstiness must be positive (1: Poisson arrivals; lower: burstier; inf: evenly spaced)")
        if w.max_concurrency is not None and w.max_concurrency < 1:
            out.append("--max-concurrency must be at least 1")
        if w.num_prompts < 1:
            out.append("--num-prompts must be at least 1")
        if w.endpoint_type not in ENDPOINT_TYPES:
            out.append(f"--endpoint-type must be one of {', '.join(ENDPOINT_TYPES)}")
        if t.miner_url and w.endpoint_type == "chat":
            out.append("--endpoint-type chat needs an --openai target (a miner takes token ids)")
        if t.miner_url and w.ignore_eos:
            out.append("--ignore-eos needs an --openai target (the subnet protocol always stops at the end of sequence)")
        return out


def benchmark_options() -> tuple[Option, ...]:
    """Every flag of the benchmark, derived from BenchmarkSettings' fields; the wallet's flags also read
    the benchmark's old K3_BENCH_WALLET_* variables."""
    return tuple(_with_old_bench_env(o) for o in settings_options(BenchmarkSettings, "K3_BENCH_"))


def _with_old_bench_env(option: Option) -> Option:
    if not option.dest.startswith("wallet."):
        return option
    old = option.deprecated_env[0].replace("K3_", "K3_BENCH_", 1)  # K3_WALLET_NAME -> K3_BENCH_WALLET_NAME
    return dataclasses.replace(option, deprecated_env=option.deprecated_env + (old,))


def joined_goodput(argv: Sequence[str]) -> list[str]:
    """`--goodput ttft:500 tpot:50` (vLLM's spelling, one word per SLO) as one value for the parser."""
    out: list[str] = []
    in_goodput = False
    for word in argv:
        if in_goodput and ":" in word and not word.startswith("-"):
            if out[-1] == "--goodput":
                out.append(word)
            else:
                out[-1] += "," + word
            continue
        in_goodput = word == "--goodput"
        out.append(word)
    return out


def read_benchmark_settings(argv: Optional[Sequence[str]] = None,
                            environ: Optional[dict] = None) -> BenchmarkSettings:
    options = benchmark_options()
    argv = joined_goodput(list(sys.argv[1:] if argv is None else argv))
    prog = program_name("k3-bench", "benchmarks.endpoint")
    values = read_options(options, argv, environ, prog=prog, description=__doc__)
    settings = build_settings(BenchmarkSettings, values)
    problems = settings.problems()
    if problems:
        build_parser(options, prog=prog).error("; ".join(problems))
    return settings


# ---------------------------------------------------------------- endpoints
class MinerEndpoint:
    """A miner through the signed protocol."""

    kind = "miner"

    def __init__(self, url: str, hotkey: str, wallet, timeouts: ClientTimeouts):
        self.url, self.hotkey = url, hotkey
        self.timeouts = timeouts
        self.client = MinerClient(wallet, timeouts)

    async def capabilities(self, tokenizer) -> tuple[Capabilities, dict]:
        caps = await self.client.capabilities(self.url, self.hotkey)
        health = await self.client.health(self.url)
        return caps, {"capabilities": caps.model_dump(mode="json"), "health": health.model_dump(mode="json")}

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await self.client.generate(self.url, self.hotkey, request)

    async def close(self) -> None:
        await self.client.close()


class OpenAIEndpoint:
    """An OpenAI-compatible server, through the remote engine adapter (token ids, logprobs, SSE);
    its events are put on the client's clock and into the protocol's shape, so that the same
    measurements and tier-0 checks apply (less what only a signing miner can give)."""

    kind = "openai"

    def __init__(self, settings: TargetSettings, timeouts: ClientTimeouts, concurrency: int, ignore_eos: bool = False):
        self.settings = settings
        self.timeouts = timeouts
        self.concurrency = concurrency
        self.ignore_eos = ignore_eos
        self.engine: Optional[RemoteEngine] = None
        self.session: Optional[aiohttp.ClientSession] = None
        self.stop_ids: frozenset[int] = frozenset()
        self.tokenizer = None

    async def _model_entry(self) -> dict:
        headers = {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}
        timeout = aiohttp.ClientTimeout(total=self.timeouts.connect + 10.0)
        url = self.settings.openai_url.rstrip("/") + "/v1/models"
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.get(url, headers=headers) as response:
                    if response.status != 200:
                        raise BenchmarkSetupError(f"{url} answered HTTP {response.status}")
                    listing = await response.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            raise BenchmarkSetupError(f"cannot read {url}: {error!r}") from None
        for entry in listing.get("data") or []:
            if entry.get("id") == self.settings.model:
                return entry
        names = [entry.get("id") for entry in listing.get("data") or []]
        raise BenchmarkSetupError(f"the server does not serve {self.settings.model!r} (it serves {names})")

    async def capabilities(self, tokenizer) -> tuple[Capabilities, dict]:
        entry = await self._model_entry()
        max_context = entry.get("max_model_len") or self.settings.max_context
        if not isinstance(max_context, int) or max_context < 2:
            raise BenchmarkSetupError("the server's /v1/models gives no max_model_len: pass --max-context")
        self.stop_ids = frozenset(tokenizer.stop_ids)
        self.tokenizer = tokenizer
        self.engine = RemoteEngine(
            RemoteSettings(base_url=self.settings.openai_url, model_name=self.settings.model,
                           api_key=self.settings.api_key, max_context=max_context,
                           max_concurrent_sequences=self.concurrency, connect_timeout_s=self.timeouts.connect,
                           first_token_floor_s=self.timeouts.first_byte,
                           prefill_tokens_per_s=self.timeouts.prefill_tokens_per_s,
                           stall_timeout_s=self.timeouts.between_events,
                           total_timeout_s=self.timeouts.total, health_interval_s=NO_HEALTH_POLLS_S),
            vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id)
        await self.engine.start()
        self._completions_url = self.settings.openai_url.rstrip("/") + "/v1/completions"
        self._headers = {"Content-Type": "application/json"} | (
            {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {})
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max(100, self.concurrency + 8)),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeouts.connect))
        caps = Capabilities(model_id=self.settings.model[:128], model_fingerprint=UNDECLARED,
                            vocab_size=tokenizer.vocab_size, max_context=max_context,
                            max_concurrent_streams=max(1, self.concurrency), engine="remote", precision="unknown",
                            software_version="unknown")
        return caps, {"model": entry}

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """One completions stream, read leanly: the remote adapter's request body and chunk reader, over
        aiohttp (C HTTP parser) with httpx-sse's decoders fed the body's text; the client's CPU per
        chunk competes with the server's on a small machine, so it is kept low. The adapter's deadlines:
        the first token within its prefill budget from the request's start, then the stall timer."""
        result = GenerateResult(request=request, body=encode_model(request), started_at=time.time())
        sampling = sampling_params(request, ignore_eos=self.ignore_eos)
        wanted = GenerationRequest(list(request.prompt_token_ids), sampling, request.request_id)
        engine = self.engine
        loop = asyncio.get_running_loop()
        start = loop.time()
        t = self.timeouts
        total_at = start + t.total
        first_at = min(start + engine.first_token_deadline_s(len(wanted.prompt_token_ids)), total_at)
        n_prompt, index, first_token = len(wanted.prompt_token_ids), 0, None
        try:
            problems = sampling.problems()
            if problems:
                raise EngineError("invalid_request", "; ".join(problems))
            if n_prompt + sampling.max_tokens > engine.settings.max_context:
                raise EngineError("context_too_long", f"prompt plus max_tokens exceeds {engine.settings.max_context}")
            reader = _VLLMStream(engine, wanted)
            body = json.dumps(engine._vllm_generate_body(wanted))
            try:
                async with asyncio.timeout_at(first_at):
                    response = await self.session.post(self._completions_url, data=body, headers=self._headers)
            except TimeoutError:
                raise EngineError("engine_stalled", "no answer in time", timeout="first_byte") from None
            except aiohttp.ClientError as error:
                raise EngineError("engine_unavailable", f"cannot reach the server: {error!r}",
                                  unreachable=True) from None
            events = sse_data(response)
            try:
                if response.status != 200:
                    text = (await response.read())[:4096].decode(errors="replace")
                    raise _error_from_status(response.status, text)
                while True:
                    due = first_at if first_token is None else min(loop.time() + t.between_events, total_at)
                    try:
                        data = await _next_event(events, due, first_token is None, due >= total_at,
                                                aiohttp.ClientError)
                    except StopAsyncIteration:
                        break
                    if data == "[DONE]":  # read on to the body's end, so that the connection is kept
                        with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                            async with asyncio.timeout_at(min(due, loop.time() + DRAIN_S)):
                                async for _ in events:
                                    pass
                        break
                    if not data:
                        continue
                    tokens = reader.tokens(event_chunk(data))
                    if tokens:
                        arrived = loop.time() - start
                        first_token = arrived if first_token is None else first_token
                        for token_id, text, logprob, top in tokens:
                            result.events.append(TimedEvent(token_message(
                                EngineToken(index, token_id, text, logprob, top)), arrived))
                            index += 1
            finally:
                await events.aclose()
                _leave(response)
            reason = reader.finish_reason(index)
        except EngineError as error:
            failure = _miner_error(error, self.timeouts)
            failure.partial = result
            raise failure from None
        end = loop.time() - start
        engine_final = EngineFinal(finish_reason=reason, prompt_tokens=n_prompt, completion_tokens=index,
                                   queue_ms=0.0, ttft_ms=None if first_token is None else first_token * 1000,
                                   total_ms=end * 1000)
        result.final = self._final(engine_final, result)
        result.events.append(TimedEvent(result.final, end))
        return result

    def _final(self, event: EngineFinal, result: GenerateResult) -> FinalMessage:
        reason = event.finish_reason
        tokens = result.token_ids
        if reason == "stop" and tokens and tokens[-1] in self.stop_ids and not any(
                s in result.text for s in result.request.stop):
            reason = "eos"  # the adapter says "stop" for both; tier 0 tells them apart
        # No signature and no declared fingerprint: tier 0's signature and fingerprint checks are reported as
        # not applicable.
        return unsigned_final_message(
            event, finish_reason=reason, model_fingerprint=UNDECLARED,
            timings=Timings(queue_ms=0.0, ttft_ms=event.ttft_ms or 0.0, total_ms=event.total_ms))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        if self.engine is not None:
            await self.engine.stop()


class ChatEndpoint(OpenAIEndpoint):
    """An OpenAI-compatible server's /v1/chat/completions: the request's text as one user message,
    the server's own chat template. Token ids come from the streamed logprobs, asked with vLLM's
    `return_tokens_as_token_ids` (never parsed from token text); deadlines as the remote adapter's:
    the first token within first_byte + prompt / prefill rate, then between_events per chunk."""

    path = "/v1/chat/completions"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.http: Optional[httpx.AsyncClient] = None

    async def capabilities(self, tokenizer) -> tuple[Capabilities, dict]:
        caps, described = await super().capabilities(tokenizer)
        t = self.timeouts
        self.http = httpx.AsyncClient(limits=httpx.Limits(max_connections=max(100, self.concurrency + 8)),
                                      timeout=httpx.Timeout(connect=t.connect, read=None, write=t.connect,
                                                            pool=t.total))
        return caps, described

    def _body(self, request: GenerateRequest) -> dict:
        body = {"model": self.settings.model, "messages": [{"role": "user", "content": request.prompt}],
                "max_completion_tokens": request.max_tokens, "temperature": request.temperature,
                "top_p": request.top_p, "stream": True, "stream_options": {"include_usage": True},
                "logprobs": True, "top_logprobs": request.logprobs, "return_tokens_as_token_ids": True}
        return body | openai_sampling_extras(request.top_k, request.seed, request.stop, self.ignore_eos)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        result = GenerateResult(request=request, body=encode_model(request), started_at=time.time())
        loop = asyncio.get_running_loop()
        start = loop.time()
        t = self.timeouts
        total_at = start + t.total
        prompt_guess = len(self.tokenizer.encode(request.prompt)) if self.tokenizer is not None else 0
        first_at = min(start + t.first_event_s(prompt_guess), total_at)
        headers = {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}
        http = self.http.build_request("POST", self.settings.openai_url.rstrip("/") + self.path,
                                       json=self._body(request), headers=headers)
        index, usage, finish, first_token = 0, {}, None, None
        try:
            try:
                async with asyncio.timeout_at(first_at):
                    response = await self.http.send(http, stream=True)
            except TimeoutError:
                raise EngineError("engine_stalled", "no answer in time", timeout="first_byte") from None
            except httpx.HTTPError as error:
                raise EngineError("engine_unavailable", f"cannot reach the server: {error!r}",
                                  unreachable=True) from None
            try:
                if response.status_code != 200:
                    text = (await response.aread())[:4096].decode(errors="replace")
                    raise _error_from_status(response.status_code, text)
                events = EventSource(response).aiter_sse()
                while True:
                    due = first_at if first_token is None else min(loop.time() + t.between_events, total_at)
                    try:
                        sse = await _next_event(events, due, first_token is None, due >= total_at,
                                               (SSEError, httpx.HTTPError))
                    except StopAsyncIteration:
                        break
                    if sse.data == "[DONE]":  # the body's end too, so that the connection is kept
                        await _drain(events, min(due, loop.time() + DRAIN_S))
                        break
                    try:
                        data = json.loads(sse.data)
                    except ValueError:
                        raise EngineError("engine_failure", f"malformed event: {sse.data[:200]!r}") from None
                    if data.get("error") and not data.get("choices"):
                        raise _stream_error(data["error"])
                    usage = data.get("usage") or usage
                    for choice in data.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content") or ""
                        entries = (choice.get("logprobs") or {}).get("content") or []
                        if content and not entries and not choice.get("finish_reason"):
                            raise EngineError("engine_failure", "the server streamed text without logprobs")
                        if entries:
                            ids = [parse_token_key(e.get("token")) for e in entries]
                            event = TokenMessage(
                                index=index, token_ids=ids, text=content[:MAX_TOKEN_TEXT],
                                logprobs=[wire_logprob(e.get("logprob", LOGPROB_FLOOR)) for e in entries],
                                top_logprobs=[[TopLogprob(token_id=parse_token_key(top.get("token")),
                                                          logprob=wire_logprob(top.get("logprob", LOGPROB_FLOOR)))
                                               for top in (e.get("top_logprobs") or [])[:request.logprobs]]
                                              for e in entries])
                            arrived = loop.time() - start
                            first_token = arrived if first_token is None else first_token
                            result.events.append(TimedEvent(event, arrived))
                            index += len(ids)
                        finish = choice.get("finish_reason") or finish
            finally:
                await response.aclose()
        except EngineError as error:
            failure = _miner_error(error, self.timeouts)
            failure.partial = result
            raise failure from None
        if finish is None:
            failure = MinerProtocolError("the server closed the stream without a finish reason")
            failure.partial = result
            raise failure
        end = loop.time() - start
        reason = "length" if finish == "length" else "stop"  # _final tells eos from a stop string
        engine_final = EngineFinal(finish_reason=reason, prompt_tokens=int(usage.get("prompt_tokens") or 0),
                                   completion_tokens=index, queue_ms=0.0,
                                   ttft_ms=None if first_token is None else first_token * 1000, total_ms=end * 1000)
        result.final = self._final(engine_final, result)
        result.events.append(TimedEvent(result.final, end))
        return result

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()
        await super().close()


async def _next_event(events, due: float, before_first_token: bool, total: bool, broken):
    """The stream's next event by `due` (loop time); a missed deadline or a broken stream as an EngineError
    (`broken`: the transport's error types); StopAsyncIteration at the stream's end."""
    try:
        async with asyncio.timeout_at(due):
            return await anext(events)
    except TimeoutError:
        kind = "total" if total else ("first_byte" if before_first_token else "between_events")
        raise EngineError("engine_stalled", "the stream stalled", timeout=kind) from None
    except broken as error:
        raise EngineError("engine_failure", f"the stream broke: {error!r}") from None


def _leave(response: aiohttp.ClientResponse) -> None:
    """A body read to its end gives its connection back to the pool (keep-alive); one left before its end
    (a deadline, an error, a cancelled run) closes the connection, so that the server sees the client go
    and aborts the request (vLLM aborts only on a disconnect) instead of generating on for nobody."""
    if response.content.at_eof():
        response.release()
    else:
        response.close()


async def sse_data(response: aiohttp.ClientResponse):
    """The data of each server-sent event of an aiohttp response, through httpx-sse's own line and
    event decoders (CR, LF and CRLF line ends, comments, multi-line data, as the SSE standard says)."""
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    lines, events = SSELineDecoder(), SSEDecoder()
    async for raw in response.content.iter_any():
        for line in lines.decode(text.decode(raw)):
            event = events.decode(line)
            if event is not None:
                yield event.data
    for line in lines.flush():  # an event left unfinished at the end is dropped, as the standard says
        event = events.decode(line)
        if event is not None:
            yield event.data


def _miner_error(error: EngineError, timeouts: ClientTimeouts) -> MinerError:
    """The adapter's errors in the protocol client's terms, so both targets count errors alike.
    Read from the error's fields (its code, the server's status, the deadline that passed), never its text."""
    if error.http_status is not None:
        return MinerHTTPError(error.http_status, error.code, error.message)
    if error.unreachable:
        return MinerUnreachable(error.message)
    if error.timeout == "first_byte":
        return MinerTimeout("first_byte", timeouts.first_byte)
    if error.timeout == "between_events":
        return MinerTimeout("between_events", timeouts.between_events)
    if error.timeout == "total":
        return MinerTimeout("total", timeouts.total)
    code = ErrorCode.parse(error.code)
    if code is not None and code.http_status < 500:
        return MinerHTTPError(code.http_status, code, error.message)
    return MinerProtocolError(f"{error.code}: {error.message}")


def error_kind(error: MinerError) -> str:
    if isinstance(error, MinerHTTPError):
        return f"http_{error.status}"
    if isinstance(error, MinerTimeout):
        return f"timeout_{error.kind}"
    if isinstance(error, MinerUnreachable):
        return "unreachable"
    if isinstance(error, MinerStreamError):
        return f"stream_{error.code}"
    return "protocol"


# ---------------------------------------------------------------- the request set
def content_ids(rng: random.Random, tokenizer, need: int, instruct: bool = True) -> list[int]:
    """`need` tokens of seeded text (the instruction first when it leaves most of the room to it)."""
    head = "Continue the following text in the same style.\n\n"
    text = head if instruct and need >= 4 * len(tokenizer.encode(head)) else ""
    ids = tokenizer.encode(text)
    while len(ids) < need:
        text += "\n\n".join(corpus.paragraphs(rng, 4 * (need - len(ids)) + 64)) + "\n\n"
        ids = tokenizer.encode(text)
    return ids[:need]


def chat_frame(tokenizer) -> tuple[list[int], int]:
    """The chat template around one empty user turn, and where the turn's content goes (another model's
    tokenizer: its bos alone, no template; benchmarks/other_tokenizer.py)."""
    if isinstance(tokenizer, OtherModelTokenizer):
        return tokenizer.prompt_frame()
    frame = tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True)
    return frame, frame.index(tokenizer.special_tokens[IM_END])


def room_for_content(tokenizer, length: int) -> int:
    frame, _ = chat_frame(tokenizer)
    need = length - len(frame)
    if need < 1:
        raise BenchmarkSetupError(f"prompt length {length} leaves no room for content: the chat template alone "
                                  f"takes {len(frame)} tokens")
    return need


def framed(tokenizer, content: list[int]) -> list[int]:
    frame, at = chat_frame(tokenizer)
    return frame[:at] + content + frame[at:]


def exact_prompt(rng: random.Random, tokenizer, length: int) -> list[int]:
    """A one-turn chat prompt of exactly `length` tokens, template included, from seeded text."""
    # The instruction only when it leaves most of the room to the seeded material: that keeps
    # every prompt distinct, however short.
    return framed(tokenizer, content_ids(rng, tokenizer, room_for_content(tokenizer, length)))


@dataclass
class Cell:
    prompt_tokens: Optional[int]  # the nominal prompt length (None: a dataset file's own lengths)
    output_tokens: Optional[int]
    concurrency: Optional[int]  # closed waves of this many streams (None: open loop)
    waves: list[list[GenerateRequest]]  # open loop: one list of every request, in arrival order
    rate: Optional[float] = None  # open loop: requests/s (inf: all at once)
    max_concurrency: Optional[int] = None
    dataset: str = "random"

    @property
    def label(self) -> str:
        lengths = f"P={self.prompt_tokens} O={self.output_tokens}" if self.prompt_tokens else \
            (f"O={self.output_tokens}" if self.output_tokens else "")
        traffic = f"C={self.concurrency}" if self.rate is None else \
            f"rate={self.rate:g}" + (f" max-conc={self.max_concurrency}" if self.max_concurrency else "")
        return " ".join(part for part in (self.dataset, lengths, traffic) if part)


def request_id(rng: random.Random) -> str:
    return f"{rng.getrandbits(128):032x}"


def _varied(rng: random.Random, length: int, ratio: float) -> int:
    if not ratio:
        return length
    return rng.randint(max(1, math.floor(length * (1 - ratio))), math.ceil(length * (1 + ratio)))


def _request(settings: WorkloadSettings, tokenizer, rng: random.Random, logprobs: int, content: list[int],
             output_tokens: int) -> GenerateRequest:
    """One request of the set: token ids with the chat template (completions), or the turn's text (chat)."""
    common = dict(request_id=request_id(rng), max_tokens=output_tokens, temperature=settings.temperature,
                  top_p=settings.top_p, seed=rng.getrandbits(63), logprobs=logprobs)
    if settings.endpoint_type == "chat":
        return GenerateRequest(prompt=tokenizer.decode(content), chat=True, **common)
    return GenerateRequest(prompt_token_ids=framed(tokenizer, content), **common)


def build_requests(settings: WorkloadSettings, tokenizer, logprobs: int, namespace: str, prompt_tokens: int,
                   output_tokens: int, count: int, dataset: DatasetSettings = DatasetSettings()) -> list[GenerateRequest]:
    rng = random.Random(f"{settings.seed}:{namespace}:{prompt_tokens}:{output_tokens}")
    if dataset.name == "shared-prefix":
        need = room_for_content(tokenizer, prompt_tokens)
        if dataset.prefix_tokens >= need:
            raise BenchmarkSetupError(f"--shared-prefix-tokens {dataset.prefix_tokens} leaves no room for a "
                                      f"distinct suffix in a {prompt_tokens}-token prompt ({need} of content)")
        groups = random.Random(f"{settings.seed}:prefixes:{prompt_tokens}")
        prefixes = [content_ids(groups, tokenizer, dataset.prefix_tokens) for _ in range(dataset.prefix_groups)]
        out = []
        for k in range(count):
            suffix = content_ids(rng, tokenizer, need - dataset.prefix_tokens, instruct=False)
            out.append(_request(settings, tokenizer, rng, logprobs, prefixes[k % len(prefixes)] + suffix,
                                output_tokens))
        return out
    out = []
    for _ in range(count):
        length = _varied(rng, prompt_tokens, dataset.random_range_ratio)
        output = _varied(rng, output_tokens, dataset.random_range_ratio)
        out.append(_request(settings, tokenizer, rng, logprobs,
                            content_ids(rng, tokenizer, room_for_content(tokenizer, length)), output))
    return out


@dataclass(frozen=True)
class Conversation:
    """A ShareGPT conversation's first exchange: the user's turn (token ids of its text) and the
    reply's length in tokens."""

    prompt: list[int]
    reply_tokens: int


def read_sharegpt(path: str, tokenizer) -> list[Conversation]:
    """The first (human, gpt) exchange of every conversation in a ShareGPT-format JSON file."""
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as error:
        raise BenchmarkSetupError(f"cannot read the ShareGPT file {path}: {error}") from None
    if not isinstance(data, list):
        raise BenchmarkSetupError(f"{path} is not a ShareGPT file: expected a JSON list of conversations")
    out = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2 or not all(isinstance(t, dict) for t in turns[:2]):
            continue
        ask, reply = turns[0], turns[1]
        if ask.get("from") not in ("human", "user") or reply.get("from") not in ("gpt", "assistant"):
            continue
        if not isinstance(ask.get("value"), str) or not isinstance(reply.get("value"), str) or not ask["value"]:
            continue
        out.append(Conversation(tokenizer.encode(ask["value"]), len(tokenizer.encode(reply["value"]))))
    if not out:
        raise BenchmarkSetupError(f"{path} holds no conversation starting with a human turn and a gpt reply")
    return out


def sharegpt_requests(settings: WorkloadSettings, dataset: DatasetSettings, tokenizer, logprobs: int,
                      conversations: Sequence[Conversation], namespace: str, count: int,
                      fits) -> list[GenerateRequest]:
    """`count` requests from the conversations, in a seeded order (reused in turn when there are fewer)."""
    usable = []
    for c in conversations:
        output = dataset.sharegpt_output_len or c.reply_tokens
        if c.prompt and output >= 1 and fits(len(framed(tokenizer, c.prompt)), output):
            usable.append((c, output))
    if not usable:
        raise BenchmarkSetupError("no conversation of the ShareGPT file fits the endpoint (context, max tokens)")
    rng = random.Random(f"{settings.seed}:sharegpt:{namespace}")
    order = rng.sample(usable, len(usable))
    return [_request(settings, tokenizer, rng, logprobs, order[k % len(order)][0].prompt, order[k % len(order)][1])
            for k in range(count)]


def plan_cells(settings: WorkloadSettings, tokenizer, caps: Capabilities,
               dataset: DatasetSettings = DatasetSettings()) -> list[Cell]:
    limits = caps.limits
    logprobs = min(settings.logprobs, limits.max_logprobs)
    ratio = dataset.random_range_ratio if dataset.name == "random" else 0.0

    def fits(p: int, o: int) -> bool:
        return p + o <= caps.max_context and p <= limits.max_prompt_tokens and o <= limits.max_tokens

    # the traffic of one workload: (concurrency, rate, requests)
    def traffic(make) -> list[tuple]:
        if settings.request_rates is None:
            return [(c, None, make(f"c{c}", c * settings.repeats)) for c in settings.concurrency]
        return [(None, r, make(f"r{r:g}", settings.num_prompts)) for r in settings.request_rates]

    def cell(p, o, c, r, requests) -> Cell:
        waves = [requests[k * c:(k + 1) * c] for k in range(settings.repeats)] if c else [requests]
        return Cell(p, o, c, waves, rate=r, max_concurrency=settings.max_concurrency if r else None,
                    dataset=dataset.name)

    if dataset.name == "sharegpt":
        conversations = read_sharegpt(dataset.path, tokenizer)
        return [cell(None, dataset.sharegpt_output_len, c, r, requests) for c, r, requests in traffic(
            lambda ns, n: sharegpt_requests(settings, dataset, tokenizer, logprobs, conversations, ns, n, fits))]
    cells = []
    for p in settings.prompt_lengths:
        for o in settings.output_lengths:
            top_p, top_o = math.ceil(p * (1 + ratio)), math.ceil(o * (1 + ratio))
            if not fits(top_p, top_o):
                raise BenchmarkSetupError(
                    f"prompt length {top_p} + output length {top_o} does not fit the endpoint (context "
                    f"{caps.max_context}, max prompt {limits.max_prompt_tokens}, max output {limits.max_tokens}); "
                    "drop it from the lists")
            for c, r, requests in traffic(lambda ns, n: build_requests(settings, tokenizer, logprobs, ns, p, o, n,
                                                                       dataset)):
                cells.append(cell(p, o, c, r, requests))
    return cells


def request_set_digest(cells: Sequence[Cell]) -> str:
    digest = hashlib.sha256()
    for cell in cells:
        for wave in cell.waves:
            for request in wave:
                digest.update(encode_model(request))
    return digest.hexdigest()


def arrival_times(count: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds after the start at which each request is sent: all at 0 for an infinite rate; else gaps
    drawn from a gamma distribution of shape `burstiness` and mean 1/rate (shape 1: a Poisson process;
    below 1 burstier, above 1 more even; infinite: exactly 1/rate apart)."""
    if math.isinf(rate):
        return [0.0] * count
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += 1.0 / rate if math.isinf(burstiness) else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


# ---------------------------------------------------------------- measuring
@dataclass
class Sample:
    request: GenerateRequest
    started: float  # monotonic, for wave walls
    ended: float
    result: Optional[GenerateResult] = None
    error: Optional[str] = None  # error kind
    message: str = ""
    tier0: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.result is not None


class Runner:
    def __init__(self, endpoint, tokenizer, caps: Capabilities, hotkey: Optional[str], config: ScoringConfig):
        self.endpoint = endpoint
        self.tokenizer = tokenizer
        self.caps = caps
        self.hotkey = hotkey or ""
        self.config = config

    @property
    def not_applicable(self) -> tuple[str, ...]:
        """Tier-0 checks that cannot hold on this endpoint."""
        if self.endpoint.kind != "openai":
            return ()
        # chat: the server applies its own template, so the prompt's count is the server's own
        return NOT_APPLICABLE_ON_OPENAI + (NOT_APPLICABLE_IN_CHAT if isinstance(self.endpoint, ChatEndpoint) else ())

    def tier0(self, item, result: GenerateResult) -> list:
        failures = check_tier0(item, result, self.tokenizer, self.caps, self.hotkey, self.config)
        skip = self.not_applicable
        return [f for f in failures if f.check not in skip]

    async def one(self, request: GenerateRequest, check: bool = True) -> Sample:
        """Send one request; tier 0 on its answer unless `check` is off (then `checked` does it later)."""
        started = time.monotonic()
        try:
            result = await self.endpoint.generate(request)
        except MinerError as error:
            return Sample(request, started, time.monotonic(), error=error_kind(error), message=str(error)[:300])
        sample = Sample(request, started, time.monotonic(), result=result)
        if check:
            sample.tier0 = self.tier0(None, result)
        return sample

    async def warm_up(self, requests: Sequence[GenerateRequest], streams: int) -> None:
        """The warm-up, before any clock: `requests`, at most `streams` at once (as `vllm bench serve`
        sends its warm-ups), then, when they were fewer than `streams`, one wave of `streams` one-token
        requests, so that the client holds an open connection for each stream of the first measured
        wave. Before, the warm-up went one request at a time on one connection, and each stream of
        the first wave beyond it connected inside its TTFT (the connect, the server's new-connection
        setup, httpcore's first use of that connection). No warm-up requests (--warmup 0): nothing."""
        streams = max(1, streams)
        for at in range(0, len(requests), streams):
            await asyncio.gather(*(self.one(r) for r in requests[at:at + streams]))
        if requests and len(requests) < streams:
            await asyncio.gather(*(self.one(connection_request(requests[k % len(requests)], k), check=False)
                                   for k in range(streams)))

    def checked(self, samples: list[Sample]) -> list[Sample]:
        """Tier 0 on the finished samples of a measured batch, after its clock stopped: the checks'
        CPU time must not slow the streams being measured (on a small client machine it would)."""
        for sample in samples:
            if sample.ok:
                sample.tier0 = self.tier0(None, sample.result)
        return samples

    async def wave(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        return self.checked(list(await asyncio.gather(*(self.one(r, check=False) for r in requests))))

    async def open_loop(self, requests: Sequence[GenerateRequest], rate: float, burstiness: float,
                        max_concurrency: Optional[int], rng: random.Random) -> list[Sample]:
        """Send each request at its arrival time, whatever the others are doing (open loop); with
        `max_concurrency`, an arrival waits here until fewer than that many are in flight, and its
        clock starts when it is sent."""
        slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def send(request: GenerateRequest, at: float) -> Sample:
            await asyncio.sleep(max(0.0, start + at - loop.time()))
            if slots is None:
                return await self.one(request, check=False)
            async with slots:
                return await self.one(request, check=False)

        times = arrival_times(len(requests), rate, burstiness, rng)
        return self.checked(list(await asyncio.gather(*(send(r, at) for r, at in zip(requests, times)))))


def streams_in_flight(cells: Sequence[Cell]) -> int:
    """The most streams any workload has in flight at once (closed waves: the concurrency; open loop:
    --max-concurrency, else every request), at most MAX_WARM_CONNECTIONS."""
    most = max((c.concurrency or c.max_concurrency or max(len(wave) for wave in c.waves)) for c in cells)
    return min(most, MAX_WARM_CONNECTIONS)


def connection_request(request: GenerateRequest, k: int) -> GenerateRequest:
    """A one-token copy of a warm-up request, with its own id: it opens (or reuses) a connection."""
    return request.model_copy(update={"max_tokens": 1, "request_id": f"{request.request_id[:24]}conn{k:04d}"})


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary(values: Sequence[Optional[float]], percentiles: Sequence[float] = (50, 90, 99)) -> Optional[dict]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None
    mean = sum(values) / len(values)
    return {"n": len(values), "mean": mean, "std": math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)),
            "min": min(values), **{percentile_key(q): percentile(values, q) for q in percentiles},
            "max": max(values)}


def count_by(keys) -> dict[str, int]:
    out: dict[str, int] = {}
    for key in keys:
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def prompt_length(sample: Sample) -> int:
    """The prompt's tokens: as sent, or (chat) as the server counted them with its template."""
    if sample.request.prompt_token_ids is not None:
        return len(sample.request.prompt_token_ids)
    final = sample.result.final if sample.result is not None else None
    return final.usage.prompt_tokens if final is not None else 0


def request_metrics_ms(result: GenerateResult) -> dict[str, Optional[float]]:
    """TTFT, TPOT and end-to-end latency of one request in ms; TPOT is 0 for a single token (as
    `vllm bench serve` counts it for goodput)."""
    ttft = result.ttft_s
    tpot = time_per_output_token_ms(result)
    return {"ttft": None if ttft is None else ttft * 1000, "tpot": tpot if tpot is not None else 0.0,
            "e2el": None if result.total_s is None else result.total_s * 1000}


def meets(result: GenerateResult, slos: Sequence[tuple[str, float]]) -> bool:
    """Whether a finished request met every SLO (ms)."""
    values = request_metrics_ms(result)
    return all(values[name] is not None and values[name] <= limit for name, limit in slos)


def cell_duration_s(cell: Cell, waves: list[list[Sample]]) -> float:
    """Closed waves: the sum of the waves' walls; open loop: first send to last answer."""
    if cell.rate is None:
        return sum(max(s.ended for s in wave) - min(s.started for s in wave) for wave in waves if wave)
    samples = [s for wave in waves for s in wave]
    return max(s.ended for s in samples) - min(s.started for s in samples) if samples else 0.0


def cell_report(cell: Cell, waves: list[list[Sample]], caps: Capabilities, result: ResultSettings = ResultSettings()
                ) -> dict:
    q = result.percentiles
    samples = [s for wave in waves for s in wave]
    done = [s for s in samples if s.ok]
    wall = tokens = 0.0
    for wave in waves:
        finished = [s for s in wave if s.ok]
        if finished:
            wall += max(s.ended for s in finished) - min(s.started for s in wave)
            tokens += sum(len(s.result.token_ids) for s in finished)
    ttfts = [s.result.ttft_s for s in done]
    duration = cell_duration_s(cell, waves)
    output = sum(len(s.result.token_ids) for s in done)
    prompt = sum(prompt_length(s) for s in done)
    good = sum(1 for s in done if meets(s.result, result.goodput)) if result.goodput else None
    per_second = (lambda n: n / duration if duration > 0 else None)
    return {
        "workload": cell.label, "dataset": cell.dataset,
        "prompt_tokens": cell.prompt_tokens, "output_tokens": cell.output_tokens, "concurrency": cell.concurrency,
        "request_rate": None if cell.rate is None else _json_rate(cell.rate), "max_concurrency": cell.max_concurrency,
        "beyond_declared_capacity": (cell.concurrency or cell.max_concurrency or len(samples))
        > caps.max_concurrent_streams,
        "requests": len(samples), "completed": len(done), "errors": count_by(s.error for s in samples if not s.ok),
        "error_examples": sorted({s.message for s in samples if not s.ok})[:3],
        "input_tokens": summary([prompt_length(s) for s in done], q),
        "completion_tokens": summary([len(s.result.token_ids) for s in done], q),
        "ttft_s": summary(ttfts, q),
        "prefill_tokens_per_s": summary([prompt_length(s) / s.result.ttft_s for s in done if s.result.ttft_s], q),
        "decode_tokens_per_s": summary([decode_tokens_per_s(s.result) for s in done], q),
        "aggregate_tokens_per_s": tokens / wall if wall > 0 else None,
        "latency_s": summary([s.result.total_s for s in done], q),
        "tier0_failed": sum(1 for s in done if s.tier0),
        # as `vllm bench serve` defines them: TPOT per request = (end - first token) / (tokens - 1);
        # ITL = every gap between two consecutive tokens of a stream; E2EL = the whole request
        "ttft_ms": summary([t * 1000 for t in ttfts if t is not None], q),
        "tpot_ms": summary([time_per_output_token_ms(s.result) for s in done], q),
        "itl_ms": summary([gap for s in done for gap in inter_token_latencies_ms(s.result)], q),
        "e2el_ms": summary([s.result.total_s * 1000 for s in done if s.result.total_s is not None], q),
        "duration_s": duration,
        "request_throughput": per_second(len(done)),
        "output_throughput": per_second(output),
        "total_token_throughput": per_second(output + prompt),
        "goodput": None if good is None else {"slos_ms": dict(result.goodput), "good": good,
                                              "requests_per_s": per_second(good)},
    }


def request_rows(cell: Cell, waves: list[list[Sample]], slos: Sequence[tuple[str, float]]) -> list[dict]:
    """One JSON-ready row per request of a workload (for requests.jsonl)."""
    samples = [s for wave in waves for s in wave]
    origin = min((s.started for s in samples), default=0.0)
    rows = []
    for wave_index, wave in enumerate(waves):
        for s in wave:
            row = {"workload": cell.label, "wave": wave_index if cell.rate is None else None,
                   "request_id": s.request.request_id, "max_tokens": s.request.max_tokens,
                   "sent_s": s.started - origin, "ok": s.ok, "error": s.error, "message": s.message or None}
            if s.ok:
                r = s.result
                metrics = request_metrics_ms(r)
                row.update(prompt_tokens=prompt_length(s), completion_tokens=len(r.token_ids),
                           finish_reason=r.final.finish_reason, ttft_ms=metrics["ttft"],
                           tpot_ms=time_per_output_token_ms(r), e2el_ms=metrics["e2el"],
                           itl_ms=inter_token_latencies_ms(r), tier0_failures=[f.check for f in s.tier0],
                           good=meets(r, slos) if slos else None)
            rows.append(row)
    return rows


def time_per_output_token_ms(result: GenerateResult) -> Optional[float]:
    times = result.token_arrivals_s
    if len(times) < 2 or result.total_s is None:
        return None
    return (result.total_s - times[0]) * 1000 / (len(times) - 1)


def inter_token_latencies_ms(result: GenerateResult) -> list[float]:
    times = result.token_arrivals_s  # tokens of one event share its time: a gap of 0 inside an event
    return [(b - a) * 1000 for a, b in zip(times, times[1:])]


# ---------------------------------------------------------------- quality
def reference_engine(checkpoint: str, max_context: int) -> tuple[LocalEngine, str]:
    from inference.serving import load_reference_model  # noqa: PLC0415 (loads torch models)

    model, tokenizer, fingerprint = load_reference_model(checkpoint)
    engine = LocalEngine(model, tokenizer, EngineSettings(max_context=max_context, max_concurrent_sequences=4),
                         model_fingerprint=fingerprint, engine_kind="reference")
    return engine, fingerprint


async def run_audits(samples: list[Sample], count: int, reference, tokenizer, config: ScoringConfig,
                     seed: int) -> dict:
    rng = random.Random(f"{seed}:audits")
    chosen = rng.sample(samples, min(count, len(samples)))
    verdicts, checks, qualities, errors = [], [], [], []
    for sample in chosen:
        audit = await audit_tier1(sample.request.prompt_token_ids, sample.result, reference, config,
                                  stop_ids=tokenizer.stop_ids, rng=random.Random(rng.getrandbits(64)))
        verdicts.append(audit.passed)
        checks += [f.check for f in audit.failures]
        if audit.quality is not None:
            qualities.append(audit.quality)
        if audit.error:
            errors.append(audit.error)
    return {"audited": len(chosen), "passed": verdicts.count(True), "failed": verdicts.count(False),
            "no_verdict": verdicts.count(None), "failures": count_by(checks), "quality": summary(qualities),
            "errors": sorted(set(errors))[:3]}


async def run_canaries(runner: Runner, reference, settings: BenchmarkSettings, tokenizer, prompt_tokens: int,
                       tokens: int) -> dict:
    rng = random.Random(f"{settings.workload.seed}:canaries")
    prompts = []
    for _ in range(settings.quality.canaries):
        prompt = exact_prompt(rng, tokenizer, prompt_tokens)
        if prompt not in prompts:  # a canary is used once
            prompts.append(prompt)
    config = ScoringConfig().replace(canary_tokens=tokens)
    pool = await CanaryPool.from_engine(reference, prompts, config, model_fingerprint=reference.model_fingerprint)
    passed = failed = errors = 0
    tier0_failed, mismatches = 0, []
    for canary in pool.canaries.values():
        request = GenerateRequest(request_id=request_id(rng), prompt_token_ids=list(canary.prompt_ids),
                                  max_tokens=tokens, temperature=0.0, seed=rng.getrandbits(63),
                                  logprobs=min(settings.workload.logprobs, runner.caps.limits.max_logprobs))
        sample = await runner.one(request)
        if not sample.ok:
            errors += 1
            continue
        tier0_failed += bool(sample.tier0)
        verdict = check_tier2(canary, sample.result, config)
        passed += verdict.passed
        failed += not verdict.passed
        if verdict.mismatch_at is not None:
            mismatches.append(verdict.mismatch_at)
    return {"checked": passed + failed, "passed": passed, "failed": failed, "errors": errors,
            "tokens_per_canary": tokens, "first_mismatch_positions": mismatches, "tier0_failed": tier0_failed}


async def run_probes(runner: Runner, settings: BenchmarkSettings, tokenizer) -> dict:
    w = settings.workload
    config = ScoringConfig(round_requests=settings.quality.probes, mix_chat=0.0, mix_long_context=0.0,
                           mix_burst=0.0, mix_probe=1.0, probe_weights=(0.0, 1.0, 1.0),
                           chat_prompt_tokens=(16, max(16, max(w.prompt_lengths))),
                           chat_max_tokens=(64, max(64, max(w.output_lengths))),
                           request_logprobs=w.logprobs)
    try:
        items = plan_round(random.Random(f"{w.seed}:probes"), runner.caps, config, tokenizer=tokenizer)
    except WorkloadError as error:
        return {"skipped": f"probes do not fit this endpoint: {error}"}
    results = {"copy": [0, 0], "planted_fact": [0, 0]}  # kind -> [passed, checked]
    errors = tier0_failed = 0
    for item in items:
        sample = await runner.one(item.request)
        if not sample.ok:
            errors += 1
            continue
        tier0_failed += bool(sample.tier0)
        counts = results[item.expect.probe]
        counts[0] += not check_answer(item, sample.result)
        counts[1] += 1
    return {kind: {"passed": p, "checked": n} for kind, (p, n) in results.items()} | {
        "errors": errors, "tier0_failed": tier0_failed}


# ---------------------------------------------------------------- the run
def open_endpoint(settings: BenchmarkSettings):
    t = settings.target
    if t.miner_url:
        try:
            wallet = open_wallet(settings.wallet)
        except WalletNotFound as error:
            raise BenchmarkSetupError(str(error)) from None
        return MinerEndpoint(t.miner_url, t.miner_hotkey, wallet, settings.timeouts)
    w = settings.workload
    streams = max(w.concurrency) if w.request_rates is None else (w.max_concurrency or w.num_prompts)
    kind = ChatEndpoint if w.endpoint_type == "chat" else OpenAIEndpoint
    return kind(t, settings.timeouts, streams, ignore_eos=w.ignore_eos)


def _served_model_tokenizer(tok_dir):
    """A served model that is not a Kimi K3 checkpoint: its tokenizer.json, as the remote engine reads one (byte-level
    BPE with the Kimi chat tokens, as the test model behind vLLM has), else as any Hugging Face tokenizer (prompts
    without a chat template); None when the directory holds neither."""
    from inference.serving.remote import RemoteSetupError, served_tokenizer  # noqa: PLC0415

    try:
        return served_tokenizer(tok_dir)
    except RemoteSetupError:
        pass
    try:
        return OtherModelTokenizer(tok_dir)
    except OtherModelTokenizerError:
        return None


@contextlib.contextmanager
def frozen_heap():
    """While measuring: the objects made so far (torch, the tokenizer, the planned requests: a few
    hundred thousand) are moved out of the garbage collector's reach (gc.freeze), so that a full
    collection does not stall the event loop for tens to hundreds of ms while a first token is due
    (`vllm bench serve` does the same before its run). Undone afterwards."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def progress_line(line: str) -> None:
    """A progress line on stderr (stdout is the report)."""
    print(f"[k3-bench] {line}", file=sys.stderr, flush=True)


async def run_benchmark(settings: BenchmarkSettings, argv: Sequence[str] = (),
                        say: Callable[[str], None] = progress_line) -> dict:
    """Run the whole benchmark and return the report (a JSON-ready dict); `say` gets a line per step."""
    problems = settings.problems()
    if problems:
        raise BenchmarkSetupError("; ".join(problems))
    began, wall_start = time.time(), time.monotonic()
    tok_dir = settings.tokenizer_checkpoint or settings.quality.reference_checkpoint
    try:
        tokenizer = load_tokenizer(tok_dir, read_config(tok_dir))
    except (OSError, ValueError, CheckpointError) as error:  # CheckpointError: a config that is not K3's
        tokenizer = _served_model_tokenizer(tok_dir)
        if tokenizer is None:
            raise BenchmarkSetupError(f"cannot load the tokenizer of {tok_dir}: {error}") from None
    w, q = settings.workload, settings.quality
    config = ScoringConfig()
    endpoint = open_endpoint(settings)
    reference = None
    try:
        try:
            caps, described = await endpoint.capabilities(tokenizer)
        except MinerError as error:
            raise BenchmarkSetupError(f"cannot read the endpoint's capabilities: {error}") from None
        if caps.vocab_size != tokenizer.vocab_size:
            raise BenchmarkSetupError(f"the endpoint's vocabulary ({caps.vocab_size}) is not the tokenizer's "
                                      f"({tokenizer.vocab_size}): give the served model's --tokenizer-checkpoint")
        cells = plan_cells(w, tokenizer, caps, settings.dataset)
        runner = Runner(endpoint, tokenizer, caps, settings.target.miner_hotkey, config)
        say(f"{endpoint.kind} at {settings.target.miner_url or settings.target.openai_url}: model "
            f"{caps.model_fingerprint}, context {caps.max_context}, {caps.max_concurrent_streams} streams; "
            f"{len(cells)} workloads, {sum(len(wave) for c in cells for wave in c.waves)} requests")

        smallest = min(w.prompt_lengths), min(w.output_lengths)
        workloads, all_samples, per_request = [], [], []
        arrivals = random.Random(f"{w.seed}:arrivals")
        with frozen_heap():
            streams = min(streams_in_flight(cells), caps.max_concurrent_streams)  # a miner 429s beyond its own
            if w.warmup:
                say(f"warming up: {w.warmup} requests, then one connection per stream ({streams})")
            await runner.warm_up(build_requests(w, tokenizer, cells[0].waves[0][0].logprobs, "warmup", *smallest,
                                                w.warmup), streams)
            for number, cell in enumerate(cells, start=1):
                cell_started = time.monotonic()
                if cell.rate is None:
                    waves = [await runner.wave(wave) for wave in cell.waves]
                else:
                    waves = [await runner.open_loop(cell.waves[0], cell.rate, w.burstiness, cell.max_concurrency,
                                                    arrivals)]
                all_samples += [s for wave in waves for s in wave]
                workloads.append(cell_report(cell, waves, caps, settings.result))
                if settings.result.save_result:
                    per_request += request_rows(cell, waves, settings.result.goodput)
                done_here = sum(1 for wave in waves for sample in wave if sample.ok)
                say(f"workload {number}/{len(cells)} {cell.label}: {done_here}/{sum(map(len, waves))} completed in "
                    f"{time.monotonic() - cell_started:.1f} s")
        done = [s for s in all_samples if s.ok]

        quality: dict[str, Any] = {"tier0": {
            "checked": len(done), "passed": sum(1 for s in done if not s.tier0),
            "failures": count_by(f.check for s in done for f in s.tier0),
            "not_applicable": list(runner.not_applicable)}}
        reference_fingerprint = None
        if q.reference_checkpoint and (q.audits or q.canaries):
            reference, reference_fingerprint = reference_engine(
                q.reference_checkpoint, max(w.prompt_lengths) + max(max(w.output_lengths), MAX_CANARY_TOKENS) + 1)
            await reference.start()
            say(f"tier-1 audits of {q.audits} answers and {q.canaries} canaries on the reference checkpoint")
            quality["audits"] = await run_audits(done, q.audits, reference, tokenizer, config, w.seed)
            if q.canaries:
                quality["canaries"] = await run_canaries(runner, reference, settings, tokenizer,
                                                         min(w.prompt_lengths),
                                                         min(MAX_CANARY_TOKENS, max(w.output_lengths)))
        else:
            reason = "no --reference-checkpoint" if not q.reference_checkpoint else "disabled"
            quality["audits"] = {"skipped": reason}
            quality["canaries"] = {"skipped": reason}
        if not q.probes:
            quality["probes"] = {"skipped": "disabled"}
        elif isinstance(tokenizer, OtherModelTokenizer):
            quality["probes"] = {"skipped": "another model's tokenizer: the answer probes are Kimi chat turns"}
        else:
            say(f"{q.probes} answer probes")
            quality["probes"] = await run_probes(runner, settings, tokenizer)
    finally:
        if reference is not None:
            await reference.stop()
        await endpoint.close()

    t = settings.target
    return {
        "format": REPORT_FORMAT, "version": REPORT_VERSION,
        "command": ["benchmarks/endpoint.py", *argv],
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(began)),
        "duration_s": time.monotonic() - wall_start,
        "target": {"kind": endpoint.kind, "url": t.miner_url or t.openai_url,
                   **({"hotkey": t.miner_hotkey} if t.miner_url else {"model": t.model})},
        "endpoint": described,
        "model_fingerprint": caps.model_fingerprint,
        "reference_fingerprint": reference_fingerprint,
        "precision": caps.precision,
        "max_context": caps.max_context,
        "declared_concurrency": caps.max_concurrent_streams if endpoint.kind == "miner" else None,
        "sampling": {"temperature": w.temperature, "top_p": w.top_p, "top_k": 0, "logprobs": w.logprobs,
                     "seed": w.seed},
        "settings": {"prompt_lengths": list(w.prompt_lengths), "output_lengths": list(w.output_lengths),
                     "concurrency": list(w.concurrency), "repeats": w.repeats, "warmup": w.warmup,
                     "timeouts_s": dataclasses.asdict(settings.timeouts),
                     "traffic": ("closed waves" if w.request_rates is None else
                                 {"request_rates": [_json_rate(r) for r in w.request_rates], "burstiness":
                                  _json_rate(w.burstiness), "max_concurrency": w.max_concurrency,
                                  "num_prompts": w.num_prompts}),
                     "endpoint_type": w.endpoint_type, "ignore_eos": w.ignore_eos,
                     "dataset": dataclasses.asdict(settings.dataset),
                     "percentiles": list(settings.result.percentiles),
                     "goodput_slos_ms": dict(settings.result.goodput)},
        "request_set_sha256": request_set_digest(cells),
        "client": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "workloads": workloads,
        "totals": {"requests": len(all_samples), "completed": len(done),
                   "errors": count_by(s.error for s in all_samples if not s.ok)},
        "quality": quality,
        "percentile_metrics": list(settings.result.percentile_metrics),
        **({"per_request": per_request} if settings.result.save_result else {}),
    }


def _json_rate(value: float):
    """inf as the string "inf" (JSON has no infinity)."""
    return "inf" if math.isinf(value) else value


# ---------------------------------------------------------------- the report
def _fmt(value: Optional[float], digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"


def _stat(stats: Optional[dict], key: str) -> str:
    return _fmt(stats.get(key)) if stats else "-"


def _conc(w: dict) -> str:
    if w.get("request_rate") is None:
        return str(w["concurrency"])
    return f"rate {w['request_rate']}" + (f" max {w['max_concurrency']}" if w.get("max_concurrency") else "")


def markdown_report(report: dict) -> str:
    target = report["target"]
    who = target.get("hotkey") or target.get("model")
    lines = [
        f"# Endpoint benchmark: {target['kind']} {target['url']} ({who})",
        "",
        f"- model fingerprint: `{report['model_fingerprint']}`, precision: {report['precision']}, "
        f"context: {report['max_context']}, declared concurrency: {report['declared_concurrency'] or '-'}",
        f"- sampling: temperature {report['sampling']['temperature']}, top_p {report['sampling']['top_p']}, "
        f"logprobs {report['sampling']['logprobs']}, seed {report['sampling']['seed']}",
        f"- request set sha256: `{report['request_set_sha256'][:16]}...`; started {report['started_at']}, "
        f"duration {report['duration_s']:.1f} s",
        "",
        "| prompt | output | conc | ok/req | errors | TTFT p50 s | TTFT p90 s | prefill tok/s p50 | "
        "decode tok/s p50 | aggregate tok/s | latency p50 s | p90 s | p99 s | tier0 fail |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in report["workloads"]:
        errors = ", ".join(f"{k} {v}" for k, v in w["errors"].items()) or "-"
        lines.append(
            f"| {w['prompt_tokens'] or '-'} | {w['output_tokens'] or '-'} | {_conc(w)} | "
            f"{w['completed']}/{w['requests']} | "
            f"{errors} | {_stat(w['ttft_s'], 'p50')} | {_stat(w['ttft_s'], 'p90')} | "
            f"{_stat(w['prefill_tokens_per_s'], 'p50')} | {_stat(w['decode_tokens_per_s'], 'p50')} | "
            f"{_fmt(w['aggregate_tokens_per_s'])} | {_stat(w['latency_s'], 'p50')} | {_stat(w['latency_s'], 'p90')} | "
            f"{_stat(w['latency_s'], 'p99')} | {w['tier0_failed']} |")
    lines += ["", "| prompt | output | conc | TPOT mean ms | TPOT p50 | TPOT p90 | TPOT p99 | ITL mean ms | ITL p50 | "
              "ITL p90 | ITL p99 |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w in report["workloads"]:
        tpot, itl = w.get("tpot_ms"), w.get("itl_ms")
        lines.append(f"| {w['prompt_tokens'] or '-'} | {w['output_tokens'] or '-'} | {_conc(w)} | "
                     + " | ".join(_stat(x, k) for x in (tpot, itl) for k in ("mean", "p50", "p90", "p99")) + " |")
    lines += serving_tables(report)
    q = report["quality"]
    t0 = q["tier0"]
    lines += ["", "Quality:",
              f"- tier 0: {t0['passed']}/{t0['checked']} clean"
              + (f" (failures: {t0['failures']})" if t0["failures"] else "")
              + (f"; not applicable here: {', '.join(t0['not_applicable'])}" if t0["not_applicable"] else "")]
    for name in ("audits", "canaries"):
        part = q[name]
        if "skipped" in part:
            lines.append(f"- {name}: skipped ({part['skipped']})")
        elif name == "audits":
            quality = part["quality"]["mean"] if part["quality"] else None
            lines.append(f"- tier-1 audits: {part['passed']} passed, {part['failed']} failed, {part['no_verdict']} "
                         f"without verdict of {part['audited']}; mean quality {_fmt(quality)}"
                         + (f"; failures {part['failures']}" if part["failures"] else ""))
        else:
            lines.append(f"- tier-2 canaries ({part['tokens_per_canary']} greedy tokens): {part['passed']}/"
                         f"{part['checked']} match the reference, {part['errors']} errors")
    probes = q["probes"]
    if "skipped" in probes:
        lines.append(f"- answer probes: skipped ({probes['skipped']})")
    else:
        lines.append(f"- answer probes: copy {probes['copy']['passed']}/{probes['copy']['checked']}, planted fact "
                     f"{probes['planted_fact']['passed']}/{probes['planted_fact']['checked']}, "
                     f"{probes['errors']} errors")
    lines += ["", "Command: `" + " ".join(report["command"]) + "`", ""]
    return "\n".join(lines)


def serving_tables(report: dict) -> list[str]:
    """The serving view, in `vllm bench serve`'s terms: throughputs and goodput per workload, then
    the chosen latency metrics (--percentile-metrics) at the chosen percentiles (--metric-percentiles)."""
    keys = [percentile_key(q) for q in report["settings"].get("percentiles", (50, 90, 99))]
    slos = report["settings"].get("goodput_slos_ms") or {}
    lines = ["", "| workload | ok/req | duration s | req/s | " + ("goodput req/s | " if slos else "")
             + "output tok/s | total tok/s | mean in | mean out |",
             "|---|---:|---:|---:|" + ("---:|" if slos else "") + "---:|---:|---:|---:|"]
    for w in report["workloads"]:
        goodput = f"{_fmt((w.get('goodput') or {}).get('requests_per_s'))} | " if slos else ""
        lines.append(f"| {w['workload']} | {w['completed']}/{w['requests']} | {_fmt(w['duration_s'])} | "
                     f"{_fmt(w['request_throughput'])} | {goodput}{_fmt(w['output_throughput'])} | "
                     f"{_fmt(w['total_token_throughput'])} | {_stat(w['input_tokens'], 'mean')} | "
                     f"{_stat(w['completion_tokens'], 'mean')} |")
    if slos:
        lines.append("")
        lines.append("Goodput SLOs (ms): " + ", ".join(f"{k} <= {v:g}" for k, v in slos.items()))
    metrics = report.get("percentile_metrics") or list(LATENCY_METRICS)
    lines += ["", "| workload | metric (ms) | mean | std | " + " | ".join(keys) + " |",
              "|---|---|---:|---:|" + "---:|" * len(keys)]
    for w in report["workloads"]:
        for metric in metrics:
            stats = w.get(f"{metric}_ms")
            lines.append(f"| {w['workload']} | {metric.upper()} | {_stat(stats, 'mean')} | {_stat(stats, 'std')} | "
                         + " | ".join(_stat(stats, k) for k in keys) + " |")
    return lines


def write_report(report: dict, out_dir: str) -> tuple[Path, Path]:
    """report.json and report.md in out_dir; with --save-result also requests.jsonl, one line per request."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    report = dict(report)
    rows = report.pop("per_request", None)
    json_path, md_path = out / "report.json", out / "report.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(markdown_report(report))
    if rows is not None:
        with open(out / "requests.jsonl", "w") as jsonl:
            for row in rows:
                jsonl.write(json.dumps(row) + "\n")
    return json_path, md_path


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    settings = read_benchmark_settings(argv)
    setup_logging(settings.log_level, settings.log_format)
    try:
        report = asyncio.run(run_benchmark(settings, argv))
    except BenchmarkSetupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out_dir = settings.out_dir or ("." if settings.result.save_result else None)
    if out_dir:
        json_path, md_path = write_report(report, out_dir)
        print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    print(markdown_report(report))
    if not report["totals"]["completed"]:
        print("error: no request succeeded", file=sys.stderr)
        return 1
    return 0



if __name__ == "__main__":
    sys.exit(main())
