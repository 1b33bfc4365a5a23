"""Style by tool, not by line count: ruff (pyproject.toml: pycodestyle, pyflakes, import order, lines of at most
120 characters) finds nothing in the repository, and no line packs two statements into one expression.
Quick: no launch."""

import ast
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
