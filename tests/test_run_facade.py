"""Run is a façade over parts that own their state (issue 54, item 2), read from the source by ast, in milliseconds:
Run has at most 25 attributes, every one assigned in run.py; no other module of the run services sets one, calls
or reads a private member of a run, or takes a Run as a parameter (start-up returns what it settled, the end is
handed what it needs: starting.py, finishing.py, run_parts.py)."""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
ACCELRUN = REPO / "src" / "accelrun"
MOST_ATTRIBUTES = 25


def run_class(tree):
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Run")


def assigned_attributes(node, owner):
    """{attribute: line} of every `owner.X = ...` (or `owner.X, owner.Y = ...`, `owner.X += ...`, `owner.X: T = ...`)
    under node; `owner.X[k] = ...` changes what X holds, not which attribute the object has."""
    found = {}
    for stmt in ast.walk(node):
        if isinstance(stmt, ast.Assign):
            targets = stmt.targets
        elif isinstance(stmt, (ast.AugAssign, ast.AnnAssign)):
            targets = [stmt.target]
        else:
            continue
        for target in targets:
            for part in ast.walk(target) if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == owner:
                    found.setdefault(part.attr, stmt.lineno)
    return found


def run_attributes(source):
    return assigned_attributes(run_class(ast.parse(source)), "self")


def modules():
    """{path relative to src/accelrun: its ast} for every module but run.py."""
    return {str(path.relative_to(ACCELRUN)): ast.parse(path.read_text()) for path in sorted(ACCELRUN.rglob("*.py"))
            if path.name != "run.py" or path.parent != ACCELRUN}


def friend_problems(name, tree):
    """What module `name` does that only run.py may: take a Run as a parameter (named run, or annotated Run), set an
    attribute on a run, or touch a run's private member. No module but run.py imports Run (test_source.py), so a
    module meets one only as a parameter: one named `run` is the only way in, and then the other two rules see it."""
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "run" \
                and node.attr.startswith("_"):
            problems.append(f"{name}:{node.lineno}: run.{node.attr}: a private member of Run")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "run":
            problems.append(f"{name}:{node.lineno}: setattr(run, ...): only run.py sets a Run's attributes")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                annotated = arg.annotation is not None and "Run" in ast.unparse(arg.annotation).strip("'\"")
                if arg.arg == "run" or annotated:
                    problems.append(f"{name}:{node.lineno}: {node.name}() takes a Run ({arg.arg})")
    for attr, line in assigned_attributes(tree, "run").items():
        problems.append(f"{name}:{line}: run.{attr} = ...: only run.py sets a Run's attributes")
    return sorted(problems, key=lambda problem: int(problem.split(":")[1]))


def test_run_has_at_most_25_attributes_all_assigned_in_run_py():
    attributes = run_attributes((ACCELRUN / "run.py").read_text())
    assert 10 <= len(attributes) <= MOST_ATTRIBUTES, (len(attributes), sorted(attributes))  # 10: the walk works
    problems = [problem for name, tree in modules().items() for problem in friend_problems(name, tree)]
    assert not problems, "\n".join(problems)


def test_the_checks_catch_a_friend_and_an_attribute_too_many():
    """Each rule fails on the breaches it names (the state bag of before: starting.py set run.lock and run.peeked,
    finishing.py called run._evaluate, Run had 45 attributes)."""
    friend = ast.parse("def settle(run):\n    run.lock, run.peeked = None, None\n    run._evaluate('end')\n"
                       "def finish_run(model, ending: 'Run'):\n    setattr(run, 'state', None)\n"
                       "def ok(self, facts):\n    self.state = facts\n    facts['x'] = 1\n")
    assert [problem.split(": ", 1)[1] for problem in friend_problems("starting.py", friend)] == [
        "settle() takes a Run (run)", "run.lock = ...: only run.py sets a Run's attributes",
        "run.peeked = ...: only run.py sets a Run's attributes", "run._evaluate: a private member of Run",
        "finish_run() takes a Run (ending)", "setattr(run, ...): only run.py sets a Run's attributes"]
    # finetune/ is held too: its helpers are handed what they need (run.fail, run.print, run.sharded_init, the engine)
    helper = ast.parse("def load(args, run):\n    run.fail('x')\ndef load_model(args, fail):\n    fail('x')\n")
    assert [problem.split(": ", 1)[1] for problem in friend_problems("finetune/pretrained.py", helper)] == [
        "load() takes a Run (run)"]
    many = "class Run:\n    def __init__(self):\n" + "".join(f"        self.a{i} = {i}\n" for i in range(26))
    assert len(run_attributes(many + "        self.b, self.c = 1, 2\n        self.a0 += 1\n")) == 28
