"""The distilled draft model (inference/decoding/distilled.py): bound to its checkpoint's fingerprint,
proposes what the target says on contexts it was distilled from, and leaves greedy and sampled output unchanged."""
from pathlib import Path

import pytest
import torch

from inference.__main__ import main as cli_main
from inference.decoding.distilled import (DistilledDrafter, DraftModelMismatch, distill, load_table,
                                          speculation_with_table)
from inference.decoding.drafters import make_drafter
from inference.decoding.sampling import SamplingParams
from inference.decoding.speculation import SpeculationConfig, speculative_generate
from inference.model.training import greedy_answer
from inference.serving.builders import load_reference_model

# the corpus distilled from: a text that code changes leave alone (the windows and their continuations depend on it)
TEXT = Path(__file__).resolve().parents[1].joinpath("LICENSE").read_bytes()


@pytest.fixture(scope="module")
def trained(trained_checkpoint):
    torch.set_num_threads(1)
    return load_reference_model(trained_checkpoint)


@pytest.fixture(scope="module")
def table_file(trained, tmp_path_factory):
    model, _, fp = trained
    table = distill(model, fp, [TEXT], model.config.bos_token_id, forced_windows=16, window=64, generated=8,
                    prompt_bytes=32, gen_tokens=24, batch=8)
    path = tmp_path_factory.mktemp("distilled") / "table.k3d"
    table.save(path)
    return path


def test_table_is_bound_to_its_checkpoint(trained, table_file, tiny_checkpoint):
    model, _, fp = trained
    table = load_table(table_file, fp)
    assert table.target_fingerprint == fp and table.entries
    again = distill(model, fp, [TEXT], model.config.bos_token_id, forced_windows=16, window=64, generated=8,
                    prompt_bytes=32, gen_tokens=24, batch=8)
    assert again.entries == table.entries  # deterministic
    other_fp = load_reference_model(tiny_checkpoint)[2]
    assert other_fp != fp
    with pytest.raises(DraftModelMismatch, match="distilled from checkpoint"):
        load_table(table_file, other_fp)
    with pytest.raises(DraftModelMismatch):
        speculation_with_table(SpeculationConfig(drafter="distilled"), table_file, other_fp)
    with pytest.raises(ValueError, match="needs its table"):
        make_drafter("distilled")
    assert SpeculationConfig(drafter="distilled").problems()  # a kind without its table is refused
    assert not speculation_with_table(SpeculationConfig(drafter="distilled"), table_file, fp).problems()
    rc = cli_main(["generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "def f(x):", "--max-tokens", "4",
                   "--speculate", "distilled", "--draft-model", str(table_file)])
    assert rc != 0  # the CLI refuses the table for another checkpoint


def test_proposes_the_targets_choice_on_distilled_contexts(trained, table_file):
    model, _, fp = trained
    drafter = DistilledDrafter(load_table(table_file, fp))
    # the first generated continuation of the distillation: a 32-byte corpus window, BOS first
    start = (len(TEXT) - 32) // 8 // 2
    prompt = [model.config.bos_token_id] + list(TEXT[start:start + 32])
    out = greedy_answer(model, prompt, 24, [])
    right = sum(drafter.propose(prompt + out[:j], 1).tokens == [out[j]] for j in range(len(out)))
    assert right >= 0.9 * len(out)
    assert drafter.propose(prompt, 4).tokens == out[:4]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40, ignore_eos=True),
                                    SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.6, seed=11),
                                    SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, top_p=0.9, seed=12)])
def test_output_equals_plain_greedy_and_sampled(trained, table_file, params):
    """The distilled drafter's guesses are kept only where they are the token plain decoding emits there
    (k3-gumbel/1 for sampled requests): the output is plain decoding's, token for token."""
    model, tokenizer, fp = trained
    config = speculation_with_table(SpeculationConfig(drafter="distilled"), table_file, fp)
    accepted = 0
    for text in ("def add(a, b):\n    return a + b\n\ndef ", "Marigold ferries drift past quiet harbours"):
        ids = tokenizer.encode(text, add_bos=True)
        plain, _ = speculative_generate(model, ids, params, SpeculationConfig())
        spec, stats = speculative_generate(model, ids, params, config)
        assert spec == plain
        accepted += stats["draft_accepted"]
    assert accepted > 0


def test_the_shipped_table_belongs_to_the_shipped_checkpoint():
    """inference/model/assets/tiny_trained_drafter.k3d must be rebuilt (scripts/distill_drafter.py) whenever
    the trained asset changes; this fails until it is."""
    from inference.model import fingerprint  # noqa: PLC0415

    assets = Path(__file__).resolve().parents[1] / "inference" / "model" / "assets"
    table = load_table(assets / "tiny_trained_drafter.k3d", fingerprint(assets / "tiny_trained"))
    assert len(table.entries) > 1000


async def test_the_miner_serves_with_the_shipped_table_and_refuses_it_for_another_checkpoint(trained_checkpoint,
                                                                                           tiny_checkpoint):
    from conftest import collect_events  # noqa: PLC0415

    from inference.serving import build_engine  # noqa: PLC0415
    from inference.serving.builders import EngineSpecError  # noqa: PLC0415
    from inference.serving.engine import GenerationRequest  # noqa: PLC0415
    from neurons.miner_app import read_miner_settings  # noqa: PLC0415

    shipped = str(Path(__file__).resolve().parents[1] / "inference" / "model" / "assets" / "tiny_trained_drafter.k3d")
    flags = ["--speculate", "distilled", "--draft-model", shipped]

    def settings(ckpt, extra):
        return read_miner_settings(["--netuid", "1", "--network", "devnet:/nonexistent.sqlite", "--checkpoint",
                                    str(ckpt)] + extra, {})[0]
    request = GenerationRequest(list(b"def add(a, b):\n    return a + b\n\ndef "), SamplingParams(max_tokens=24))
    async with build_engine(settings(trained_checkpoint, []).engine) as plain:
        want, _ = await collect_events(plain.generate(request))
    fast_settings = settings(trained_checkpoint, flags)
    assert fast_settings.engine.draft_model == shipped
    async with build_engine(fast_settings.engine) as fast:
        got, final = await collect_events(fast.generate(request))
    assert [t.token_id for t in got] == [t.token_id for t in want]
    assert final.draft_accepted > 0
    with pytest.raises(EngineSpecError, match="distilled from checkpoint"):
        build_engine(settings(tiny_checkpoint, flags).engine)
