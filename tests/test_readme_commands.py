"""Every shell command in README.md and docs/*.md is checked against the program it names.

The fenced ```bash blocks of each document are split into commands (continuation lines joined, comments
dropped). Each command is classified:

- our programs are run in this process with their own command line: the console scripts of pyproject.toml
  (`k3-miner`, `k3-plan`, ...), `python -m <one of our modules>`, `python <our script>.py` and
  `scripts/localnet.sh` (the `k3-localnet` program behind it). A document's `python -m chain` commands run for
  real on a fresh devnet, `python -m inference score` on the tiny checkpoint (generation on this CPU takes
  minutes, so `generate` is parsed only), and the others up to the end of their argument parsing (which fails
  with status 2 on an unknown flag or a bad value; what follows would start servers or benchmarks);
- `btcli` commands are looked up in btcli's own command tree (built once): each must name a command and use only
  flags that command declares;
- commands that cannot run here (GPU servers, containers, torchrun across hosts, the venv-creating test script)
  are listed with the reason, and our few programs that take no arguments at all (parsing them would be running
  them) are listed in WITHOUT_ARGUMENTS; a command in none of these classes fails the test, so a new documented command is
  checked or consciously skipped. Commands meant as examples only belong in plain ``` blocks.

The configuration tables of docs/configuration.md are compared with the option tables of the code;
`python tests/test_readme_commands.py --write-config` rewrites them from the code.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script (--write-config)
    sys.path.insert(0, str(ROOT))

from neurons.base.settings import options_table  # noqa: E402
from neurons.gateway.settings import gateway_options  # noqa: E402
from neurons.miner_app import miner_options  # noqa: E402
from neurons.swarm.settings import route_miner_options, stage_miner_options  # noqa: E402
from neurons.validator_app.settings import validator_options  # noqa: E402

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIGURATION = ROOT / "docs" / "configuration.md"
CONSOLE_SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
OUR_PACKAGES = ("inference", "protocol", "scoring", "neurons", "chain", "benchmarks", "localnet", "scripts")

# Stand-ins for the documents' placeholders.
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
    "scripts/setup_venv.sh": "creates a venv; scripts/test.sh runs it",
    "python -m pytest": "runs tests; the suite runs them",
    "pip": "installs packages",
}

# Our programs that take no arguments at all: parsing would be running them (minutes of benchmark), so the check is
# that the module exists and the command gives it no flags.
WITHOUT_ARGUMENTS = {
    "benchmarks.hostile": "starts a miner on a devnet and attacks it",
}


def shell_commands(text: str) -> list[str]:
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
    """Run the program (["entry", "module:function"], ["-m", module] or [script path]) in this process until its
    argument parser has accepted `args`; an unknown flag or a bad value exits with status 2 and fails the test."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **k):
        original(self, *a, **k)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [program[-1], *args])
    for name in list(os.environ):  # the document's command alone, not this shell's settings
        if name.startswith(("BT_", "K3_")):
            monkeypatch.delenv(name)
    with pytest.raises(_Parsed):
        if program[0] == "entry":
            module, function = program[1].split(":")
            getattr(importlib.import_module(module), function)(list(args))
        elif program[0] == "-m":
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(ROOT / program[0]), run_name="__main__")


def ours(module: str) -> bool:
    if module.split(".")[0] not in OUR_PACKAGES:
        return False
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def program_source(program: list[str]) -> str:
    """The source of a `-m` module (a package's __main__) or a script; "" for a console script's entry point."""
    if program[0] == "-m":
        spec = importlib.util.find_spec(program[1])
        origin = Path(spec.origin)
        if spec.submodule_search_locations:  # a package: python -m runs its __main__
            origin = origin.parent / "__main__.py"
        return origin.read_text()
    if program[0] == "entry":
        return ""
    return (ROOT / program[0]).read_text()


def reads_arguments(program: list[str]) -> bool:
    """Whether the program looks at its command line (console scripts' entry points all do)."""
    source = program_source(program)
    return program[0] == "entry" or any(word in source for word in ("argv", "argparse", "parse_args"))


def local_program(words: list[str]) -> tuple[list[str], list[str]] | None:
    """(program, args) of a command that runs one of this project's programs."""
    if words[0] in CONSOLE_SCRIPTS:
        return ["entry", CONSOLE_SCRIPTS[words[0]]], words[1:]
    if words[0] == "scripts/localnet.sh":  # the shell wrapper sets up .venv, then runs k3-localnet's program
        return ["entry", CONSOLE_SCRIPTS["k3-localnet"]], words[1:]
    if words[0] == "scripts/gpu_check.sh":  # the shell wrapper picks the interpreter, then runs the module
        return ["-m", "benchmarks.gpu_check"], words[1:]
    if words[:2] == ["python", "-m"] and len(words) > 2 and ours(words[2]):
        return ["-m", words[2]], words[3:]
    if words[0] == "python" and len(words) > 1 and words[1].endswith(".py") and (ROOT / words[1]).exists():
        return [words[1]], words[2:]
    if words[0].endswith(".py") and (ROOT / words[0]).exists():  # an executable script
        return [words[0]], words[1:]
    return None


COMMANDS = [(doc.relative_to(ROOT).as_posix(), c) for doc in DOCUMENTS for c in shell_commands(doc.read_text())]


def _is(words: list[str], *prefix: str) -> bool:
    return words[:len(prefix)] == list(prefix)


def _runs_for_real(words: list[str]) -> bool:
    return _is(words, "python", "-m", "chain") or (_is(words, "python", "-m", "inference", "score")
                                                    and "checkpoints/tiny" in words)


def test_the_documents_have_commands_to_check():
    assert len(COMMANDS) > 60
    documents = {doc for doc, _ in COMMANDS}
    assert {"README.md", "docs/mining.md", "docs/validating.md", "docs/swarm.md", "docs/localnet.md",
            "docs/benchmarks.md"} <= documents
    assert any(c.startswith("btcli") for _, c in COMMANDS) and any(c.startswith("k3-miner") for _, c in COMMANDS)


@pytest.mark.parametrize("document, command", [
    (doc, c) for doc, c in COMMANDS
    if not (_runs_for_real(words_of(c)) or c.startswith("btcli") or skip_reason(words_of(c)))])
def test_a_documented_command_parses(document, command, monkeypatch):
    words = words_of(command)
    target = local_program(words)
    assert target is not None, f"{document}: command not checked by any rule; add one here: {command}"
    program, args = target
    if program[0] == "-m" and program[1] in WITHOUT_ARGUMENTS:
        assert not args, f"{document}: {program[1]} takes no arguments ({WITHOUT_ARGUMENTS[program[1]]}): {command}"
        assert not reads_arguments(program), f"{program[1]} reads its command line now: drop it from WITHOUT_ARGUMENTS"
        return
    assert reads_arguments(program), (f"{document}: {command}: the program reads no arguments, so parsing it would run "
                                      "it; list it in WITHOUT_ARGUMENTS with what it does")
    parse_only(program, args, monkeypatch)


# btcli's own command tree (the typer app its console script runs), built once in one process: each documented
# command must name a command (not a group) and use only flags that command declares. (Asking btcli for each
# command's --help instead renders dozens of rich help pages: minutes on the 2-core machine.)
BTCLI_CHECK = """
import json, sys
import typer
from bittensor.cli.main import app
root = typer.main.get_command(app)
answers = {}
for args in json.loads(sys.stdin.read()):
    command, rest = root, list(args)
    while rest and hasattr(command, "commands") and rest[0] in command.commands:  # a group (typer's own click)
        command = command.commands[rest.pop(0)]
    if hasattr(command, "commands"):
        answers[" ".join(args)] = f"no command {rest[:1]} in this group"
        continue
    flags = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    unknown = [w for w in rest if w.startswith("-") and w.split("=")[0] not in flags]
    answers[" ".join(args)] = f"unknown flags {unknown}" if unknown else ""
print(json.dumps(answers))
"""
CHECK_THE_CHECK = (("subnets", "register", "--netuid", "1", "--no-such-flag"), ("subnets", "no-such-command"))


def btcli_refusals(commands) -> dict[str, str]:
    """{command: why btcli would refuse it} for each of `commands` (btcli's words after `btcli`)."""
    done = subprocess.run([sys.executable, "-c", BTCLI_CHECK], input=json.dumps([list(c) for c in commands]),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return {command: why for command, why in json.loads(done.stdout.strip().splitlines()[-1]).items() if why}


def test_the_documented_btcli_commands_exist_with_these_flags():
    commands = sorted({tuple(words_of(c)[1:]) for _, c in COMMANDS if c.startswith("btcli")})
    assert len(commands) > 10
    refused = btcli_refusals([*commands, *CHECK_THE_CHECK])
    assert set(refused) >= {" ".join(c) for c in CHECK_THE_CHECK}  # the check itself can refuse
    refused = {c: why for c, why in refused.items() if tuple(c.split()) not in CHECK_THE_CHECK}
    assert not refused, "\n".join(f"btcli {command}: {why}" for command, why in refused.items())


@pytest.mark.parametrize("document", sorted({doc for doc, c in COMMANDS if _is(words_of(c), "python", "-m", "chain")}))
def test_the_documented_chain_commands_run_on_a_fresh_devnet(document, tmp_path, monkeypatch, capsys):
    from chain.__main__ import main as chain_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    commands = [words_of(c) for doc, c in COMMANDS if doc == document and _is(words_of(c), "python", "-m", "chain")]
    assert len(commands) >= 5
    for words in commands:
        assert chain_main(words[3:]) == 0, f"{' '.join(words)}: {capsys.readouterr().err}"
    out = capsys.readouterr().out
    assert "subnet 1" in out and out.count("created coldkey, hotkey") >= 2


def test_the_documented_inference_commands_run_on_the_tiny_model(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    from inference.__main__ import main as inference_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "tiny").symlink_to(tiny_checkpoint)
    on_tiny = [words_of(c) for _, c in COMMANDS if _runs_for_real(words_of(c)) and _is(words_of(c), "python", "-m",
                                                                                         "inference")]
    assert on_tiny
    for words in on_tiny:
        assert inference_main(words[3:]) in (0, None), " ".join(words)
    assert capsys.readouterr().out.strip()


# ---------------------------------------------------------------- docs/configuration.md
def _validator_only():
    gateway = {g.dest for g in gateway_options()}
    return [o for o in validator_options() if o.dest not in gateway]


CONFIG_TABLES = {
    "## Miner": miner_options,
    "## Validator": _validator_only,
    "## Organic gateway": gateway_options,
    "## Stage miner": stage_miner_options,
    "## Route miner": route_miner_options,
}


def table_span(text: str, heading: str) -> tuple[int, int]:
    """(start, end) offsets of the first table after `heading` (a line of its own): its run of `|` lines."""
    at = re.search(rf"^{re.escape(heading)}[ \t]*$", text, flags=re.M)
    assert at, f"docs/configuration.md has no heading {heading!r}"
    first = re.compile(r"^\|", flags=re.M).search(text, at.end())
    assert first, f"no table under {heading!r}"
    end = first.start()
    while text.startswith("|", end):
        newline = text.find("\n", end)
        end = len(text) if newline < 0 else newline + 1
    return first.start(), end


def configuration_table(text: str, heading: str) -> str:
    start, end = table_span(text, heading)
    return text[start:end].rstrip("\n")


@pytest.mark.parametrize("heading", list(CONFIG_TABLES))
def test_the_configuration_tables_match_the_code(heading):
    table = configuration_table(CONFIGURATION.read_text(), heading)
    assert table == options_table(CONFIG_TABLES[heading]()), (
        f"docs/configuration.md {heading!r} differs from the code: python tests/test_readme_commands.py --write-config")


def write_configuration() -> None:
    text = CONFIGURATION.read_text()
    for heading, options in CONFIG_TABLES.items():
        start, end = table_span(text, heading)
        text = text[:start] + options_table(options()) + "\n" + text[end:]
    CONFIGURATION.write_text(text)


# ---------------------------------------------------------------- the checks themselves
def test_the_parse_check_catches_an_unknown_flag(monkeypatch):
    with pytest.raises(SystemExit) as exit_:
        parse_only(["entry", CONSOLE_SCRIPTS["k3-miner"]], ["--netuid", "1", "--no-such-flag"], monkeypatch)
    assert exit_.value.code == 2
    assert skip_reason(words_of("torchrun --nproc-per-node 8 -m x")) and not skip_reason(["python", "x.py"])


@pytest.mark.parametrize("command, checked", [
    ("k3-validator status --db x.sqlite", True),
    ("scripts/localnet.sh --swarm 3", True),
    ("python -m chain metagraph --db x --netuid 1", True),
    ("python -m no_such_package.tool --flag", False),
    ("curl http://127.0.0.1:8091/health", False),
])
def test_an_unknown_program_is_not_taken_as_checked(command, checked):
    assert (local_program(words_of(command)) is not None) == checked


def test_a_program_without_arguments_is_not_run():
    assert reads_arguments(["-m", "benchmarks.miner"]) and reads_arguments(["entry", CONSOLE_SCRIPTS["k3-bench"]])
    assert not reads_arguments(["-m", "benchmarks.hostile"])


def test_the_table_check_catches_a_changed_row():
    table = options_table(miner_options())
    text = f"## Miner\n\nintro\n\n{table}\n\n## Validator\n\n| x |\n"
    assert configuration_table(text, "## Miner") == table
    changed = text.replace("| 9091 |", "| 9095 |")
    assert changed != text and configuration_table(changed, "## Miner") != table


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-config"]:
        write_configuration()
        print(f"rewrote the option tables of {CONFIGURATION.relative_to(ROOT)}")
    else:
        sys.exit("usage: python tests/test_readme_commands.py --write-config")
