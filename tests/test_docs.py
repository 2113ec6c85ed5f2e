"""The project's documents hold together.

- every `docs/...` path cited in the code (comments, docstrings, help texts, configs) and in README.md and docs/
  exists;
- every relative markdown link in README.md and docs/ resolves: the file, and the #anchor where one is given;
- README.md stays a front door (at most 350 lines);
- no line of README.md or docs/ reads as a work log (branches, work sessions, attempts, temporary paths, issue
  numbers, helpers, "what was run here");
- the console-script table of docs/install.md is pyproject.toml's.

Each checker is a function of its inputs, and a parametrized test shows it flags a bad input and passes a good
one, so that none of these tests can pass by looking at nothing.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("inference", "protocol", "chain", "scoring", "neurons", "scripts", "tests", "benchmarks", "localnet",
             "deploy", "evals")
CODE_SUFFIXES = (".py", ".sh", ".yaml", ".yml", ".toml")
CODE_FILES_AT_ROOT = ("Dockerfile", "pyproject.toml", "compose.yaml")
THIS_FILE = Path(__file__).resolve()  # it holds bad examples on purpose
README_MAX_LINES = 350

# docs/<name>.<ext>, not part of a longer path or URL ("k3/docs/x.md", "readthedocs/...")
DOC_PATH = re.compile(r"(?<![\w./-])docs/(?:[\w-]+/)*[\w-]+\.[A-Za-z]\w*")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")

WORK_LOG = {
    "a branch": r"\bbranch(es)?\b",
    "a work session": r"\b(this|that earlier|previous|earlier|helper|agent|coding|work|chat) session\b",
    "an attempt": r"\battempts?\s*#?\d|\b(this|previous|earlier|an earlier|last|next|another) attempt\b",
    "a temporary path": r"/tmp/",
    "an issue number": r"\bissues?\s*#?\d+",
    "a helper": r"\bhelpers?\b",
    "what was run here": r"\b(?:was|were|been) (?:run|measured|tried) here\b|\bnot run here\b|\bran here\b",
    "merge notes": r"\bmerg(?:e|ed|ing) (?:notes|main)\b|docs-snippets",
}


def code_files(root: Path = ROOT) -> list[Path]:
    files = [root / name for name in CODE_FILES_AT_ROOT if (root / name).is_file()]
    for top in CODE_DIRS:
        if (root / top).is_dir():
            files += [p for p in (root / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                      and (p.suffix in CODE_SUFFIXES or p.name == "Dockerfile")]
    return sorted(p for p in files if p.resolve() != THIS_FILE)


def markdown_files(root: Path = ROOT) -> list[Path]:
    docs = sorted((root / "docs").rglob("*.md")) if (root / "docs").is_dir() else []
    return [root / "README.md", *docs] if (root / "README.md").is_file() else docs


def without_fences(text: str) -> str:
    """The text with fenced code blocks blanked, line numbers kept (a `# comment` there is no heading)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def without_code(text: str) -> str:
    """The text with fenced blocks and inline code blanked (line numbers kept), where links are not links."""
    return INLINE_CODE.sub(lambda m: " " * len(m.group(0)), without_fences(text))


def missing_doc_paths(files: list[Path], root: Path = ROOT) -> list[str]:
    """`file:line: docs/x` for every cited docs/ path that does not exist under root."""
    found = []
    for path in files:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for cited in DOC_PATH.findall(line):
                if not (root / cited).exists():
                    found.append(f"{path.relative_to(root)}:{number}: {cited}")
    return found


def github_anchor(title: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", title)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for match in HEADING.finditer(without_fences(text)):
        anchor = github_anchor(match.group(2))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        out.add(anchor if count == 0 else f"{anchor}-{count}")
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Every relative link of a markdown file whose file or anchor does not exist."""
    text = path.read_text()
    found = []
    for number, line in enumerate(without_code(text).splitlines(), 1):
        for target in LINK.findall(line):
            if SCHEME.match(target):
                continue  # http(s), mailto: not ours to check here
            file_part, _, anchor = target.partition("#")
            where = (path.parent / file_part).resolve() if file_part else path
            problem = None
            if not where.exists():
                problem = "no such file"
            elif root.resolve() not in where.parents and where != root.resolve():
                problem = "points outside the repository"
            elif anchor and where.suffix == ".md" and anchor not in anchors(where.read_text()):
                problem = f"no heading with the anchor #{anchor} in {where.relative_to(root.resolve())}"
            if problem:
                found.append(f"{path.relative_to(root)}:{number}: ({target}) {problem}")
    return found


def work_log_lines(path_name: str, text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in WORK_LOG.items():
            if re.search(pattern, line, flags=re.I):
                found.append(f"{path_name}:{number}: {what}: {line.strip()[:120]}")
    return found


def test_the_documents_are_there():
    names = {p.name for p in markdown_files()}
    for topic in ("mining", "validating", "swarm", "verification", "localnet", "benchmarks", "configuration",
                  "architecture", "security", "observability", "model", "engine", "subnet", "yuma"):
        assert f"{topic}.md" in names, f"docs/{topic}.md is missing"
    assert not (ROOT / "docs-snippets").exists(), "docs-snippets/ is gone: its content lives in docs/"


def test_every_cited_doc_path_exists():
    files = code_files() + markdown_files()
    assert len(files) > 100, "too few files to be looking in the right place"
    cited = sum(len(DOC_PATH.findall(p.read_text(errors="replace"))) for p in files)
    assert cited > 20, "the code cites docs/ far more often than this: the pattern finds nothing"
    missing = missing_doc_paths(files)
    assert not missing, "cited documents that do not exist:\n" + "\n".join(missing)


def test_every_relative_link_resolves():
    problems = [problem for path in markdown_files() for problem in broken_links(path)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def readme_too_long(text: str) -> str | None:
    lines = len(text.splitlines())
    return f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/" \
        if lines > README_MAX_LINES else None


def test_the_readme_is_a_front_door():
    problem = readme_too_long((ROOT / "README.md").read_text())
    assert problem is None, problem


def test_no_document_reads_as_a_work_log():
    found = [hit for path in markdown_files() for hit in work_log_lines(str(path.relative_to(ROOT)), path.read_text())]
    assert not found, ("say what the software does and what was measured (command, machine, date), not how the work "
                       "went:\n" + "\n".join(found))


def test_the_console_script_table_is_pyprojects():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    table = dict(re.findall(r"^\| `(k3[\w-]*)` \|.*\| `([\w.]+:\w+)` \|$", (ROOT / "docs/install.md").read_text(),
                            flags=re.M))
    assert table == scripts, "docs/install.md's console scripts differ from pyproject.toml's [project.scripts]"


# ---------------------------------------------------------------- the checkers themselves
@pytest.mark.parametrize("source, broken", [
    ('"""See docs/missing.md section 2."""\n', True),
    ("# the table of docs/present.md\n", False),
    ("x = 'https://k3.example/docs/missing.md'  # a URL, not ours\n", False),
    ("see readthedocs/missing.md\n", False),
])
def test_the_doc_path_check_flags_a_missing_document(tmp_path, source, broken):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "present.md").write_text("# present\n")
    (tmp_path / "inference").mkdir()
    (tmp_path / "inference" / "probe.py").write_text(source)
    found = missing_doc_paths(code_files(tmp_path), root=tmp_path)
    assert bool(found) == broken, found


@pytest.mark.parametrize("link, broken", [
    ("[a](other.md)", False),
    ("[a](other.md#the-real-heading)", False),
    ("[a](other.md#2-numbered-section)", False),
    ("[a](#local-heading)", False),
    ("[a](https://example.org/missing.md)", False),
    ("`[a](missing.md)` is code, not a link", False),
    ("[a](missing.md)", True),
    ("[a](other.md#no-such-heading)", True),
    ("[a](#no-such-local-heading)", True),
    ("[a](../../outside.md)", True),
])
def test_the_link_check_flags_a_broken_link(tmp_path, link, broken):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "other.md").write_text("# Other\n\n## The real heading\n\n## 2. Numbered section\n\n```\n# not a heading\n```\n")
    (tmp_path / "outside.md").write_text("")
    page = docs / "page.md"
    page.write_text(f"# Page\n\n## Local heading\n\nSee {link}.\n")
    found = broken_links(page, root=tmp_path)
    assert bool(found) == broken, found


@pytest.mark.parametrize("title, anchor", [
    ("The claim: Kimi K3 on 80 x RTX 5090", "the-claim-kimi-k3-on-80-x-rtx-5090"),
    ("Beside `vllm bench serve`", "beside-vllm-bench-serve"),
    ("10. Measured thresholds and cheaters", "10-measured-thresholds-and-cheaters"),
    ("Stage-round settings (`--stage-*`)", "stage-round-settings---stage-"),
])
def test_anchors_are_githubs(title, anchor):
    assert github_anchor(title) == anchor


@pytest.mark.parametrize("line, logged", [
    ("The bench script was not run to completion on this branch.", True),
    ("Numbers from the earlier session, kept for the record.", True),
    ("Attempt 3 gave 4.9x.", True),
    ("python -m benchmarks.swarm --out /tmp/k3tiny", True),
    ("Verifying stages (issue 19, the core)", True),
    ("Endpoint benchmark (issue #14)", True),
    ("measured while another helper ran its jobs", True),
    ("What was run here, and what was not", True),
    ("The full output is in docs-snippets/envelope6-bench.txt.", True),
    ("Per session a stage keeps its layers' KDA state; a fresh session is opened on the new route.", False),
    ("After each attempt through the route its recorded steps are settled.", False),
    ("`k3_gateway_miner_attempts_total{result}`", False),
    ("Measured on the 2-core CPU, 2026-12-04, load average 2-3.", False),
])
def test_the_work_log_check(line, logged):
    assert bool(work_log_lines("probe.md", line)) == logged


@pytest.mark.parametrize("lines, too_long", [(README_MAX_LINES, False), (README_MAX_LINES + 1, True)])
def test_the_readme_length_check(lines, too_long):
    assert bool(readme_too_long("a line\n" * lines)) == too_long
