"""docs/library.md runs as written: its complete example prints what the page shows.

The ```python blocks of the section "A complete example" form one script. It
runs in a subprocess from an empty directory, with XLA_FLAGS removed from its
environment (the script sets up its own 8 CPU devices, as a reader's copy
would). It must exit 0 (it asserts its own loads, compile count, interruption,
Orbax round trip and single-device reference) and print the ```text block that
follows it: the same lines, integers equal, 4-decimal losses within fp32
round-off. After the example, in the same process, the page's five-line use
and its ``param_specs`` snippet run on the example's model; the page's other
Python snippets must at least compile.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "library.md"
EXAMPLE = "A complete example"
TIMEOUT_S = 300  # the script takes seconds; a busy 2-core host can stretch that a lot

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
DECIMAL = re.compile(r"-?\d+\.\d+")
LOSS_TOLERANCE = 2e-4  # printed to 4 decimals: round-off may move the last digit

# Runs after the example, in its process: the page's five lines, then its param_specs snippet.
TAIL_BEFORE_FIVE_LINES = "batch, alive = batches[0], np.ones(G, dtype=bool)\n"
TAIL_AFTER_FIVE_LINES = (
    "assert metrics['max_load'] == 2 and bool(metrics['finite'])\n"
    "assert jax.tree.structure(params) == jax.tree.structure(ref)\n"
)
TAIL_AFTER_SPECS = """
sharded = step.init(params)
leaves = jax.tree.leaves_with_path(sharded.params)
specs = {jax.tree_util.keystr(path): x.sharding.spec for path, x in leaves}
hidden = [s for name, s in specs.items() if "hidden" in name and "kernel" in name]
assert hidden == [jax.P(None, "model")], specs
sharded, metrics = step(sharded, batch, alive)
assert bool(metrics["finite"]) and metrics["max_load"] == 2
print("tail ok")
"""


def sections(text: str) -> dict[str, str]:
    """Level-2 sections of a Markdown page, by heading."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of one language, in order."""
    return [body for lang, body in FENCE.findall(text) if lang == language]


def matches(expected: list[str], got: list[str]) -> list[str]:
    """Differences between expected and printed lines (decimals compared within tolerance)."""
    if len(expected) != len(got):
        return [f"{len(got)} lines printed, the page shows {len(expected)}"]
    out = []
    for want, line in zip(expected, got, strict=True):
        if DECIMAL.sub("#", want) != DECIMAL.sub("#", line):
            out.append(f"printed {line!r}, the page shows {want!r}")
            continue
        for a, b in zip(DECIMAL.findall(want), DECIMAL.findall(line), strict=True):
            if abs(float(a) - float(b)) > LOSS_TOLERANCE:
                out.append(f"printed {line!r}, the page shows {want!r}")
    return out


def _page() -> dict[str, str]:
    return sections(DOC.read_text(encoding="utf-8"))


def test_the_page_has_the_example_and_its_output():
    page = _page()
    assert EXAMPLE in page and "Five lines" in page, list(page)
    code = "\n".join(blocks(page[EXAMPLE], "python"))
    for needed in ("make_train_step", "Interruption", "abstract_state", "jax.grad", "nnx"):
        assert needed in code, needed
    (output,) = blocks(page[EXAMPLE], "text")
    assert output.count("max_load") == 8


def test_other_snippets_compile():
    snippets = [
        (heading, code)
        for heading, body in _page().items()
        if heading != EXAMPLE
        for code in blocks(body, "python")
    ]
    assert len(snippets) >= 3
    for heading, code in snippets:
        compile(code, f"docs/library.md, section {heading!r}", "exec")


def test_output_comparison_flags_a_wrong_line():
    shown = ["step 3  live 3/4  max_load 3  loss 1.5520"]
    assert not matches(shown, ["step 3  live 3/4  max_load 3  loss 1.5521"])
    assert matches(shown, ["step 3  live 3/4  max_load 4  loss 1.5520"])
    assert matches(shown, ["step 3  live 3/4  max_load 3  loss 1.5620"])
    assert matches(shown, [])


def test_example_runs_and_prints_what_the_page_shows(tmp_path):
    page = _page()
    example = "\n".join(blocks(page[EXAMPLE], "python"))
    (five_lines,) = blocks(page["Five lines"], "python")
    (specs,) = blocks(page["Meshes and `param_specs`"], "python")
    script = tmp_path / "library_example.py"
    script.write_text(
        example
        + "\n"
        + TAIL_BEFORE_FIVE_LINES
        + five_lines
        + TAIL_AFTER_FIVE_LINES
        + specs
        + TAIL_AFTER_SPECS,
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = [line for line in result.stdout.splitlines() if line.strip()]
    assert printed[-1] == "tail ok", result.stdout
    (output,) = blocks(page[EXAMPLE], "text")
    expected = [line for line in output.splitlines() if line.strip()]
    bad = matches(expected, printed[:-1])
    assert not bad, "\n".join(bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == [script.name]  # wrote nothing else
