"""The documentation holds together: README stays a front page, its links resolve, every
summary.json key the recipes write is defined in docs/measuring.md, each measured result is stated
once (docs/recipes.md, with the docstrings' one-line Result), the code a page cites is where it says, and what a
new user tripped on stays fixed (set-up before the commands, where bf16 on a CPU is fast, ignored run outputs,
requirements' comments). Quick: reads files only."""

import ast
import re
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = ["configs", "slurm", "checkpoints", "measuring", "troubleshooting",  # issue #13
         "recipes", "writing-a-recipe", "install"]  # issues #24, #41
README_MAX_LINES = 260

# Every key the recipes write into summary.json (src/accelrun/run.py, reporting.py, timing.py and
# the recipes' own extras), each of which docs/measuring.md must define under "Summary fields".
SUMMARY_KEYS = [
    # identity
    "recipe", "distributed_type", "world_size", "mixed_precision", "deepspeed_stage", "offload_optimizer",
    "optimizer", "optimizer_implementation", "data_source", "grad_reduce_dtype", "overlap_comm",
    # progress, losses, evaluation
    "steps", "epochs", "resumed_from_step", "resumed_from_world_size", "resume_changes", "first_loss", "final_loss",
    "test_loss", "test_accuracy", "test_samples", "val_accuracy", "val_images", "val_loss",
    # speed and time
    "samples_per_s", "tokens_per_s", "images_per_s", "mfu", "data_time_s", "compute_time_s", "data_fraction",
    "timing", "data_ms", "forward_backward_ms", "optimizer_ms", "other_ms", "optimizer_in_backward",
    "micro_batches", "first_step_at", "wall_time_s", "end_of_run", "compiled_graphs",
    # memory and parameters
    "peak_memory_mb", "peak_memory_mb_per_rank", "peak_memory_kind", "peak_memory_reserved_mb_per_rank",
    "param_elements",
    "param_elements_per_rank", "param_checksum_per_rank", "fsdp_units", "model_init",
    "host_peak_gb_at_start_per_rank", "device_peak_gb_at_start_per_rank",
    # checkpoints
    "checkpoints", "saves", "save_write_s", "save_checksum_s", "save_flush_s", "save_publish_s", "resume_verify_s",
    "resume_load_s",
    # recipe extras and arguments
    "preset", "block_size", "train_blocks", "model_state_gb_per_process_estimate", "sample",
    "arch", "image_size", "classes", "base_model", "data_format", "train_examples", "loss_positions_share",
    "gradient_checkpointing", "exported_dtype", "sample_prompt", "sample_prompt_ids", "sample_token_ids",
    "sample_logprobs", "lora_r", "trainable_params", "frozen_dtype", "tokenised_examples", "cut_examples",
    "dropped_examples", "args",
]

INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\".*\")?\s*$", re.M)
CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")


def markdown_files():
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(text):
    """The text without fenced code blocks and inline code, where brackets are not links."""
    kept, fenced = [], None
    for line in text.splitlines():
        fence = re.match(r"\s{0,3}(```+|~~~+)", line)
        if fence and (fenced is None or fence.group(1)[0] == fenced[0] and len(fence.group(1)) >= len(fenced)):
            fenced = None if fenced else fence.group(1)
            kept.append("")
            continue
        kept.append("" if fenced else CODE_SPAN.sub("", line))
    return "\n".join(kept)


def links(path):
    text = prose(path.read_text(encoding="utf-8"))
    return INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = CODE_SPAN.sub(lambda m: m.group(0).strip("`"), heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings_raw(path):
    """Headings with their code spans kept (prose() removes code spans, which headings may hold)."""
    out, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if re.match(r"\s{0,3}(```|~~~)", line):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            out.append(match.group(1))
    return out


def anchor_set(path):
    found, seen = set(), {}
    for heading in headings_raw(path):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; keep it a front page (at most {README_MAX_LINES}) and move depth to docs/")


@pytest.mark.parametrize("page", PAGES)
def test_docs_page_exists_and_is_linked_from_readme(page):
    path = DOCS / f"{page}.md"
    assert path.is_file(), f"docs/{page}.md is missing"
    targets = {urlparse(t).path for t in links(README)}
    assert f"docs/{page}.md" in targets, f"README.md does not link docs/{page}.md"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(path):
    problems = []
    for target in links(path):
        parsed = urlparse(target)
        if parsed.scheme in ("http", "https", "mailto"):
            # A link to this repository's own files on a forge breaks on forks and branches: use a relative one.
            parts = parsed.path.split("/")
            if parsed.netloc.endswith("github.com") and len(parts) > 5 and parts[3] in ("blob", "tree") \
                    and (REPO / "/".join(parts[5:])).exists():
                problems.append(f"{target}: absolute link to a file of this repository; use a relative link")
            continue
        if parsed.scheme or target.startswith("/"):
            problems.append(f"{target}: absolute link; use a path relative to {path.name}")
            continue
        file = path if not parsed.path else (path.parent / unquote(parsed.path)).resolve()
        if not file.exists():
            problems.append(f"{target}: {file.relative_to(REPO) if file.is_relative_to(REPO) else file} does not exist")
            continue
        if not file.is_relative_to(REPO):
            problems.append(f"{target}: points outside the repository")
        elif parsed.fragment and file.suffix == ".md" and parsed.fragment not in anchor_set(file):
            problems.append(f"{target}: no heading #{parsed.fragment} in {file.relative_to(REPO)}")
    assert not problems, f"{path.relative_to(REPO)}:\n  " + "\n  ".join(problems)


def test_every_summary_key_is_defined_in_measuring():
    text = (DOCS / "measuring.md").read_text(encoding="utf-8")
    match = re.search(r"^## Summary fields\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, 'docs/measuring.md has no "## Summary fields" section'
    section = match.group(1)
    missing = [key for key in SUMMARY_KEYS if f"`{key}`" not in section]
    assert not missing, f'not defined under "Summary fields" in docs/measuring.md: {missing}'


# A module of the package a page cites (`src/accelrun/checkpoint/rules.py`, or accelrun/exits.py in prose), and the
# names a citation gives it: "`src/accelrun/X.py`: `a`, `b`" or "`src/accelrun/X.py`, `a`".
CITED_MODULE = re.compile(r"\b(?:src/)?accelrun/([A-Za-z0-9_/]+\.py)\b")
CITED_NAMES = re.compile(r"`src/accelrun/([A-Za-z0-9_/]+\.py)`[:,] ((?:`[A-Za-z_]\w*`(?:, )?)+)")
# Fields only the code that builds summary.json spells out, all together.
SUMMARY_BUILT = {"recipe", "steps", "epochs", "first_loss", "final_loss", "wall_time_s", "args"}


def top_level_names(module):
    """The functions, classes and assigned names a module of the package defines at its top level."""
    names = set()
    for node in ast.parse(module.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_the_code_the_docs_cite_is_where_they_say():
    """Issue 53, item 6: every module of accelrun a page names exists, and a name it gives a module (a function, a
    class, a constant) is defined there, so a page cannot point at a module that was split, renamed or never held it."""
    problems = []
    for path in markdown_files():
        text = path.read_text(encoding="utf-8")
        for rel in sorted(set(CITED_MODULE.findall(text))):
            if not (REPO / "src" / "accelrun" / rel).is_file():
                problems.append(f"{path.relative_to(REPO)}: accelrun/{rel} does not exist")
        for rel, names in CITED_NAMES.findall(text):
            module = REPO / "src" / "accelrun" / rel
            defined = top_level_names(module) if module.is_file() else set()
            missing = [n for n in re.findall(r"`(\w+)`", names) if module.is_file() and n not in defined]
            problems += [f"{path.relative_to(REPO)}: src/accelrun/{rel} defines no {n}" for n in missing]
    assert not problems, "\n".join(problems)


def test_measuring_names_the_module_that_writes_the_summary():
    """Issue 53, item 6: docs/measuring.md's "Summary fields" says which module builds and writes summary.json (it
    said run.py, while reporting.py does both): the modules its opening names hold the dict of the summary's
    fields and the write of summary.json."""
    opening = section((DOCS / "measuring.md").read_text(encoding="utf-8"), "Summary fields").strip().split("\n\n")[0]
    cited = [REPO / "src" / "accelrun" / rel for rel in CITED_MODULE.findall(opening)]
    assert cited, f'"Summary fields" names no module of accelrun: {opening!r}'
    trees = [ast.parse(module.read_text(encoding="utf-8")) for module in cited if module.is_file()]
    nodes = [node for tree in trees for node in ast.walk(tree)]
    builds = any(isinstance(node, ast.Dict) and SUMMARY_BUILT <= {k.value for k in node.keys
                                                                   if isinstance(k, ast.Constant)} for node in nodes)
    writes = any(isinstance(node, ast.Constant) and node.value == "summary.json" for node in nodes)
    assert builds and writes, (f"{[str(m.relative_to(REPO)) for m in cited]}: builds the summary's fields {builds}, "
                               f"writes summary.json {writes}")


def recipe_results():
    """{recipe file name: its docstring's `Result:` line} for every recipe that has one."""
    found = {}
    for path in sorted((REPO / "recipes").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        lines = [line.strip() for line in doc.splitlines() if line.lstrip().startswith("Result:")]
        if lines:
            found[path.name] = lines[0]
    return found


def figures(text):
    """The numbers a result states (99.98%, 5.41, 8.3e-12, -0.98), without dates and file names."""
    text = re.sub(r"\b\d{4}-\d{2}-\d{2}\b|\S+\.(?:md|py)\b|--\S+|\d+-core", " ", text)
    return re.findall(r"-?\d+\.\d+(?:e-?\d+)?%?|\d+e-?\d+|\d+%", text)


def section(text, heading):
    match = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    return match.group(1) if match else ""


def test_each_measured_result_is_stated_once_in_recipes_md():
    """A docstring's Result line points at docs/recipes.md, whose section for the recipe holds the same
    figures and date; the README links there instead of repeating them."""
    results = recipe_results()
    assert {"mnist.py", "gpt.py", "finetune_lm.py"} <= set(results), results
    recipes_md = (DOCS / "recipes.md").read_text(encoding="utf-8")
    readme = README.read_text(encoding="utf-8")
    problems = []
    for name, line in results.items():
        body = section(recipes_md, name)
        if "docs/recipes.md" not in line:
            problems.append(f"{name}: its Result line does not point at docs/recipes.md")
        if not body:
            problems.append(f"{name}: no '## {name}' section in docs/recipes.md")
            continue
        for date in re.findall(r"\b\d{4}-\d{2}-\d{2}\b", line):
            if date not in body:
                problems.append(f"{name}: measured {date}, a date its section in docs/recipes.md does not give")
        for figure in figures(line):
            if not re.search(rf"(?<![\w.]){re.escape(figure)}(?![\w])", body):
                problems.append(f"{name}: {figure} is not in its section of docs/recipes.md")
            distinctive = "." in figure  # 99.98%, 5.41, 8.3e-12; not 100% or 1e5, which other prose may hold
            if distinctive and re.search(rf"(?<![\w.-]){re.escape(figure)}(?![\w])", readme):
                problems.append(f"{name}: README.md repeats {figure}; link docs/recipes.md instead")
    assert not problems, "\n".join(problems)


def test_figures_finds_the_numbers_of_a_result():
    assert figures("Result: m = 1.99, n = -0.98 in 160 steps, measured 2026-11-22, 2-core CPU (docs/recipes.md).") == [
        "1.99", "-0.98"]
    assert figures("Result: 99.98% on --preset tiny, error 8.3e-12 at N = 1e5 (docs/recipes.md)") == [
        "99.98%", "8.3e-12", "1e5"]


def test_setup_advice_comes_before_the_first_command():
    """A new user follows the README from the top: the virtual environment and where a CPU-only torch comes from are
    said before the first command, which itself installs first; docs/install.md, which the README links there, gives
    the CPU index and what happens when it does not answer before its first command that installs the requirements."""
    text = README.read_text(encoding="utf-8")
    before = text[:text.index("```bash")]
    for advice in ("python3 -m venv", "--index-url https://download.pytorch.org/whl/cpu", "(docs/install.md)"):
        assert advice in before, f"README.md: say {advice!r} before the first command, not after it"
    first = text[text.index("```bash"):].split("\n")[1]
    assert first.startswith("python3 -m pip install -r requirements.txt && "), "the first command installs first"
    install = (DOCS / "install.md").read_text(encoding="utf-8")
    first_command = re.search(r"^```bash\n(?:.*\n)*?.*pip install -r requirements\.txt", install, re.M)
    assert first_command, "docs/install.md has no command block that installs requirements.txt"
    for advice in ("python3 -m venv", "--index-url https://download.pytorch.org/whl/cpu", "--isolated", "--retries",
                   "--timeout", "cuda-bindings"):
        assert advice in install[:first_command.start()], f"docs/install.md: say {advice!r} before its first command"


def test_readme_front_page_has_two_commands_and_the_map_in_40_lines():
    """Issue 41, item 11: the first command was at line 39, after 20 lines of pip advice, with a 778-character list of
    accelerate calls at line 11 and the map at line 194. Now within the first 40 lines: the two commands of the front
    page (one that installs and trains MNIST, one that installs and runs the tests, as .ci/run does), the fine-tune a
    two-GPU owner came for, and the map of the repository; no line of prose (tables aside) runs past 300 characters."""
    lines = README.read_text(encoding="utf-8").splitlines()
    top = "\n".join(lines[:40])
    commands = re.findall(r"^```bash\n(.*?)^```", top, re.M | re.S)
    assert len(commands) == 3, commands
    assert re.search(r"pip install -r requirements\.txt && .*accelerate launch --config_file accelerate_configs/\S+"
                     r"\.yaml .*recipes/mnist\.py", commands[0]), commands[0]
    ci = (REPO / ".ci" / "run").read_text()
    assert all(line in ci for line in commands[1].strip().splitlines()), commands[1]  # what CI runs, line for line
    assert re.search(r"accelerate launch --config_file accelerate_configs/2gpu\.yaml recipes/finetune_lm\.py",
                     commands[2]) and "--model" in commands[2], commands[2]
    the_map = re.search(r"^## The map\n\n```\n(.*?)^```", top, re.M | re.S)
    assert the_map, "no map in the first 40 lines"
    for place in ("recipes/", "src/accelrun/", "accelerate_configs/", "cpu_route/", "launch/", "docs/", "tests/"):
        assert re.search(rf"^{re.escape(place)}", the_map.group(1), re.M), place
    text = [line for line in prose(README.read_text(encoding="utf-8")).splitlines() if not line.startswith("|")]
    assert max(map(len, text)) <= 300, max(text, key=len)  # a table's row may be long: it is one entry


def test_the_docs_recipe_lists_name_every_training_recipe():
    """Issue 41, item 10: docs/checkpoints.md's and docs/measuring.md's "Every training recipe (...)" left out
    finetune_lm: each such list names every recipe built on Run (the ones that import it)."""
    training = {p.stem for p in (REPO / "recipes").glob("*.py") if re.search(r"^from accelrun import .*\bRun\b",
                                                                               p.read_text(), re.M)}
    assert {"mnist", "gpt", "resnet", "linear_regression", "finetune_lm"} <= training, training
    lists = [(path.name, set(re.findall(r"`(\w+)`", match)))
             for path in markdown_files() for match in re.findall(r"[Ee]very training recipe \(([^)]*)\)",
                                                                  path.read_text(encoding="utf-8"))]
    assert len(lists) >= 2 and all(names == training for _, names in lists), lists


def test_checkpoints_and_troubleshooting_agree_on_what_the_first_line_names():
    """Issue 41, item 10: docs/checkpoints.md said the first line names the launcher's pid under accelerate launch,
    docs/troubleshooting.md the stop command; the code (stopping.how_to_stop) names the command, which signals the
    main process. Both pages now say the command, and neither says the launcher's pid is what the first line names."""
    pages = {name: " ".join((DOCS / name).read_text(encoding="utf-8").split())
             for name in ("checkpoints.md", "troubleshooting.md")}
    said = "stop with a checkpoint: python3 -m accelrun.stop DIR"
    for name, text in pages.items():
        assert said in text.replace("`", ""), name
        assert not re.search(r"launcher's pid \(the one the first line names\)", text), name


def paragraphs(text):
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def test_cpu_bf16_speed_claims_say_where_they_hold():
    """bf16 on a CPU is several times slower than fp32 without bf16 instructions and faster with AMX or
    AVX512-BF16: a paragraph that says either must say which CPUs it means."""
    texts = {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in markdown_files()}
    for path in sorted((REPO / "recipes").glob("*.py")):
        texts[str(path.relative_to(REPO))] = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    vague = [f"{name}: {p.strip()[:120]!r}" for name, text in texts.items() for p in paragraphs(text)
             if re.search(r"bf16|bfloat16", p, re.I) and re.search(r"\bCPUs?\b", p)
             and re.search(r"\b(slower|faster)\b", p) and not re.search(r"\bAMX\b|AVX512", p, re.I)]
    assert not vague, "say where it holds (CPUs with AMX / AVX512-BF16, or without):\n" + "\n".join(vague)


def test_run_outputs_are_ignored_by_git():
    """The default output directory and the docs' --checkpoint-dir ckpt stay out of `git status`."""
    patterns = {line.strip() for line in (REPO / ".gitignore").read_text(encoding="utf-8").splitlines()}
    for folder in ("runs", "ckpt"):
        assert patterns & {folder, f"{folder}/", f"/{folder}", f"/{folder}/"}, f".gitignore lacks /{folder}/"


def test_requirements_comments_agree_with_the_imports():
    """A comment that says no recipe imports a package is true."""
    imported = set()
    for path in sorted((REPO / "recipes").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    comments, wrong = [], []
    for line in (REPO / "requirements.txt").read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("#"):
            comments.append(line)
            continue
        name = re.match(r"\s*([A-Za-z0-9_.-]*)", line).group(1)
        said = " ".join(comments + [line.partition("#")[2]])
        comments = []
        if name and re.search(r"no recipe imports", said, re.I) and name.replace("-", "_").lower() in imported:
            wrong.append(name)
    assert not wrong, f"requirements.txt says no recipe imports {wrong}, but one does"
