"""The contract every recipe keeps (docs/writing-a-recipe.md), read from the source, or from an interpreter that
answers at once (--help, a wrong flag, `import accelrun`): the quick half; the launches that hold the same contract
are test_contract.py, the resumes test_checkpoint_resume.py.

Of the recipes: no torch.distributed, DistributedSampler, DistributedDataParallel or .cuda(); --help with defaults,
no abbreviations, an unknown flag refused, a help text for every flag; a docstring with the commands and a dated
result; a loop that reads as plain PyTorch; docs/recipes.md naming exactly the accelerate calls they make. Of accelrun:
one concern per module, each listed once, no name defined twice, nothing below run.py importing it; an installed,
versioned package.
"""

import ast
import datetime
import json
import re
import subprocess
import sys

import pytest

from launching import REPO, launch_environment

TRAINING_RECIPES = sorted((REPO / "recipes").glob("*.py"))
RECIPES = TRAINING_RECIPES + sorted((REPO / "recipes" / "quickstart").glob("*.py"))
HELPERS = ("data", "finetune")  # the recipes' own helpers, installed with accelrun: under the recipes' contract
# checkpoint/ too
ACCELRUN = sorted(p for p in (REPO / "src" / "accelrun").rglob("*.py") if p.parent.name not in HELPERS)
RECIPE_MODULES = sorted(p for name in HELPERS for p in (REPO / "src" / "accelrun" / name).glob("*.py")
                        if p.name != "__init__.py")


def imports_run(path):
    """Whether a recipe imports the Run object from accelrun (it is then built on Run and keeps its loop shape)."""
    return any(isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "accelrun"
               and any(alias.name == "Run" for alias in node.names) for node in ast.walk(ast.parse(path.read_text())))


RUN_RECIPES = [p for p in TRAINING_RECIPES if imports_run(p)]


FORBIDDEN = {
    "torch.distributed": "accelerate owns the process group",
    "DistributedSampler": "accelerate shards the data; a second sampler shards it twice",
    "DistributedDataParallel": "accelerate wraps the model",
}


def contract_violations(source):
    """Names of forbidden things a recipe's source uses (imports, attributes, .cuda() calls)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names] + [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [ast.unparse(node), node.attr]
        elif isinstance(node, ast.Name):
            names = [node.id]
        else:
            continue
        found |= {bad for bad in FORBIDDEN for name in names if name == bad or name.startswith(bad + ".")}
    if re.search(r"\.cuda\(", source):
        found.add(".cuda()")
    return found


@pytest.mark.parametrize("recipe", RECIPES + RECIPE_MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_recipe_contract(recipe):
    assert contract_violations(recipe.read_text()) == set(), FORBIDDEN


def test_contract_check_catches_violations():
    assert contract_violations("import torch.distributed as dist") == {"torch.distributed"}
    assert contract_violations("from torch.utils.data import DistributedSampler") == {"DistributedSampler"}
    wrapped = "model = torch.nn.parallel.DistributedDataParallel(model)"
    assert contract_violations(wrapped) == {"DistributedDataParallel"}
    assert contract_violations("x = x.cuda()") == {".cuda()"}
    assert contract_violations("x = x.to(accelerator.device)") == set()


@pytest.mark.parametrize("name", ["tiny_hf", "image_folder"])
def test_data_generators_help_prints_help_and_writes_nothing(name, tmp_path):
    """docs tell users to run `python -m accelrun.data.tiny_hf DIR` (installed with the package, issue 53 item 3):
    --help is help, never a directory named --help, and it answers from any directory."""
    result = subprocess.run([sys.executable, "-m", f"accelrun.data.{name}", "--help"], cwd=tmp_path,
                            env=launch_environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith(f"usage: python -m accelrun.data.{name}"), result.stderr
    assert list(tmp_path.iterdir()) == []


def test_image_folder_writes_the_class_folders_resnet_reads(tmp_path, capsys):
    """`python -m accelrun.data.image_folder DIR` (in this process): DIR/train and DIR/val, a folder per class, PNG
    and JPEG files of the size asked; a count below 1 is refused by argparse."""
    from accelrun.data import image_folder

    image_folder.main([str(tmp_path / "img"), "--train-per-class", "3", "--val-per-class", "1", "--size", "8"])
    found = sorted(str(p.relative_to(tmp_path / "img")) for p in (tmp_path / "img").rglob("*.*"))
    assert found == [f"{split}/{c}/{n}" for split, names in (("train", ("0000.png", "0001.jpg", "0002.png")),
                                                             ("val", ("0000.png",)))
                     for c in image_folder.CLASSES for n in names], found
    with pytest.raises(SystemExit):
        image_folder.parse_args(["x", "--size", "0"])
    assert "--size: '0': give a whole number, 1 or more" in capsys.readouterr().err


def test_negative_checkpoint_counts_are_refused_by_argparse():
    result = subprocess.run([sys.executable, "recipes/mnist.py", "--keep-last", "-1", "--checkpoint-every", "x"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "argument --keep-last: '-1': give a whole number, 0 or more" in result.stderr, result.stderr


def docstring_commands(doc):
    """The shell commands a docstring gives (a line continued with a backslash joined to the next)."""
    lines = re.sub(r"\s*\\\n\s*", " ", doc).splitlines()
    return [line.strip() for line in lines if re.search(r"\baccelerate launch\b|\bpython3? recipes/", line)]


def docstring_problems(doc, name, today):
    """What a recipe's docstring lacks: the commands that run it (`accelerate launch ...` / `python recipes/...`),
    and one line starting with `Result:` that states the result and when it was `measured`, as an ISO date that
    exists and is not after `today` (docs/recipes.md holds the full measurements)."""
    problems = []
    if not any(f"recipes/{name}" in command for command in docstring_commands(doc)):
        problems.append(f"give the commands that run it (accelerate launch ... / python recipes/{name})")
    results = [line.strip() for line in doc.splitlines() if line.lstrip().startswith("Result:")]
    if len(results) != 1:
        return problems + [f"one line starting with 'Result:', not {len(results)}"]
    if "measured" not in results[0]:
        problems.append(f"say when the result was measured: {results[0]!r}")
    dates = re.findall(r"\b\d{4}-\d{2}-\d{2}\b", results[0])
    if not dates:
        problems.append(f"the date it was measured, as YYYY-MM-DD: {results[0]!r}")
    for text in dates:
        try:
            measured = datetime.date.fromisoformat(text)
        except ValueError:
            problems.append(f"{text} is not a date")
            continue
        if measured > today:
            problems.append(f"measured {text}, after today ({today})")
    return problems


@pytest.mark.parametrize("recipe", TRAINING_RECIPES, ids=lambda p: p.name)
def test_recipe_docstring_gives_commands_and_results(recipe):
    doc = ast.get_docstring(ast.parse(recipe.read_text()))
    problems = docstring_problems(doc, recipe.name, datetime.date.today())
    assert not problems, f"{recipe.name}: " + "; ".join(problems)


@pytest.mark.parametrize("name", ["gpt.py", "finetune_lm.py"])
def test_cpu_commands_name_the_threads_their_figures_were_measured_with(name):
    """Issue 41, item 4: finetune_lm.py ran at 123 tokens/s with torch's default threads on a shared machine and at
    1,880 with OMP_NUM_THREADS=1, the setting of the measured figures, which the docstring's commands did not name."""
    doc = ast.get_docstring(ast.parse((REPO / "recipes" / name).read_text()))
    cpu = [c for c in docstring_commands(doc) if re.search(r"\bpython3? recipes/", c)]
    assert cpu and all(re.search(r"\bOMP_NUM_THREADS=1 python3? recipes/", c) for c in cpu), cpu


def test_docstring_check_takes_any_year_and_catches_each_lack():
    doc = ("Run it:\n\n    accelerate launch --config_file accelerate_configs/2gpu.yaml \\\n        recipes/mnist.py"
           "\n\nResult: 98% test accuracy in 3 epochs (measured 2027-01-05 on one H100).\n")
    assert docstring_commands(doc) == ["accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/mnist.py"]
    assert docstring_commands("    python recipes/pi.py --intervals 1e9") == ["python recipes/pi.py --intervals 1e9"]
    # No upper bound on the year: measured in 2027 is fine from that day on, and in any later year.
    for today in (datetime.date(2027, 1, 5), datetime.date(2031, 2, 3)):
        assert docstring_problems(doc, "mnist.py", today) == []
    assert docstring_problems(doc, "mnist.py", datetime.date(2026, 12, 31)) == [
        "measured 2027-01-05, after today (2026-12-31)"]
    today = datetime.date(2030, 1, 1)
    assert docstring_problems(doc, "gpt.py", today) == [
        "give the commands that run it (accelerate launch ... / python recipes/gpt.py)"]
    impossible = doc.replace("2027-01-05", "2027-13-05")
    assert docstring_problems(impossible, "mnist.py", today) == ["2027-13-05 is not a date"]
    assert docstring_problems(doc.replace("measured 2027-01-05", "in 2027"), "mnist.py", today) == [
        "say when the result was measured: 'Result: 98% test accuracy in 3 epochs (in 2027 on one H100).'",
        "the date it was measured, as YYYY-MM-DD: 'Result: 98% test accuracy in 3 epochs (in 2027 on one H100).'"]
    assert docstring_problems(doc + "Result: again\n", "mnist.py", today) == ["one line starting with 'Result:', not 2"]
    assert docstring_problems(doc.replace("Result:", "Results"), "mnist.py", today) == [
        "one line starting with 'Result:', not 0"]


@pytest.mark.parametrize("command, message", [
    (["recipes/pi.py", "--intervals", "many"], "--intervals 'many': give whole numbers"),
    (["recipes/gpt.py", "--preset", "tiny", "--data-files", "/nonexistent/*.txt"],
     "error: --data-files '/nonexistent/*.txt' matches no file"),
])
def test_recipe_input_errors_are_one_clear_line(command, message, tmp_path):
    result = subprocess.run([sys.executable, *command, "--output-dir", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]


def run_service(module):
    """Whether `module` is one of accelrun's run services, not one of the recipes' own helpers it also installs."""
    return module.split(".")[0] == "accelrun" and module.split(".")[1:2] not in (["data"], ["finetune"])


def project_imports(source):
    """Names a recipe imports from the run services (accelrun, its helpers for the recipes aside)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and run_service(node.module):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if run_service(a.name)]
    return names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_is_one_readable_file(recipe):
    """One recipe, readable in one sitting: a reviewer's rule, not a line count (ruff, in pyproject.toml, keeps the
    style). What can be counted: a recipe leans on a handful of run services, not on the whole of accelrun."""
    source = recipe.read_text()
    assert len(project_imports(source)) <= 6, project_imports(source)


def training_loop_body(source):
    """The statements of the innermost loop over `batches` (the micro-batch loop; finetune_lm's pairs each
    micro-batch with its optimizer step's token count)."""
    loops = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.For)
             and "batches" in {m.id for m in ast.walk(n.iter) if isinstance(m, ast.Name)}]
    assert len(loops) == 1, "one micro-batch loop"
    return loops[0]


def test_every_recipe_built_on_run_is_found():
    """The loop-shape test below covers every recipe that imports Run, found in the source, not listed by hand."""
    names = [p.name for p in RUN_RECIPES]
    assert {"mnist.py", "gpt.py", "resnet.py", "finetune_lm.py"} <= set(names), names
    assert "pi.py" not in names and "data_sharding.py" not in names  # no training loop: they use no Run


def given_to_run(tree, method, position, name):
    """Whether the recipe gives run.<method>(...) an argument `name` (at `position`, or by keyword) that is not
    None or 0: a scheduler to run.start (third), a clipping norm to run.setup (keyword only: position None)."""
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == f"run.{method}"]
    assert len(calls) == 1, f"one run.{method}(...)"
    call = calls[0]
    value = call.args[position] if position is not None and len(call.args) > position else next(
        (k.value for k in call.keywords if k.arg == name), None)
    return not (value is None or isinstance(value, ast.Constant) and value.value in (None, 0))


@pytest.mark.parametrize("recipe", RUN_RECIPES, ids=lambda p: p.name)
def test_loop_reads_as_plain_pytorch(recipe):
    """forward, loss, backward, clip, step, zero_grad, and at most three calls to the run object. Clipping when
    the recipe gives Run a clipping norm (Run sets DeepSpeed's to match), scheduler.step() when it gives Run a
    scheduler."""
    name, tree = recipe.name, ast.parse(recipe.read_text())
    loop = training_loop_body(recipe.read_text())
    body = loop.body
    calls = [ast.unparse(n.func) for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Call)]
    assert len([c for c in calls if c.startswith("run.")]) <= 3, calls
    assert "run.step" in calls, (name, calls)
    wanted = ["accelerator.backward", "optimizer.step", "optimizer.zero_grad"]
    wanted += ["scheduler.step"] if given_to_run(tree, "start", 2, "scheduler") else []
    wanted += ["accelerator.clip_grad_norm_"] if given_to_run(tree, "setup", None, "max_grad_norm") else []
    for call in wanted:
        assert call in calls, (name, call)
    statements = sum(1 for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.stmt))
    assert statements <= 13, f"{name}: {statements} statements in the loop"
    # Nothing but the loop's own work: no timers, fingerprints, loggers or profilers. The recipe's own functions
    # and lambdas (its loss, its input conversion) are the loop's work, written in the same file.
    roots = {call_root(n.func) for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Call)}
    batch_names = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)} | {
        n.id for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    own_functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} | {
        t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Lambda)
        for t in n.targets if isinstance(t, ast.Name)}
    assert roots - batch_names - own_functions <= {"run", "accelerator", "optimizer", "scheduler", "F", "model"}, roots


def call_root(node):
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else ast.unparse(node)


def wrong_flag(recipe):
    """An abbreviation of one of the recipe's flags."""
    return "--epoch" if "--epochs" in recipe.read_text() else "--output-di"


@pytest.fixture(scope="module")
def help_and_wrong_flag():
    """{recipe name: (its --help, its run with an abbreviated flag)}, each a CompletedProcess. The interpreters
    start at once (each used to spend seconds importing torch; test_help_imports_no_torch keeps them quick)."""
    commands = {}
    for recipe in TRAINING_RECIPES:
        commands[recipe.name, "help"] = [sys.executable, str(recipe), "--help"]
        commands[recipe.name, "wrong"] = [sys.executable, f"recipes/{recipe.name}", wrong_flag(recipe), "1"]
    running = {}
    try:
        for key, cmd in commands.items():
            running[key] = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        done = {}
        for key, proc in running.items():
            out, err = proc.communicate(timeout=300)
            done[key] = subprocess.CompletedProcess(commands[key], proc.returncode, out, err)
    finally:  # a hung --help: none of them outlives the test
        for proc in running.values():
            proc.kill()
            proc.wait()
    return {recipe.name: (done[recipe.name, "help"], done[recipe.name, "wrong"]) for recipe in TRAINING_RECIPES}


@pytest.mark.parametrize("recipe", TRAINING_RECIPES, ids=lambda p: p.name)
def test_help_shows_defaults_and_a_wrong_flag_is_one_line(recipe, help_and_wrong_flag):
    """--help gives the defaults; an abbreviated flag is refused (allow_abbrev=False) as any unknown flag is: one
    line naming --help, no usage block (a screen of flags, printed by every process under a launcher)."""
    result, wrong = help_and_wrong_flag[recipe.name]
    assert result.returncode == 0 and "(default:" in result.stdout
    flag = wrong_flag(recipe)
    assert re.search(rf"{re.escape(flag)}\S", result.stdout), flag  # it abbreviates a real flag
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert wrong.stderr == (f"{recipe.name}: error: unrecognized arguments: {flag} 1 (python3 recipes/{recipe.name} "
                            f"--help lists the flags)\n"), wrong.stderr


# Run in one interpreter: each recipe as `python RECIPE ARGS` runs it (runpy, as __main__), then the libraries it
# had imported by the time argparse answered. Written to a file: --help prints on stdout.
IMPORTS_PROBE = """
import json, os, runpy, sys
HEAVY = ("torch", "accelerate", "torchvision", "transformers", "datasets", "peft", "deepspeed")
out, found = sys.argv[1], {}
for path, args in json.loads(sys.argv[2]):
    sys.argv, sys.path[0] = [path, *args], os.path.dirname(path)
    try:
        runpy.run_path(path, run_name="__main__")
        code = None
    except SystemExit as exc:
        code = exc.code
    found[" ".join(sys.argv)] = [code, [m for m in HEAVY if m in sys.modules]]
with open(out, "w") as f:
    json.dump(found, f)
"""


def test_help_and_a_wrong_flag_answer_before_torch_is_imported(tmp_path):
    """Issue 41, items 3 and 9: `--help` took 14-24 s and a typo 40 s under load, spent importing torch before
    argparse answered. Every recipe (the quickstart's too) parses its flags before it imports torch, accelerate,
    torchvision or transformers: --help exits 0 and a wrong flag 2 with none of them imported."""
    runs = [(str(recipe), args) for recipe in RECIPES for args in (["--help"], ["--no-such-flag"])]
    runs.append((str(REPO / "recipes" / "finetune_lm.py"), ["--merge-lora"]))  # LoRA flags without --lora-r
    runs.append((str(REPO / "recipes" / "finetune_lm.py"), ["--load-in-4bit"]))  # QLoRA without --lora-r
    out = tmp_path / "imports.json"
    result = subprocess.run([sys.executable, "-c", IMPORTS_PROBE, str(out), json.dumps(runs)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(out.read_text())
    assert len(found) == 2 * len(RECIPES) + 2 >= 20, found
    for command, (code, imported) in found.items():
        assert code == (0 if command.endswith("--help") else 2), (command, code)
        assert imported == [], f"{command} imported {imported} before argparse answered"


def test_every_flag_has_help():
    for recipe in TRAINING_RECIPES + RECIPE_MODULES + ACCELRUN:
        for node in ast.walk(ast.parse(recipe.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("add_argument"):
                assert any(k.arg == "help" for k in node.keywords), f"{recipe.name}: {ast.unparse(node)[:80]}"


def accelerate_calls(paths):
    """Members used on the accelerator object in the recipes' source."""
    found = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "accelerator":
                found.add(f"accelerator.{node.attr}")
    return found


def test_recipes_md_names_exactly_the_accelerate_calls():
    """docs/recipes.md's list (the README's until issue 41, item 11 moved it off the front page)."""
    line = next(text for text in (REPO / "docs" / "recipes.md").read_text().splitlines()
                if text.startswith("Accelerate calls in the recipes:"))
    named = set(re.findall(r"`(accelerator\.[a-z_]+)`", line))
    assert named == accelerate_calls(RECIPES), (named ^ accelerate_calls(RECIPES))
    assert "`Accelerator(...)`" in line


def accelrun_table():
    """{module file: its concern} from the table in accelrun/__init__.py's docstring (one line per module)."""
    doc = ast.get_docstring(ast.parse((REPO / "src" / "accelrun" / "__init__.py").read_text()))
    rows = [re.match(r"\s+((?:\w+/)?\w+\.py)\s+(.+)", line) for line in doc.splitlines()]
    names = [row.group(1) for row in rows if row]
    assert len(names) == len(set(names)), f"a module listed twice: {names}"
    return {row.group(1): row.group(2) for row in rows if row}


def test_each_accelrun_module_owns_one_listed_concern():
    """accelrun/__init__.py lists every module once, with its concern, and each module's docstring says what it
    owns; no public name is defined in two modules (one owner per decision); and no module below run.py imports
    run.py (the Run object sits on top of the services, never under them)."""
    table = accelrun_table()
    names = {path: str(path.relative_to(REPO / "src" / "accelrun")) for path in ACCELRUN}
    modules = {name for name in names.values() if not name.endswith("__init__.py")}
    assert set(table) == modules, (set(table) ^ modules)
    defined = {}
    for path in ACCELRUN:
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f"{names[path]}: a docstring that says what it owns"
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                defined.setdefault(node.name, []).append(names[path])
        # accelrun's run.py, from accelrun/ (one dot) or from checkpoint/ (two)
        depth = names[path].count("/") + 1
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == depth}
        imported |= {n.module.removeprefix("accelrun.") for n in ast.walk(tree)  # stop.py's absolute imports
                     if isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").startswith("accelrun.")}
        assert names[path] in ("__init__.py", "run.py") or "run" not in imported, f"{names[path]} imports run.py"
    twice = {name: where for name, where in defined.items() if len(where) > 1}
    assert not twice, f"defined in more than one accelrun module: {twice}"


# One owner per decision, constants and private copies included (issue 54, item 3): the modules of accelrun (its
# recipes' helpers too), bench/ and launch/.
OWNED = sorted(p for where in (REPO / "src" / "accelrun", REPO / "bench", REPO / "launch") for p in where.rglob("*.py"))
# Names that several modules may each define, and why: not one decision made twice.
SHARED_NAMES = {
    "REPO": "each bench/ and launch/ script is run by path and finds its own checkout from its own __file__",
}
# Literal values that constants of different names hold in two modules, and why they are two decisions.
SHARED_VALUES = {
    4096: "checkpoint/layout.LOCK_MAX_BYTES (a lock's few fields) and results.MARK_MAX_BYTES (run.json's two) bound "
          "two files that may grow apart",
    1 << 22: "checkpoint/lock.PID_MAX is Linux's (a pid a lock may name) and layout.MANIFEST_MAX_BYTES (4 MB) is the "
             "manifest's bound: equal by chance",
    16: "bench/lm_memory.LORA_R (the planner's LoRA rank) and float8.MULTIPLE (the widths float8 matmuls take): equal "
        "by chance",
}


def _constants(tree):
    """{NAME: its value's node, or None} of the UPPER_CASE names a module assigns at its top level."""
    found = {}
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign)
                   else [])
        for target in targets:
            values = node.value.elts if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) else None
            names = target.elts if isinstance(target, ast.Tuple) else [target]
            for i, name in enumerate(names):
                if isinstance(name, ast.Name) and name.id.isupper():
                    found[name.id] = values[i] if values else node.value
    return found


def _distinctive(node):
    """The literal value of a constant's node when it is one a reader would recognise elsewhere (not 0, 1 or a small
    count, not a short word), else None."""
    arithmetic = (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop)  # 4 << 20 is a literal too
    try:
        if node is not None and all(isinstance(n, arithmetic) for n in ast.walk(node)):
            value = eval(compile(ast.Expression(node), "<constant>", "eval"), {"__builtins__": {}})
        else:
            value = ast.literal_eval(node) if node is not None else None
    except (ValueError, TypeError, ArithmeticError):
        return None
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return value if abs(value) > 10 else None
    if isinstance(value, str):
        return value if len(value) >= 4 else None
    return repr(value) if isinstance(value, (tuple, list, frozenset, set, dict)) and value else None


def _body(function):
    """A function's body without its docstring, as a comparable string; None for a short one (a line or two, which two
    modules may well write alike)."""
    body = function.body[1:] if ast.get_docstring(function) else function.body
    module = ast.Module(body=body, type_ignores=[])
    if sum(1 for _ in ast.walk(module)) < 12:
        return None
    # Numbers aside: a copy that cuts at 60 where the other cuts at 40 is still a copy.
    return re.sub(r"Constant\(value=-?[0-9.e+]+\)", "Constant(value=N)", ast.dump(module))


def module_doubles(sources):
    """What is decided twice among `sources` ({module name: its source}): a constant NAME assigned in two modules (one
    that imports it assigns nothing), a private function or class defined in two, one literal value under two names in
    two modules, a function's body written out in two; SHARED_NAMES and SHARED_VALUES excepted."""
    names, privates, values, bodies = ({} for _ in range(4))
    for module, source in sources.items():
        tree = ast.parse(source)
        for name, node in _constants(tree).items():
            names.setdefault(name, set()).add(module)
            if _distinctive(node) is not None:
                values.setdefault(_distinctive(node), set()).add((name, module))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.startswith("_") and \
                    not node.name.startswith("__"):
                privates.setdefault(node.name, set()).add(module)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and _body(node):
                bodies.setdefault(_body(node), set()).add(f"{module}:{node.name}")
    found = [f"constant {n} in {sorted(m)}" for n, m in names.items() if len(m) > 1 and n not in SHARED_NAMES]
    found += [f"private {n} in {sorted(m)}" for n, m in privates.items() if len(m) > 1]
    found += [f"value {v!r} as {sorted(w)}" for v, w in values.items()
              if len({m for _, m in w}) > 1 and len({n for n, _ in w}) > 1 and v not in SHARED_VALUES]
    found += [f"one body in {sorted(w)}" for w in bodies.values() if len({x.split(":")[0] for x in w}) > 1]
    return found


def test_each_decision_has_one_owner_constants_and_private_copies_too():
    """Issue 54, item 3: the guard above sees public functions and classes; constants and private copies passed it
    (IGNORE = -100 in two modules, DEFAULT_CHUNKS in two, a bounded read and a value's cut written out twice). Across
    accelrun, bench/ and launch/: no constant NAME in two modules, no private function in two, no literal under two
    names meant alike, no function body copied (SHARED_NAMES and SHARED_VALUES list the exceptions and why)."""
    doubles = module_doubles({str(p.relative_to(REPO)): p.read_text() for p in OWNED})
    assert not doubles, doubles


def test_the_guard_finds_the_doubles_it_was_written_for():
    """The doubles issue 54 found, as they were, each fail module_doubles; the fixed form (one imports it) passes."""
    read = ("def _read(path, limit):\n    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)\n"
            "    try:\n        return os.read(fd, limit + 1)\n    finally:\n        os.close(fd)\n")
    cases = {
        "constant IGNORE": {"packing.py": "IGNORE = -100\n", "chunked_loss.py": "IGNORE = -100  # packing's\n"},
        "constant DEFAULT_CHUNKS": {"loss_flags.py": "DEFAULT_CHUNKS = 8\n", "lm_memory.py": "DEFAULT_CHUNKS = 8\n"},
        "value 16384": {"a.py": "PID_MAX = 1 << 14\n", "b.py": "HIGHEST_PID = 16384\n"},
        "private _read": {"untrusted.py": read, "results.py": read},
        "one body": {"untrusted.py": read, "results.py": read.replace("_read", "_read_mark")},
        "one body in": {"untrusted.py": "def shown(value):\n    text = repr(value)\n    return text if len(text) <= 40 "
                                       "else text[:37] + '...'\n",
                        "rules.py": "def _short(value):\n    text = repr(value)\n    return text if len(text) <= 60 "
                                    "else text[:57] + '...'\n"},
        "value 'accelrun.stop'": {"a.py": "STOP = 'accelrun.stop'\n", "b.py": "COMMAND = 'accelrun.stop'\n"},
    }
    for words, sources in cases.items():
        assert any(found.startswith(words) for found in module_doubles(sources)), (words, module_doubles(sources))
    assert module_doubles({"packing.py": "IGNORE = -100\n", "chunked_loss.py": "from packing import IGNORE\n",
                           "a.py": "REPO = 1\nWIDTH = 8\n", "b.py": "REPO = 2\nCHUNKS = 8\n"}) == []


# ---- Run's contract, observed from launches ----------------------------------------------------------------


def test_run_refuses_a_namespace_without_its_flags():
    """A recipe author who forgets add_run_args() learns it at once, by name, not from an AttributeError later."""
    probe = ("import argparse, sys; sys.path.insert(0, 'src'); from accelrun import Run\n"
             "Run('x', argparse.Namespace(batch_size=8))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "call add_run_args(parser, ...)" in result.stderr, result.stderr[-2000:]


def test_accelrun_is_an_installed_versioned_package(tmp_path):
    """Issue 43: `import accelrun` works from any directory (the README's install command installs it), its version
    is the one pyproject.toml builds, and importing it imports no torch."""
    probe = "import accelrun, sys; print(accelrun.__version__, 'torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    version, torch_loaded = result.stdout.split()
    assert result.returncode == 0 and torch_loaded == "False", result.stderr
    metadata = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('accelrun'))"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert metadata.stdout.strip() == version, (metadata.stdout, metadata.stderr)


def test_the_changelogs_newest_entry_is_the_packages_version():
    """Issue 53: the version moves with the package, and CHANGELOG.md says what each one changed: its newest entry
    (the first `## X.Y.Z` heading) is accelrun.__version__, and no version is listed twice."""
    import accelrun

    listed = re.findall(r"^## (\d+\.\d+\.\d+)\s*$", (REPO / "CHANGELOG.md").read_text(), flags=re.M)
    assert listed and listed[0] == accelrun.__version__, (listed[:3], accelrun.__version__)
    assert len(listed) == len(set(listed)), listed
    assert [tuple(map(int, v.split("."))) for v in listed] == sorted(
        (tuple(map(int, v.split("."))) for v in listed), reverse=True), listed
