"""The import rules that keep data flowing one way (README, architecture), checked on every module's imports.

- inference/ imports nothing from protocol/, neurons/, chain/ or scoring/: it is an engine to embed anywhere;
- inference/sharding/ does not import inference/serving/ (serving wraps the sharded model, not the reverse);
- inference/model/ does not import the other inference/ packages (everything else builds on the model);
- inference/planning/ imports neither the serving engine nor the sharded runtime (they use plans);
- chain/ imports nothing of ours outside chain/ (it knows only the SDK, numpy and SQLite);
- protocol/ imports nothing from inference/, neurons/, chain/ or scoring/.

Every import counts, also those inside functions and under TYPE_CHECKING: a lazy import is still a seam.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("inference", "protocol", "neurons", "chain", "scoring", "scripts", "tests")

# (where the importing module lives, the modules it must not import, why)
RULES = [
    ("inference", ("protocol", "neurons", "chain", "scoring"), "inference/ knows nothing of the wire, chain or neurons"),
    ("inference.sharding", ("inference.serving",), "the sharded runtime sits below the serving engine"),
    ("inference.model", ("inference.serving", "inference.sharding", "inference.planning"),
     "the model is the bottom layer of inference/"),
    ("inference.planning", ("inference.serving", "inference.sharding"), "plans are made before anything runs"),
    ("chain", ("inference", "protocol", "neurons", "scoring", "scripts", "tests"), "chain/ is a leaf"),
    ("protocol", ("inference", "neurons", "chain", "scoring"), "protocol/ knows schemas, signing and HTTP only"),
]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module))
            # `from inference import serving` imports inference.serving
            out.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
    return out


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(files: list[Path], root: Path = ROOT) -> list[str]:
    found = []
    for path in files:
        importer = module_name(path, root)
        for line, imported in imported_modules(path, root):
            for where, banned, why in RULES:
                if not within(importer, where):
                    continue
                for b in banned:
                    if within(imported, b) and not within(imported, where):
                        found.append(f"{path.relative_to(root)}:{line} imports {imported} ({why})")
    return sorted(set(found))


def our_python_files() -> list[Path]:
    return sorted(p for top in OURS if (ROOT / top).is_dir() for p in (ROOT / top).rglob("*.py"))


def test_every_module_keeps_the_import_rules():
    files = our_python_files()
    assert len(files) > 50, "the layering check found too few modules to be looking in the right place"
    problems = violations(files)
    assert not problems, "import rules broken:\n" + "\n".join(problems)


@pytest.mark.parametrize("where, source, broken", [
    ("inference/model/probe.py", "from inference.serving.engine import LocalEngine\n", True),
    ("inference/sharding/probe.py", "def f():\n    from inference import serving\n", True),
    ("inference/sharding/probe.py", "from ..serving import builders\n", True),
    ("inference/serving/probe.py", "from inference.sharding import ShardedModel\n", False),
    ("chain/probe.py", "import numpy\nfrom chain.interface import Chain\n", False),
    ("chain/probe.py", "from protocol.schemas import Capabilities\n", True),
    ("protocol/probe.py", "import inference.model\n", True),
    ("scoring/probe.py", "from protocol.client import MinerClient\nfrom inference.serving import Engine\n", False),
])
def test_the_check_catches_a_broken_rule(tmp_path, where, source, broken):
    """The checker itself: each rule flags a probe module that breaks it, and leaves allowed imports alone."""
    probe = tmp_path / where
    probe.parent.mkdir(parents=True)
    probe.write_text(source)
    found = violations([probe], root=tmp_path)
    assert bool(found) == broken, found


@pytest.mark.parametrize("module", ["inference.speculative.speculation", "inference.speculative.drafters",
                                    "inference.serving.engine"])
def test_each_module_imports_first_in_a_fresh_interpreter(module):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
