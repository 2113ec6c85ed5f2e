"""lm-evaluation-harness (PyPI `lm-eval`) through the gateway, as an evaluator would run it.

The real `lm_eval` command, as a process, with its `local-completions` model pointed at the gateway's
/v1/completions, on the task kept in evals/ (a local JSONL file: no dataset download, no tokenizer from
a hub: `tokenizer_backend=none`, text prompts). The gateway serves it from a tiny-model miner on a
devnet (the gateway tests' setup). The answers lm-eval logged must be the miner's greedy answers (as a
plain engine in this process decodes them, cut at the task's stop) and its metric their exact-match
rate.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from test_gateway import KEY, MODEL, Directory, greedy_reference, subnet, world  # noqa: F401 (fixtures)

from protocol.client import ClientTimeouts

ROOT = Path(__file__).resolve().parent.parent
TASK = "k3_gateway_smoke"
MAX_GEN_TOKS = 8  # evals/k3_gateway_smoke.yaml


def lm_eval_command(base_url: str, out: Path) -> list[str]:
    model_args = ",".join([f"model={MODEL}", f"base_url={base_url}/v1/completions", "tokenizer_backend=none",
                           "tokenized_requests=False", "max_retries=1", "timeout=300"])
    return [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
            "--tasks", TASK, "--include_path", str(ROOT / "evals"), "--output_path", str(out), "--log_samples",
            "--seed", "0"]


def only(paths: list[Path], what: str) -> Path:
    assert len(paths) == 1, f"expected one {what}, found {paths}"
    return paths[0]


@pytest.mark.timeout(1500)
async def test_lm_eval_local_completions_runs_the_repo_task_through_the_gateway(world, subnet, tmp_path):
    start_miner, start_gateway, _ = subnet
    miner = await start_miner("miner_a", uid=1, score=0.9)
    directory = Directory([miner])
    # (deadlines for a loaded 2-core CI machine; the eval sends its four requests one at a time)
    gateway = await start_gateway(directory, miner_timeouts=ClientTimeouts(first_byte=120.0, between_events=60.0,
                                                                           total=240.0))
    out = tmp_path / "out"
    env = {**os.environ, "OPENAI_API_KEY": KEY, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path / "lm_eval.log"
    with open(log_path, "wb") as log:
        process = await asyncio.create_subprocess_exec(*lm_eval_command(gateway.url, out), cwd=ROOT, env=env,
                                                       stdout=log, stderr=asyncio.subprocess.STDOUT)
        try:
            await asyncio.wait_for(process.wait(), timeout=1200)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise AssertionError("lm_eval did not finish in 1200 s:\n" + log_path.read_text()[-4000:]) from None
    assert process.returncode == 0, log_path.read_text()[-4000:]

    results = json.loads(only(list(out.rglob("results_*.json")), "results file").read_text())
    metric = results["results"][TASK]["exact_match,none"]
    assert isinstance(metric, float) and 0.0 <= metric <= 1.0
    samples = [json.loads(line) for line in
               only(list(out.rglob(f"samples_{TASK}_*.jsonl")), "samples file").read_text().splitlines()]
    docs = (ROOT / "evals" / f"{TASK}.jsonl").read_text().splitlines()
    assert len(samples) == len(docs) == results["n-samples"][TASK]["effective"]

    tokenizer = world["tokenizer"]
    matches = []
    for sample in samples:
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        assert prompt == f"Question: {sample['doc']['question']}\nAnswer:"
        greedy = await greedy_reference(world, tokenizer.encode(prompt), MAX_GEN_TOKS)
        expected = tokenizer.decode(greedy, skip_special_tokens=True).split("\n")[0]
        answer = sample["filtered_resps"][0]
        assert answer == expected, (prompt, answer, expected)
        matches.append(float(answer == sample["target"]))
        assert sample["exact_match"] == matches[-1]
    assert metric == pytest.approx(sum(matches) / len(matches))
    # every request went through the gateway to the miner (and was reported to the validator's hook)
    assert [(uid, hotkey) for uid, hotkey, _, _ in directory.reports] == [(1, miner.hotkey)] * len(docs)
