"""Style by tool, not by line count: ruff (pyproject.toml: pycodestyle, pyflakes, import order, lines of at most
120 characters) finds nothing in the repository, and no line packs two statements into one expression.
Quick: no launch."""

import ast
import json
import subprocess
import sys

from launching import REPO


def test_ruff_check_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"ruff check . found problems:\n{result.stdout}{result.stderr}"


def packed_statements(source):
    """Lines where two statements were packed into one expression statement, which ruff lets through (its B018
    skips a tuple of calls): `a(), b()` and `a() if c else b()`."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Expr) and isinstance(node.value, (ast.Tuple, ast.IfExp))]


def test_no_two_statements_packed_into_one():
    assert packed_statements("model.train(mode), other.train(mode)\nprint(x) if x else log(x)\nf(a, b)\n") == [1, 2]
    found = [f"{path.relative_to(REPO)}:{line}" for path in sorted(REPO.rglob("*.py"))
             if not any(part.startswith(".") for part in path.relative_to(REPO).parts)
             for line in packed_statements(path.read_text())]
    assert found == [], "write one statement per line: " + ", ".join(found)


# One violation of each rule family pyproject.toml selects, and what ruff must call it (issue 36: with the selection
# emptied, `ruff check .` found nothing and the exit-code test above still passed).
PROBE = '''import sys
import os


def f(x):
    unused = 1
    x
''' + "\n".join(f"    if x == {i}:\n        return {i}" for i in range(13)) + "\n" + "".join(
    f"    x = x + {i}\n" for i in range(52)) + "    return os.sep, sys.argv, '" + "y" * 120 + "' \n"
EXPECTED = {"I001": "imports out of order", "F841": "an unused variable (pyflakes)", "B018": "a useless expression",
            "C901": "a function over 12 paths", "PLR0915": "a function over 50 statements",
            "E501": "a line over 120 characters", "W291": "trailing whitespace"}


def test_ruff_applies_the_selected_rules():
    """ruff, run with the repository's configuration on a file that breaks each selected rule family once, reports
    each: the selection (pyproject.toml's select, max-complexity 12, max-statements 50, line-length 120) is in force."""
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "json",
                             "--stdin-filename", "recipes/_style_probe.py", "-"], cwd=REPO, input=PROBE,
                            capture_output=True, text=True, timeout=120)
    found = {finding["code"] for finding in json.loads(result.stdout or "[]")}
    missing = {code: why for code, why in EXPECTED.items() if code not in found}
    assert not missing, f"ruff no longer reports {missing} (found {sorted(found)}): is pyproject.toml's rule " \
                        f"selection intact?\n{result.stderr}"
