"""Every shell command in README.md is checked against the program it names.

The fenced ```bash blocks are split into commands (continuation lines joined, comments dropped). Each
command is classified:

- our Python programs (`python neurons/...`, `python scripts/...`, `python -m inference|chain`,
  `scripts/localnet.sh`) are run in this process with their own command line: the `python -m chain`
  block runs for real on a fresh devnet, `python -m inference score` on the tiny checkpoint (generation
  on this CPU takes minutes, so `generate` is parsed only), and the others
  up to the end of their argument parsing (which fails with status 2 on an unknown flag or a bad
  value; what follows would start servers);
- `btcli` commands run with `--help` appended (click refuses an unknown flag even then);
- commands that cannot run here (GPU servers, containers, torchrun across hosts, the venv-creating
  test script) are listed with the reason; a command in none of these classes fails the test, so a new
  README command is checked or consciously skipped.

The configuration tables are compared with the option tables of the code.
"""
from __future__ import annotations

import argparse
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from neurons.base.settings import options_table
from neurons.gateway.settings import gateway_options
from neurons.miner_app import miner_options
from neurons.validator_app import validator_options

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

# Stand-ins for the README's placeholders.
PLACEHOLDERS = {"NETUID": "1", "VALIDATOR": "127.0.0.1", "$r": "0-2"}
SHELL_KEYWORDS = ("for", "do", "done", "while", "if", "then", "fi")

# First word(s) of commands that cannot run on this machine, and why.
NOT_RUNNABLE = {
    "vllm": "needs GPUs and the vLLM package",
    "python -m sglang.launch_server": "needs GPUs and SGLang",
    "torchrun": "multi-host NCCL ranks (the loopback path is tests/test_sharded.py)",
    "docker": "no container registry is reachable here",
    "podman": "no container registry is reachable here",
    "scripts/test.sh": "creates a venv; it is what runs this test",
    "pip": "installs packages",
}


def readme_commands(text: str = README) -> list[str]:
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(" ".join(shlex.quote(w) for w in words))
    return commands


def words_of(command: str) -> list[str]:
    words = [PLACEHOLDERS.get(w, w) for w in shlex.split(command)]
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value prefixes
        words.pop(0)
    out = []
    for w in words:
        if w in ("...", "&"):  # "the flags shown above"; run in the background
            continue
        out.append(w[1:-1] if w.startswith("[") and w.endswith("]") else w)
    return out


def skip_reason(words: list[str]) -> str | None:
    if words and words[0] in SHELL_KEYWORDS:
        return "shell control line (the commands inside it are checked)"
    line = " ".join(words)
    for prefix, reason in NOT_RUNNABLE.items():
        if line == prefix or line.startswith(prefix + " "):
            return reason
    return None


class _Parsed(Exception):
    """Raised right after a program's command line was parsed without error."""


def parse_only(program: list[str], args: list[str], monkeypatch) -> None:
    """Run the program (a script path, or ["-m", module]) in this process until its argument parser
    has accepted `args`; an unknown flag or a bad value exits with status 2 and fails the test."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **k):
        original(self, *a, **k)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [program[-1], *args])
    for name in list(os.environ):  # the README's command alone, not this shell's settings
        if name.startswith(("BT_", "K3_")):
            monkeypatch.delenv(name)
    with pytest.raises(_Parsed):
        if program[0] == "-m":
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(ROOT / program[0]), run_name="__main__")


def local_program(words: list[str]) -> tuple[list[str], list[str]] | None:
    """(program, args) of a command that runs one of this project's Python programs."""
    if words[:2] == ["python", "-m"] and words[2] in ("chain", "inference"):
        return ["-m", words[2]], words[3:]
    if words[0] == "python" and words[1].endswith(".py") and (ROOT / words[1]).exists():
        return [words[1]], words[2:]
    if words[0].endswith(".py") and (ROOT / words[0]).exists():  # an executable script
        return [words[0]], words[1:]
    if words[0] == "scripts/localnet.sh":  # the shell wrapper sets up .venv, then runs the Python program
        program = "localnet/testnet.py" if (ROOT / "localnet/testnet.py").exists() else "scripts/localnet.py"
        return [program], words[1:]
    return None


COMMANDS = readme_commands()


def test_the_readme_has_commands_to_check():
    assert len(COMMANDS) > 20
    assert any(c.startswith("btcli") for c in COMMANDS) and any("neurons/miner.py" in c for c in COMMANDS)


@pytest.mark.parametrize("command", [c for c in COMMANDS
                                     if not (words_of(c)[:3] in (["python", "-m", "chain"],
                                                                 ["python", "-m", "inference"])
                                             or c.startswith("btcli") or skip_reason(words_of(c)))])
def test_a_readme_command_parses(command, monkeypatch):
    words = words_of(command)
    target = local_program(words)
    assert target is not None, f"README command not checked by any rule; add one here: {command}"
    parse_only(*target, monkeypatch)


def test_the_readme_btcli_commands_exist_with_these_flags():
    btcli = shutil.which("btcli") or str(Path(sys.executable).parent / "btcli")
    commands = [words_of(c) for c in COMMANDS if c.startswith("btcli")]
    assert commands
    running = [(w, subprocess.Popen([btcli, *w[1:], "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)) for w in commands]
    for words, process in running:
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 0, f"{' '.join(words)}: {out[-800:]}"


def test_the_readme_chain_commands_run_on_a_fresh_devnet(tmp_path, monkeypatch, capsys):
    from chain.__main__ import main as chain_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    commands = [words_of(c) for c in COMMANDS if words_of(c)[:3] == ["python", "-m", "chain"]]
    assert len(commands) >= 5
    for words in commands:
        assert chain_main(words[3:]) == 0, f"{' '.join(words)}: {capsys.readouterr().err}"
    out = capsys.readouterr().out
    assert "subnet 1" in out and out.count("created coldkey, hotkey") >= 2


def test_the_readme_inference_commands_run_on_the_tiny_model(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    from inference.__main__ import main as inference_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "tiny").symlink_to(tiny_checkpoint)
    commands = [words_of(c) for c in COMMANDS if words_of(c)[:3] == ["python", "-m", "inference"]]
    on_tiny = [w for w in commands if "checkpoints/tiny" in w and w[3] == "score"]  # one forward pass each
    assert on_tiny
    for words in on_tiny:
        assert inference_main(words[3:]) in (0, None), " ".join(words)
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("command", [c for c in COMMANDS if words_of(c)[:3] == ["python", "-m", "inference"]
                                     and not ("checkpoints/tiny" in words_of(c) and words_of(c)[3] == "score")])
def test_a_readme_inference_command_on_a_real_model_parses(command, monkeypatch):
    parse_only(["-m", "inference"], words_of(command)[3:], monkeypatch)


@pytest.mark.parametrize("heading, options", [
    ("### Miner\n", lambda: miner_options()),
    ("### Validator (`neurons/validator.py run`)", lambda: [o for o in validator_options() if o.dest not in {g.dest for g in gateway_options()}]),
    ("### Organic gateway", lambda: gateway_options()),
])
def test_the_readme_configuration_tables_match_the_code(heading, options):
    section = README[README.index(heading):]
    table = "\n".join(line for line in section.split("\n\n", 2)[1].splitlines() if line.startswith("|"))
    assert table == options_table(options()), f"regenerate the {heading} table with neurons.base.settings.options_table"


def test_the_parse_check_catches_an_unknown_flag(monkeypatch):
    with pytest.raises(SystemExit) as exit_:
        parse_only(["neurons/miner.py"], ["--netuid", "1", "--no-such-flag"], monkeypatch)
    assert exit_.value.code == 2
    assert skip_reason(words_of("torchrun --nproc-per-node 8 -m x")) and not skip_reason(["python", "x.py"])
