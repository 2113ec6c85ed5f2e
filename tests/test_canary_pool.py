"""`k3-validator canaries` writes the canary pool a CPU validator reads (--canary-pool): computed on the engine it is
given, each canary the model's own greedy continuation, named for the checkpoint's fingerprint."""
from conftest import reference_greedy

from neurons.validator import main as validator_main
from scoring.canaries import CanaryPool

PROFILE = ["--scoring-profile", "local_testnet", "--scoring-overrides", '{"canary_tokens": 6, "chat_prompt_tokens": [16, 48]}']


def test_the_pool_holds_the_models_greedy_continuations(tiny_checkpoint, tiny_reference, tmp_path, capsys):
    out = tmp_path / "pools" / "canaries.json"
    assert validator_main(["canaries", "--checkpoint", str(tiny_checkpoint), "--max-context", "4096", "--count", "5",
                           "--seed", "1", "--out", str(out), *PROFILE]) == 0
    printed = capsys.readouterr().out
    assert "canaries 5/5" in printed and "wrote 5 canaries of 6 tokens for model" in printed
    model, _, fingerprint = tiny_reference
    pool = CanaryPool.from_file(out)
    assert len(pool) == 5 and pool.model_fingerprint == fingerprint
    for canary in pool.canaries.values():
        tokens, logprobs = reference_greedy(model, list(canary.prompt_ids), 6)
        assert list(canary.tokens) == tokens
        assert all(abs(a - b) < 1e-4 for a, b in zip(canary.logprobs, logprobs))


def test_bad_requests_say_what_to_change(tmp_path, capsys):
    assert validator_main(["canaries", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "c.json")]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err


def test_a_context_too_short_for_the_prompts_is_one_line(tiny_checkpoint, tmp_path, capsys):
    assert validator_main(["canaries", "--checkpoint", str(tiny_checkpoint), "--max-context", "64", "--count", "2",
                           "--out", str(tmp_path / "c.json"), *PROFILE]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot plan canary prompts" in err[0] and "--max-context" in err[0]
