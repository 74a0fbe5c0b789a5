"""The documentation holds together: every relative link in the repository's Markdown files points
at a file of the repository (and a `#anchor` into a Markdown file at one of its headings, as
GitHub computes heading anchors), and no file refers to design documents that are not in the
repository: code and tests point into docs/.

The files checked are those `git ls-files` lists: the tracked ones, and untracked ones that are not
ignored (so that a new document counts before its first commit)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _repo_files() -> list[str]:
    """Tracked files and untracked ones that are not ignored (new docs count before their commit),
    as repository-relative paths with '/', that exist in the working tree."""
    try:
        out = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return sorted({p for p in out.split("\0") if p and (ROOT / p).is_file()})


# ---------------------------------------------------------------------------------------------
# Markdown: headings and links

_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
_ATX = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_SETEXT = re.compile(r"^\s{0,3}(=+|-+)\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>\n]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)"
)
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_HTML_ID = re.compile(r"<[^>]*\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _unfenced(text: str) -> list[str | None]:
    """The lines of `text`, None for those inside (or opening / closing) a fenced code block."""
    out: list[str | None] = []
    fence: str | None = None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            out.append(None)
        elif m:
            fence = m.group(1)
            out.append(None)
        else:
            out.append(line)
    return out


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (fenced ones as empty lines, so numbering stays), with
    inline code spans blanked: a code span is not a link."""
    return [
        "" if line is None else _CODE_SPAN.sub(lambda s: "`" + "x" * len(s.group(2)) + "`", line)
        for line in _unfenced(text)
    ]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text (markup removed), lowercased, every character that
    is not a letter, digit, '_', '-' or space dropped, spaces turned into '-'."""
    text = re.sub(r"`+([^`]*)`+", r"\1", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a Markdown file defines: heading slugs (repeats get -1, -2, ...) and HTML ids."""
    found: set[str] = set()
    headings: list[str] = []
    prev = ""
    for line in _unfenced(text):
        if line is None:
            prev = ""
            continue
        atx = _ATX.match(line)
        if atx:
            headings.append(atx.group(2))
        elif _SETEXT.match(line) and prev.strip() and not prev.lstrip().startswith(("|", "-", "*", ">")):
            headings.append(prev.strip())
        found.update(_HTML_ID.findall(line))
        prev = line
    seen: dict[str, int] = {}
    for h in headings:
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        found.add(s if n == 0 else f"{s}-{n}")
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line number, destination) of every inline link, image and link reference definition."""
    out: list[tuple[int, str]] = []
    for i, line in enumerate(_prose_lines(text), 1):
        for m in _INLINE_LINK.finditer(line):
            out.append((i, m.group(1)))
        d = _REF_DEF.match(line)
        if d:
            out.append((i, d.group(1)))
    return [(i, dest[1:-1] if dest.startswith("<") else dest) for i, dest in out]


def _resolve(md: str, path: str) -> str | None:
    """The repository-relative path that a link in `md` names ("" for the root), None when it
    leaves the repository. A leading '/' starts at the repository root, as on GitHub."""
    parts = [] if path.startswith("/") else list(Path(md).parent.parts)
    for part in path.split("/"):
        if part == "..":
            if not parts:
                return None
            parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return "/".join(parts)


def broken_links(root: Path, md_files: list[str], files: set[str]) -> list[str]:
    """'path:line: destination (why)' for every relative link of `md_files` (repository-relative
    paths) whose target is not in `files` (or a folder of them), leaves the repository, or names
    an anchor that the target Markdown file does not define."""
    dirs = {parent.as_posix() for f in files for parent in Path(f).parents}
    anchor_cache: dict[str, set[str]] = {}

    def anchors_of(rel: str) -> set[str]:
        if rel not in anchor_cache:
            anchor_cache[rel] = anchors((root / rel).read_text(encoding="utf-8"))
        return anchor_cache[rel]

    bad: list[str] = []
    for md in md_files:
        for line, dest in links((root / md).read_text(encoding="utf-8")):
            if not dest or _SCHEME.match(dest) or dest.startswith("//"):
                continue  # a URL (http:, mailto:, ...), not a file of the repository
            path, _, anchor = dest.partition("#")
            path = unquote(path.split("?", 1)[0])
            rel = _resolve(md, path) if path else md
            if rel is None:
                bad.append(f"{md}:{line}: {dest} (leaves the repository)")
            elif rel not in files and (rel or ".") not in dirs:
                bad.append(f"{md}:{line}: {dest} (no such file)")
            elif anchor and rel.endswith(".md") and rel in files and anchor not in anchors_of(rel):
                where = "this file" if rel == md else rel
                bad.append(f"{md}:{line}: {dest} (no heading #{anchor} in {where})")
    return bad


def test_every_relative_link_in_the_markdown_files_resolves() -> None:
    files = _repo_files()
    md_files = [f for f in files if f.endswith(".md")]
    assert "docs/README.md" in md_files
    bad = broken_links(ROOT, md_files, set(files))
    assert not bad, "broken links:\n" + "\n".join(bad)


# ---------------------------------------------------------------------------------------------
# References to documents outside the repository

# Design documents that are not part of the repository must never be cited: the design lives in
# docs/. The pattern is built from pieces so that this file does not match it itself.
OUTSIDE_PATTERN = "|".join(["DESIGN" + r"\.md", "kernels" + r"\.md", "contracts" + " §", r"\.\." + "/shared"])


def outside_references() -> list[str]:
    """`path:line:text` of every line of the repository's files (tracked, and untracked ones that
    are not ignored) that matches OUTSIDE_PATTERN."""
    res = subprocess.run(
        ["git", "grep", "--untracked", "-I", "-n", "-E", "-e", OUTSIDE_PATTERN],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode in (0, 1), res.stderr  # 1: no match at all
    return res.stdout.splitlines()


def test_no_references_to_documents_outside_the_repository() -> None:
    _repo_files()  # skips outside a git checkout
    bad = outside_references()
    assert not bad, "references to documents outside the repository (point into docs/):\n" + "\n".join(bad)


# ---------------------------------------------------------------------------------------------
# The checks themselves can fail


def test_the_link_check_finds_broken_links_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("")
    (tmp_path / "docs" / "b.md").write_text("# B\n\n## The `x` step: one, two\n\n## Repeat\n\n## Repeat\n")
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n\n"
        "[ok](../src/a.py) [ok](b.md#the-x-step-one-two) [ok](b.md#repeat-1) [ok](#a) [ok](../src/)\n"
        "[web](https://example.com/x.md) `[code](nowhere.md)`\n\n"
        "```\n[fenced](nowhere.md)\n```\n\n"
        "[gone](../src/b.py) [anchor](b.md#missing) [self](#missing) [out](../../x.md)\n"
        "[ref]: missing.md\n"
    )
    files = {"src/a.py", "docs/a.md", "docs/b.md"}
    bad = broken_links(tmp_path, ["docs/a.md", "docs/b.md"], files)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "../src/b.py (no such file)",
        "b.md#missing (no heading #missing in docs/b.md)",
        "#missing (no heading #missing in this file)",
        "../../x.md (leaves the repository)",
        "missing.md (no such file)",
    ], bad


def test_the_reference_pattern_matches_what_it_must() -> None:
    pattern = re.compile(OUTSIDE_PATTERN)
    design, kernels = "DESIGN" + ".md", "kernels" + ".md"
    contracts, shared = "contracts" + " §", ".." + "/shared"
    for text in (
        f"//! The policy ({design} §5)",
        f"// The scan ({kernels} §1.3)",
        f"# Keys of {contracts}6",
        f"# see {shared}/reference/peers.md",
    ):
        assert pattern.search(text), text
    for text in ("docs/kernel-design.md, 'Chunked SSD scan'", "docs/cache-modes.md", "the contract"):
        assert not pattern.search(text), text
