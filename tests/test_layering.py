"""The import rules that keep data flowing one way (docs/architecture.md), checked on every module's imports.

- inference/ imports nothing from protocol/, neurons/, chain/, scoring/, benchmarks/ or localnet/: it is an engine
  to embed anywhere;
- inside inference/: the model is the bottom floor; decoding (the sampler, speculative decoding) sits on the model
  only; the sharded runtime does not import serving; planning imports neither serving nor the sharded runtime;
  in serving, the engine interface imports no engine, and the step scheduler imports no thread, event loop, torch
  or model (the engine runs its plans);
- chain/ imports nothing of ours outside chain/ (it knows only the SDK, numpy and SQLite);
- protocol/ imports nothing from inference/, neurons/, chain/ or scoring/;
- scoring/ and neurons/ import neither benchmarks/ nor localnet/ (tooling sits on top; nothing runs it);
- inside neurons/: base/ (settings, logging, rate limits, the engine<->wire adapter) imports no other room of
  neurons/; the apps (miner_app, gateway, swarm, validator_app) never import a process (neurons/miner.py,
  validator.py, stage_miner.py, route_miner.py); the swarm library and the gateway import no validator_app; the
  miner app and the gateway import no other app;
- no two modules import each other, directly or around a circle (function-level imports count: a lazy import is
  still a seam), and no two public classes share a name.

Every import counts, also those inside functions and under TYPE_CHECKING.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("inference", "protocol", "neurons", "chain", "scoring", "benchmarks", "localnet", "scripts", "tests")
CODE = ("inference", "protocol", "neurons", "chain", "scoring", "benchmarks", "localnet")  # what the rules cover
PROCESSES = ("neurons.miner", "neurons.validator", "neurons.stage_miner", "neurons.route_miner")
APPS = ("neurons.miner_app", "neurons.gateway", "neurons.swarm", "neurons.validator_app")
TOOLING = ("benchmarks", "localnet")

# (where the importing module lives, the modules it must not import, why)
RULES = [
    ("inference", ("protocol", "neurons", "chain", "scoring", *TOOLING), "inference/ knows nothing of the wire, chain or neurons"),
    ("inference.sharding", ("inference.serving",), "the sharded runtime sits below the serving engine"),
    ("inference.model", ("inference.serving", "inference.sharding", "inference.planning", "inference.decoding",
                         "inference.swarm"), "the model is the bottom layer of inference/"),
    ("inference.decoding", ("inference.serving", "inference.sharding", "inference.planning", "inference.swarm"),
     "decoding sits on the model only, below the engine and the swarm stage"),
    ("inference.planning", ("inference.serving", "inference.sharding"), "plans are made before anything runs"),
    ("inference.serving.scheduler", ("asyncio", "threading", "concurrent", "torch", "inference.model",
                                     "inference.sharding", "inference.serving.local_engine"),
     "the step scheduler is policy only: plain numbers and sequences in, plans out (no threads, no model)"),
    ("inference.serving.engine", ("inference.serving.local_engine", "inference.serving.scheduler",
                                  "inference.serving.remote"), "the engine interface knows no engine"),
    ("chain", ("inference", "protocol", "neurons", "scoring", "scripts", "tests", *TOOLING), "chain/ is a leaf"),
    ("protocol", ("inference", "neurons", "chain", "scoring", *TOOLING), "protocol/ knows schemas, signing and HTTP only"),
    ("scoring", ("neurons", *TOOLING), "scoring judges; the neurons and the tooling use it"),
    ("neurons", TOOLING, "benchmarks and the local testnet run the neurons, never the reverse"),
    ("neurons.base", ("neurons.miner_app", "neurons.gateway", "neurons.swarm", "neurons.validator_app", *PROCESSES),
     "the neurons' shared plumbing imports no app or process"),
    *[(app, PROCESSES, "an app never imports a process") for app in APPS],
    ("neurons.swarm", ("neurons.validator_app", "neurons.gateway"), "the swarm library serves the validator, not the reverse"),
    ("neurons.gateway", ("neurons.validator_app", "neurons.swarm", "neurons.miner_app"),
     "the gateway is composed by the validator, it composes nothing"),
    ("neurons.miner_app", ("neurons.validator_app", "neurons.gateway", "neurons.swarm"), "the miner app stands alone"),
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


def module_edges(files: list[Path], root: Path = ROOT) -> dict[str, dict[str, int]]:
    """importer -> {imported module: first line} over our modules, every import counted. `from pkg import mod`
    counts as an import of pkg.mod alone when that is a module (the package itself is its parent, loaded by any
    import of its children, which is no dependency of the child's own)."""
    modules = {module_name(p, root): p for p in files}
    edges: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        seen = edges.setdefault(name, {})
        by_line: dict[int, list[str]] = {}
        for line, imported in imported_modules(path, root):
            by_line.setdefault(line, []).append(imported)
        for line, names in by_line.items():
            exact = [n for n in names if n in modules]
            if any(n != names[0] for n in exact):  # `from pkg import mod`: the module, not its package
                exact = [n for n in exact if n != names[0]]
            for target in exact or [n.rsplit(".", 1)[0] for n in names if n.rsplit(".", 1)[0] in modules][:1]:
                if target != name:
                    seen.setdefault(target, line)
    return edges


def import_circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return circles


def code_files() -> list[Path]:
    return sorted(p for top in CODE for p in (ROOT / top).rglob("*.py"))


def test_no_module_imports_itself_around_a_circle():
    edges = module_edges(code_files())
    circles = import_circles(edges)
    described = ["; ".join(f"{a} -> {b} (line {edges[a][b]})" for a in group for b in group if b in edges[a])
                 for group in circles]
    assert not circles, "import circles:\n" + "\n".join(described)


def test_the_circle_check_sees_a_lazy_import(tmp_path):
    (tmp_path / "scoring").mkdir()
    (tmp_path / "scoring" / "__init__.py").write_text("")
    (tmp_path / "scoring" / "a.py").write_text("from scoring.b import x\n")
    (tmp_path / "scoring" / "b.py").write_text("def x():\n    from scoring import a\n")
    (tmp_path / "scoring" / "c.py").write_text("from scoring import a\n")
    files = sorted((tmp_path / "scoring").glob("*.py"))
    assert import_circles(module_edges(files, tmp_path)) == [["scoring.a", "scoring.b"]]


def public_classes(files: list[Path], root: Path = ROOT) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found.setdefault(node.name, []).append(module_name(path, root))
    return found


def test_no_two_public_classes_share_a_name():
    twice = {name: where for name, where in public_classes(code_files()).items() if len(where) > 1}
    assert not twice, f"one name, two classes: {twice}"


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
    ("inference/serving/scheduler.py", "import threading\n", True),
    ("inference/serving/scheduler.py", "from inference.serving.engine import EngineSettings\n", False),
    ("inference/serving/engine.py", "from inference.serving.local_engine import LocalEngine\n", True),
])
def test_the_check_catches_a_broken_rule(tmp_path, where, source, broken):
    """The checker itself: each rule flags a probe module that breaks it, and leaves allowed imports alone."""
    probe = tmp_path / where
    probe.parent.mkdir(parents=True)
    probe.write_text(source)
    found = violations([probe], root=tmp_path)
    assert bool(found) == broken, found


@pytest.mark.parametrize("module", ["inference.decoding.speculation", "inference.decoding.drafters",
                                    "inference.serving.engine", "inference.serving.scheduler",
                                    "inference.serving.local_engine"])
def test_each_module_imports_first_in_a_fresh_interpreter(module):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
