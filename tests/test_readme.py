"""The README's interactive examples run as written."""

import doctest
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    examples = [b for b in blocks if ">>>" in b]
    assert examples, "the README lost its worked example"
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for i, block in enumerate(examples):
        test = parser.get_doctest(block, {}, f"README[{i}]", str(README), 0)
        runner.run(test)
    assert runner.failures == 0


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"^(python3 -m venv .*)$", README.read_text(), flags=re.MULTILINE)
    assert len(commands) == 2, "the README has exactly two set-up commands"
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in (README.parent / ".ci" / "run").read_text()
