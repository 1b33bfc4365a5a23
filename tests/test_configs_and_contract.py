"""Quick checks: configs parse with accelerate's own loader, are commented, and recipes keep the contract."""

import ast
import datetime
import json
import re
import subprocess
import sys

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from launching import CONFIG_DIR, CONFIG_FILES, REPO, load_yaml

TRAINING_RECIPES = sorted((REPO / "recipes").glob("*.py"))
RECIPES = TRAINING_RECIPES + sorted((REPO / "recipes" / "quickstart").glob("*.py"))
RUNKIT = sorted((REPO / "recipes" / "runkit").glob("*.py"))


def imports_run(path):
    """Whether a recipe imports the Run object from runkit (it is then built on Run and keeps its loop shape)."""
    return any(isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "runkit"
               and any(alias.name == "Run" for alias in node.names) for node in ast.walk(ast.parse(path.read_text())))


RUN_RECIPES = [p for p in TRAINING_RECIPES if imports_run(p)]


def test_the_promised_configs_exist():
    assert set(CONFIG_FILES) >= {"cpu.yaml", "1gpu.yaml", "2gpu.yaml", "multinode.yaml", "deepspeed_zero1.yaml",
                                "deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "deepspeed_zero3_offload.yaml",
                                "fsdp.yaml", "1gpu_compile.yaml", "2gpu_compile.yaml"}


@pytest.mark.parametrize("config", CONFIG_FILES)
def test_config_parses_with_accelerates_loader(config):
    cfg = load_config_from_file(str(CONFIG_DIR / config))
    assert cfg.compute_environment.value == "LOCAL_MACHINE"
    raw = load_yaml(config)
    ds = raw.get("deepspeed_config") or {}
    # An optimizer/scheduler block forces DummyOptim; 'auto' sizes need a hidden_size a CNN lacks.
    assert not {"optimizer", "scheduler"} & set(ds), "DeepSpeed optimizer block breaks the recipe contract"
    assert "auto" not in map(str, ds.values())
    if raw["distributed_type"] == "FSDP":
        assert raw["fsdp_config"]["fsdp_version"] == 2
    if raw["distributed_type"] == "DEEPSPEED":
        # Every DeepSpeed setting in one JSON next to the YAML (accelerate refuses a mix of the two).
        assert set(ds) <= {"deepspeed_config_file", "zero3_init_flag"} and "mixed_precision" not in raw
        js = json.loads((REPO / ds["deepspeed_config_file"]).read_text())
        assert not {"optimizer", "scheduler"} & set(js), "DeepSpeed optimizer block breaks the recipe contract"
        # 'auto' only where accelerate fills it from the recipe (batch, accumulation, clipping), never from
        # a transformer's hidden_size, which a CNN lacks.
        assert {k for k, v in js.items() if v == "auto"} <= {"train_batch_size", "train_micro_batch_size_per_gpu",
                                                           "gradient_accumulation_steps", "gradient_clipping"}
        assert "auto" not in map(str, js["zero_optimization"].values())
        zero = js["zero_optimization"]
        assert zero["stage"] == int(re.search(r"zero(\d)", config).group(1))
        assert js["communication_data_type"] == "fp32" and zero["overlap_comm"] is True
        if zero["stage"] == 3:
            assert zero["stage3_gather_16bit_weights_on_model_save"] is True


@pytest.mark.parametrize("config", CONFIG_FILES)
def test_every_key_has_a_comment(config):
    for line in (CONFIG_DIR / config).read_text().splitlines():
        if re.match(r"^\s*[A-Za-z_0-9]+:", line):
            assert "#" in line, f"{config}: key without a comment: {line!r}"


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


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_contract(recipe):
    assert contract_violations(recipe.read_text()) == set(), FORBIDDEN


def test_contract_check_catches_violations():
    assert contract_violations("import torch.distributed as dist") == {"torch.distributed"}
    assert contract_violations("from torch.utils.data import DistributedSampler") == {"DistributedSampler"}
    wrapped = "model = torch.nn.parallel.DistributedDataParallel(model)"
    assert contract_violations(wrapped) == {"DistributedDataParallel"}
    assert contract_violations("x = x.cuda()") == {".cuda()"}
    assert contract_violations("x = x.to(accelerator.device)") == set()


@pytest.mark.parametrize("recipe", TRAINING_RECIPES, ids=lambda p: p.name)
def test_unknown_recipe_flag_is_a_clear_error(recipe):
    result = subprocess.run([sys.executable, str(recipe), "--bogus-flag"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "unrecognized arguments: --bogus-flag" in result.stderr


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


def project_imports(source):
    """Names a recipe imports from the project's own modules (runkit)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "runkit":
            names += [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.split(".")[0] == "runkit"]
    return names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_is_one_readable_file(recipe):
    """One recipe, readable in one sitting: a reviewer's rule, not a line count (ruff, in pyproject.toml, keeps the
    style). What can be counted: a recipe leans on a handful of run services, not on the whole of runkit."""
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


@pytest.mark.parametrize("module", RUNKIT, ids=lambda p: p.name)
def test_runkit_module_owns_one_concern(module):
    tree = ast.parse(module.read_text())
    doc = ast.get_docstring(tree)
    assert doc and len(doc) > 80, f"{module.name}: a docstring that says what it owns"


@pytest.mark.parametrize("recipe", TRAINING_RECIPES, ids=lambda p: p.name)
def test_help_shows_defaults_and_refuses_abbreviations(recipe):
    result = subprocess.run([sys.executable, str(recipe), "--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "(default:" in result.stdout
    flag = "--epoch" if "--epochs" in result.stdout else "--output-di"
    abbreviated = subprocess.run([sys.executable, str(recipe), flag, "1"], cwd=REPO, capture_output=True, text=True,
                                 timeout=120)
    assert abbreviated.returncode == 2 and "unrecognized arguments" in abbreviated.stderr


def test_every_flag_has_help():
    for recipe in TRAINING_RECIPES + RUNKIT:
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


def test_readme_pitch_names_exactly_the_accelerate_calls():
    line = next(text for text in (REPO / "README.md").read_text().splitlines()
                if text.startswith("Accelerate calls in the recipes:"))
    named = set(re.findall(r"`(accelerator\.[a-z_]+)`", line))
    assert named == accelerate_calls(RECIPES), (named ^ accelerate_calls(RECIPES))
    assert "`Accelerator(...)`" in line


def test_no_config_overrides_the_gpus_slurm_assigned(tmp_path):
    """CUDA_VISIBLE_DEVICES (set by Slurm, or by the user) reaches the worker unchanged: no shipped config
    names its own GPU ids (1gpu.yaml once said '0' and took GPU 0 whatever Slurm had assigned)."""
    assert all(load_yaml(c).get("gpu_ids", "all") == "all" for c in CONFIG_FILES)
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nprint('visible=' + os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>'))\n")
    result = subprocess.run(["accelerate", "launch", "--config_file", str(CONFIG_DIR / "1gpu.yaml"), str(probe)],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "visible=1" in result.stdout, result.stdout
