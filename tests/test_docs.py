"""The documentation stands alone: small files, working links, no private references.

(a) every Markdown file in the repository is under `MAX_MARKDOWN_BYTES`;
(b) every relative link in README.md and docs/ resolves to a file or directory;
(c) no Markdown or Python file names a path on a build machine or cites a
    document or tracker entry that is not in the repository.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_MARKDOWN_BYTES = 200_000

# Directories never scanned: tooling, caches, virtual environments, run outputs.
SKIP_DIRS = {".git", ".venv", "runs", ".pytest_cache", ".ruff_cache", ".hypothesis", "__pycache__"}

# Link targets that another change will add. Each entry must be removed once the
# file exists: `test_link_allow_list_is_not_stale` fails as soon as it does.
PENDING_LINK_TARGETS: set[str] = set()

# Scanned by check (c): the library, binaries, configs, benchmarks, tests, docs, README.
PROSE_ROOTS = ("spare_jax", "experiments", "configs", "benchmarks", "tests", "docs", "README.md")

# Check (c). Written so that this file does not match its own patterns.
FORBIDDEN = [
    (re.compile(r"/(?:work|root|home)/"), "absolute path on a build machine"),
    (re.compile(r"\bDESIGN(?:\.md|'s)"), "cites an internal design file not in the repository"),
    (re.compile(r"\bPARAMETERS\.md"), "cites an internal parameter file not in the repository"),
    (
        re.compile(r"\bissues?\s*#\s*\d+|\bissue\s+\d+\b", re.IGNORECASE),
        "cites a tracker issue; cite docs/design.md or the primary source",
    ),
]

# [text](target) and ![alt](target); the target stops at whitespace or ')'.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def _walk(root: pathlib.Path, suffixes: tuple[str, ...]) -> list[pathlib.Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in SKIP_DIRS and not d.startswith(".venv") and not d.endswith(".egg-info")
        )
        out += [pathlib.Path(dirpath) / f for f in sorted(filenames) if f.endswith(suffixes)]
    return out


def markdown_files() -> list[pathlib.Path]:
    """Every Markdown file of the repository outside tooling and run directories."""
    return _walk(ROOT, (".md",))


def linked_markdown_files() -> list[pathlib.Path]:
    """The user-facing Markdown whose links check (b) follows."""
    return [ROOT / "README.md", *_walk(ROOT / "docs", (".md",))]


def oversized(paths: list[pathlib.Path], limit: int = MAX_MARKDOWN_BYTES) -> list[str]:
    """'path: N bytes' for each file of at least `limit` bytes."""
    return [f"{p}: {p.stat().st_size:,} bytes" for p in paths if p.stat().st_size >= limit]


def relative_links(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, target) of each relative link, fragment removed, outside code."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text(encoding="utf-8"))
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
                continue  # http(s):, mailto: and other schemes; anchors on the same page
            target = target.split("#", 1)[0]
            if target:
                out.append((lineno, target))
    return out


def _shown(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def broken_links(path: pathlib.Path) -> list[str]:
    """'file:line: target' for each relative link of `path` that resolves to nothing."""
    out = []
    for lineno, target in relative_links(path):
        resolved = (path.parent / target).resolve()
        if resolved.exists():
            continue
        if resolved.is_relative_to(ROOT) and resolved.relative_to(ROOT).as_posix() in (
            PENDING_LINK_TARGETS
        ):
            continue
        out.append(f"{_shown(path)}:{lineno}: {target}")
    return out


def forbidden_references(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """'file:line: why: text' for each line of `path` that check (c) rejects."""
    out = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for lineno, line in enumerate(lines, 1):
        for pattern, why in FORBIDDEN:
            if pattern.search(line):
                out.append(f"{_shown(path, root)}:{lineno}: {why}: {line.strip()[:100]}")
    return out


def prose_files() -> list[pathlib.Path]:
    out = []
    for name in PROSE_ROOTS:
        p = ROOT / name
        out += [p] if p.is_file() else _walk(p, (".md", ".py"))
    return out


# ------------------------------------------------------------------ (a) sizes


def test_markdown_files_are_small():
    files = markdown_files()
    assert ROOT / "README.md" in files and ROOT / "docs" / "design.md" in files
    bad = oversized(files)
    assert not bad, f"Markdown files of {MAX_MARKDOWN_BYTES:,} bytes or more:\n" + "\n".join(bad)


def test_size_check_flags_a_corrupted_file(tmp_path):
    # docs/simulator.md once grew to 9,802,295 bytes when a paragraph was pasted
    # between every character; the check must flag a file of that size.
    big, small = tmp_path / "big.md", tmp_path / "small.md"
    big.write_bytes(b"x" * 9_802_295)
    small.write_bytes(b"x" * (MAX_MARKDOWN_BYTES - 1))
    assert len(oversized([big, small])) == 1 and oversized([big])[0].startswith(str(big))


def test_size_check_flags_the_corrupted_simulator_page(tmp_path):
    """The real corrupted page from the history, when git and that commit are at hand."""
    if shutil.which("git") is None:
        pytest.skip("git not available")
    show = subprocess.run(
        ["git", "show", "6ad6f87:docs/simulator.md"], cwd=ROOT, capture_output=True, check=False
    )
    if show.returncode != 0:
        pytest.skip("commit 6ad6f87 not in this clone")
    page = tmp_path / "simulator.md"
    page.write_bytes(show.stdout)
    assert oversized([page]), f"{page.stat().st_size:,} bytes not flagged"


# ------------------------------------------------------------------ (b) links


def test_relative_links_resolve():
    files = linked_markdown_files()
    assert len(files) > 2
    bad = [b for f in files for b in broken_links(f)]
    assert not bad, "relative links that resolve to nothing:\n" + "\n".join(bad)


def test_link_allow_list_is_not_stale():
    present = sorted(t for t in PENDING_LINK_TARGETS if (ROOT / t).exists())
    assert not present, f"remove from PENDING_LINK_TARGETS, they exist now: {present}"


def test_link_parser(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        'See [a](a.md#part), ![img](img/x.png "title") and [web](https://x.org/y.md).\n'
        "[anchor](#top) [mail](mailto:a@b.c) `[code](not_a_link.md)`\n"
        "```\n[fenced](not_a_link_either.md)\n```\n"
        "[dir](sub/)\n",
        encoding="utf-8",
    )
    assert relative_links(page) == [(1, "a.md"), (1, "img/x.png"), (6, "sub/")]
    (tmp_path / "a.md").write_text("", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    assert [b.rsplit(": ", 1)[1] for b in broken_links(page)] == ["img/x.png"]


# ------------------------------------------------------------------ (c) references


def test_no_private_paths_or_references():
    bad = [b for f in prose_files() for b in forbidden_references(f)]
    assert not bad, (
        "machine paths or citations of documents that are not in the repository "
        "(cite docs/design.md, section N, or the primary source):\n" + "\n".join(bad)
    )


def test_reference_patterns(tmp_path):
    page = tmp_path / "x.md"
    lines = [
        "see " + "DESIGN" + ".md section 3",
        "DESIGN" + "'s reference",
        "PARAMETERS" + ".md",
        "issue " + "#4",
        "(issue" + " 4: over r)",
        "/" + "work/main/x",
        "/" + "home/u",
        "cp x /tmp/y && see docs/design.md, section 3; design.md; 4 issues",
    ]
    page.write_text("\n".join(lines) + "\n", encoding="utf-8")
    found = [int(b.split(":")[1]) for b in forbidden_references(page, root=tmp_path)]
    assert found == [1, 2, 3, 4, 5, 6, 7]
