"""Code, docstrings, comments and tests cite design rules (``docs/design.md rule N`` /
``section N``), benchmarks (the script, the figure, its date and device) and tests, never the
ordinal of a GPU session or log entry ("the twenty-first session", "s42") nor an issue number
("issue 14", "#15"), which a reader outside the team cannot look up; nor the dated log
(``docs/gpu-results.md``, ``docs/gpu-logs/``) that left the tree: current figures live in
``docs/performance.md``.

Every tracked source file and the reference docs are scanned (``git ls-files`` in a git checkout,
else a walk of the tree).
"""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the markdown scanned: the top-level README.md, every docs/*.md (not docs/ subfolders), the
#: benchmarks' READMEs and the examples' README
DOC_FILES = ("README.md", "docs/*.md", "benchmarks/README.md", "benchmarks/*/README.md", "examples/*.md")
#: source files scanned always: by suffix, plus the extension-less CI scripts
SOURCE_SUFFIXES = (".py", ".toml", ".sh", ".cfg", ".ini", ".yml", ".yaml", ".txt")
SOURCE_FOLDERS_ANY_FILE = (".ci/",)
#: this file states the patterns and samples of what they catch
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()

_UNITS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth"
_TEENS = "tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth"
_TENS = "twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety"
_TENTHS = "twentieth|thirtieth|fortieth|fiftieth|sixtieth|seventieth|eightieth|ninetieth"
#: an ordinal a log entry could carry: words ("sixth", "forty-second") or digits ("42nd")
ORDINAL = rf"(?:(?:{_TENS})[- ](?:{_UNITS})|{_TENTHS}|{_TEENS}|{_UNITS}|\d+(?:st|nd|rd|th))"
#: the same past plain English's range: "the first call" is English, "the twelfth call" a citation
HIGH_ORDINAL = rf"(?:(?:{_TENS})[- ](?:{_UNITS})|{_TENTHS}|{_TEENS}|[1-9]\d+(?:st|nd|rd|th))"
#: several ordinals in a row: "fifteenth and sixteenth", "thirty-seventh, thirty-eighth", "fourth to sixth"
_LIST = r"(?:\s*,\s*(?:and\s+)?|\s+(?:and|or|to)\s+)"
_SESSION_WORDS = r"(?:gpu\s+|device\s+|log\s+)?(?:sessions?|log\s+entr(?:y|ies))\b"
_CALL_WORDS = r"(?:sessions?|sections?|entr(?:y|ies)|logs?|calls?|runs?|helpers?)\b"

PATTERNS = {
    "session ordinal": re.compile(rf"\b{ORDINAL}(?:{_LIST}{ORDINAL})*(?:'s)?\s+{_SESSION_WORDS}", re.IGNORECASE),
    "log ordinal": re.compile(rf"\b{HIGH_ORDINAL}(?:{_LIST}{ORDINAL})*(?:'s)?\s+{_CALL_WORDS}", re.IGNORECASE),
    "numbered session": re.compile(r"\b(?:sessions?|log\s+entry)\s+#?\d+\b|(?<=[(\s,])s[1-9]\d(?=[),;:])", re.IGNORECASE),
    "issue number": re.compile(r"\b(?:issues?|PRs?|pull\s+requests?)\s*#?\d+\b|(?:^|(?<=[\s(,]))#\d+\b", re.IGNORECASE),
    "removed log file": re.compile(r"gpu-results|gpu-logs|\bs\d+-[\w.-]+\.log\b", re.IGNORECASE),
}


def _matches(path: str, globs: tuple[str, ...]) -> bool:
    """Whether `path` (posix, relative to the root) matches one of `globs`, ``*`` never crossing a ``/``."""
    parts = path.split("/")
    for pattern in globs:
        want = pattern.split("/")
        if len(want) == len(parts) and all(re.fullmatch(re.escape(w).replace(r"\*", "[^/]*"), p) for w, p in zip(want, parts)):
            return True
    return False


def tracked_files() -> list[str]:
    """The repository's files, relative to its root: git's list in a checkout, else every file
    outside hidden and build folders."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return sorted(p for p in out.decode().split("\0") if p)
    except (OSError, subprocess.CalledProcessError):
        skip = {"__pycache__", "build", "dist", ".venv", ".git", "node_modules"}
        return sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
                      if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts)
                      and not any(part.endswith(".egg-info") for part in p.relative_to(ROOT).parts))


def scanned_files(files: list[str]) -> list[str]:
    """The files of `files` the scan reads: source files and the reference docs (`DOC_FILES`)."""
    keep = []
    for path in files:
        if path == SELF:
            continue
        if path.endswith(".md"):
            if _matches(path, DOC_FILES):
                keep.append(path)
        elif path.endswith(SOURCE_SUFFIXES) or path.startswith(SOURCE_FOLDERS_ANY_FILE):
            keep.append(path)
    return keep


def _continuation(line: str) -> str:
    """A line's text as it continues the previous line's sentence: indentation and comment marks off."""
    return re.sub(r"^\s*(?:#+|//|\*|>|[rbf]?[\"'])?\s*", "", line)


def citations(text: str) -> list[tuple[int, str, str]]:
    """``(line number, kind, matched text)`` for every citation in `text`. Each line is read together
    with the next one, so a citation broken over two lines ("thirty-second" / "session") is found,
    and reported at the line where it starts."""
    lines = text.splitlines()
    found = []
    carried = 0  # how far into this line a citation reported at the previous line reaches
    for i, line in enumerate(lines):
        head = re.sub(r"[\"']\s*$", "", line)  # a string literal continued on the next line
        rest = _continuation(lines[i + 1]) if i + 1 < len(lines) else ""
        joined = head + " " + rest
        # a citation two patterns match, or one already reported from the line above, counts once
        taken: list[range] = [range(0, carried)]
        carried = 0
        for kind, pattern in PATTERNS.items():
            for match in pattern.finditer(joined):
                if match.start() < len(head) and not any(match.start() in span for span in taken):
                    taken.append(range(match.start(), match.end()))
                    found.append((i + 1, kind, match.group(0)))
                    if match.end() > len(head) + 1:  # into the next line, past its indentation
                        carried = max(carried, len(lines[i + 1]) - len(rest) + match.end() - len(head) - 1)
    return found


def test_sources_cite_rules_benchmarks_and_tests_not_log_ordinals_or_issues():
    problems = []
    files = scanned_files(tracked_files())
    assert any(p.startswith("kernels/") for p in files) and ".ci/run" in files and "pyproject.toml" in files, files[:20]
    for path in files:
        try:
            text = (ROOT / path).read_text(encoding="utf-8")
        except (FileNotFoundError, UnicodeDecodeError):  # deleted in the work tree, or binary
            continue
        problems += [f"{path}:{line}: {kind}: {found!r}" for line, kind, found in citations(text)]
    assert not problems, ("cite docs/design.md rule N / section N, the benchmark (script, figure, date, device) "
                          "or the test instead; current figures are in docs/performance.md:\n" + "\n".join(problems))


def test_the_patterns_catch_citations():
    samples = {
        "measured in the twenty-first session": "session ordinal",
        "(docs/x.md, thirty-seventh, thirty-eighth sessions)": "session ordinal",
        "the fifteenth and sixteenth sessions": "session ordinal",
        "as the sixth session found": "session ordinal",
        "the 42nd log entry": "session ordinal",
        "the forty-second section": "log ordinal",
        "in the thirty-sixth call": "log ordinal",
        "as in session 31": "numbered session",
        "(s42, 12.16 ms)": "numbered session",
        "targets of issue 14": "issue number",
        "issues 14 and 15": "issue number",
        "see (#15)": "issue number",
        "results in docs/gpu-results.md": "removed log file",
        "(log ``2026-11-24-s8-cudnn-bwd.log``)": "removed log file",
    }
    for sample, kind in samples.items():
        assert kind in [k for _, k, _ in citations(sample)], (sample, citations(sample))
    broken = "# as measured in the thirty-second\n    # session, 3.06 ms\n"
    assert [(line, kind) for line, kind, _ in citations(broken)] == [(1, "session ordinal")]
    listed = "# (fortieth and\n# forty-first sessions); the twelfth session\n"
    assert [(line, found) for line, _, found in citations(listed)] == [
        (1, "fortieth and forty-first sessions"), (2, "twelfth session")]
    strings = 'help=("the default and the fifteenth "\n          "session\'s nine")'
    assert [(line, kind) for line, kind, _ in citations(strings)] == [(1, "session ordinal")]


def test_the_patterns_leave_plain_english_alone():
    for sample in ("on the first call the kernel compiles", "the second half added onto the first",
                   "a fifth to a half of the forward", "the last eighth: (almost) never", "the first entry of the table",
                   "docs/design.md rule 2, section 4", "x[#0]", "s1, s2 = split(x)", "f(s1)",
                   "issued behind the next block", "a sixth of the pool's sequences", "measured on an H200, 2026-11-27",
                   "color = '#ff0000'", "tissue 3", "cat beside.log"):
        assert citations(sample) == [], (sample, citations(sample))


def test_sources_and_reference_docs_are_scanned_not_data_or_doc_subfolders():
    files = ["README.md", "docs/design.md", "docs/gpu-logs/a.md", "examples/README.md", "kernels/linear.py",
             ".ci/run", "benchmarks/README.md", "benchmarks/investigations/README.md", "tests/x.json", SELF]
    assert scanned_files(files) == ["README.md", "docs/design.md", "examples/README.md",
                                                     "kernels/linear.py", ".ci/run", "benchmarks/README.md",
                                                     "benchmarks/investigations/README.md"]


def test_without_git_the_tree_is_walked(monkeypatch):
    """Outside a git checkout (an unpacked sdist, no git) the scan walks the tree instead, leaving
    out virtual environments, caches and build folders."""
    def no_git(*args, **kwargs):
        raise OSError("git: not found")

    monkeypatch.setattr(subprocess, "run", no_git)
    files = tracked_files()
    assert "kernels/linear.py" in files and "pyproject.toml" in files and SELF in files
    assert not [p for p in files if p.startswith((".venv/", ".git/")) or "__pycache__" in p]
