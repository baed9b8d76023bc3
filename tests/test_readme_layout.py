"""The READMEs against the repository they describe.

- README.md's layout table has exactly one row per top-level package and module of `kvserve/`
  (a package added without a row fails here, naming the row to write), each a short cell;
- README.md, benchmarks/README.md and benchmarks/HISTORY.md link to nothing outside the
  repository (no http(s) addresses outside code; relative links resolve to files in it);
- benchmarks/README.md stays one current page (<= 300 lines, no "newest / before that" log);
  every `results/` file it cites exists, and every file in benchmarks/results/ is cited by it
  or by benchmarks/HISTORY.md.
"""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvserve"
README = ROOT / "README.md"
BENCH_README = ROOT / "benchmarks" / "README.md"
HISTORY = ROOT / "benchmarks" / "HISTORY.md"
RESULTS = ROOT / "benchmarks" / "results"

MAX_CELL_CHARS = 120
MAX_BENCH_README_LINES = 300


def top_level_entries() -> set[str]:
    """`kvserve/<pkg>/` for every directory holding Python code (namespace packages too), and
    `kvserve/<module>.py` for every top-level module except `__init__.py`."""
    entries = set()
    for path in PACKAGE.iterdir():
        if path.is_dir() and not path.name.startswith(("_", ".")):
            if any(path.rglob("*.py")):
                entries.add(f"kvserve/{path.name}/")
        elif path.suffix == ".py" and path.name != "__init__.py":
            entries.add(f"kvserve/{path.name}")
    return entries


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section (up to the next `## `)."""
    match = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def layout_rows() -> list[tuple[str, str]]:
    """(path, description) per row of README.md's layout table, header and rule skipped."""
    rows = []
    for line in section(README.read_text(), "Layout").splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("path", "---") or set(cells[0]) <= {"-", " ", ":"}:
            continue
        assert len(cells) == 2, f"layout row is not 'path | what it holds': {line!r}"
        rows.append((cells[0].strip("`"), cells[1]))
    return rows


def test_layout_table_has_one_row_per_package() -> None:
    rows = layout_rows()
    paths = [p for p, _ in rows]
    duplicates = sorted({p for p in paths if paths.count(p) > 1})
    assert not duplicates, f"README.md layout table lists these twice: {duplicates}"
    listed = {p for p in paths if p.startswith("kvserve/")}
    actual = top_level_entries()
    missing = sorted(actual - listed)
    assert not missing, (
        "README.md's layout table (## Layout) has no row for "
        + ", ".join(missing)
        + ": add one row each, '| `kvserve/<name>/` | what it holds (one short cell) |'")
    stale = sorted(listed - actual)
    assert not stale, f"README.md's layout table has rows for what does not exist: {stale}"
    for path in paths:                     # rows outside kvserve/ (benchmarks/, tests/)
        assert (ROOT / path).exists(), f"README.md's layout row {path!r} names no file or folder"


def test_layout_cells_are_short() -> None:
    for path, what in layout_rows():
        assert what, f"README.md layout row {path!r} says nothing"
        assert len(what) <= MAX_CELL_CHARS, (
            f"README.md layout row {path!r} is {len(what)} characters (at most "
            f"{MAX_CELL_CHARS}): one short cell; the detail belongs in a feature paragraph")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code (commands may name localhost)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def test_docs_link_only_inside_the_repository() -> None:
    for doc in (README, BENCH_README, HISTORY):
        prose = _prose(doc.read_text())
        urls = re.findall(r"\b(?:https?|ftp)://\S+", prose)
        assert not urls, f"{doc.relative_to(ROOT)} links outside the repository: {urls}"
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            path = (doc.parent / target.split("#")[0]).resolve()
            assert ROOT in path.parents or path == ROOT, (
                f"{doc.relative_to(ROOT)} links outside the repository: {target}")
            assert path.exists(), f"{doc.relative_to(ROOT)} links to a missing file: {target}"


def test_benchmarks_readme_is_one_current_page() -> None:
    text = BENCH_README.read_text()
    lines = text.count("\n")
    assert lines <= MAX_BENCH_README_LINES, (
        f"benchmarks/README.md has {lines} lines (at most {MAX_BENCH_README_LINES}): keep one "
        "current table per comparison there and move older runs to benchmarks/HISTORY.md")
    markers = re.findall(r"\*\*(?:newest|before that|earlier)\b[^*]*\*\*", text, re.I)
    assert not markers, f"benchmarks/README.md reads as a log again: {markers}"


def _expand_braces(token: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", token)
    if not match:
        return [token]
    return [expanded for alt in match.group(1).split(",")
            for expanded in _expand_braces(token[:match.start()] + alt + token[match.end():])]


_FILE_TOKEN = re.compile(r"[\w./*{},-]+")
_RESULT_EXT = re.compile(r"\.(?:json|jsonl|txt|png|log)$")


def cited_patterns(text: str) -> set[str]:
    """Every file name or glob the text cites (`results/x_{a,b}.json`, `e2e_*.jsonl`, ...),
    relative to benchmarks/results/ when it says `results/`."""
    patterns = set()
    for token in _FILE_TOKEN.findall(text):
        for name in _expand_braces(token):
            name = name.strip(".,")
            if _RESULT_EXT.search(name):
                patterns.add(name.split("results/", 1)[-1])
    return patterns


def result_files() -> list[str]:
    return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file())


def _matches(pattern: str, name: str) -> bool:
    if "/" in pattern:
        return fnmatch.fnmatchcase(name, pattern)
    return fnmatch.fnmatchcase(name.rsplit("/", 1)[-1], pattern)


def test_results_cited_by_the_readme_exist() -> None:
    files = result_files()
    text = BENCH_README.read_text()
    cited = {p.split("results/", 1)[-1] for p in re.findall(r"results/[\w./*{},-]+", text)}
    for token in cited:
        for pattern in _expand_braces(token.strip(".,")):
            if pattern.endswith("/"):
                assert (RESULTS / pattern).is_dir(), f"benchmarks/README.md cites {pattern}"
            elif _RESULT_EXT.search(pattern):
                assert any(_matches(pattern, f) for f in files), (
                    f"benchmarks/README.md cites results/{pattern}, which does not exist")


def test_every_result_file_is_cited() -> None:
    patterns = cited_patterns(BENCH_README.read_text()) | cited_patterns(HISTORY.read_text())
    uncited = [f for f in result_files() if not any(_matches(p, f) for p in patterns)]
    assert not uncited, (
        "benchmarks/results/ holds files that neither benchmarks/README.md nor "
        f"benchmarks/HISTORY.md cites: {uncited}; cite them next to their numbers or remove them")
