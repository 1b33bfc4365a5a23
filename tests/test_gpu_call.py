"""The one-command GPU check on a CPU (issue 42, item 5; issue 53, item 3): gpu_check/run.sh, gpu_call.py,
gpu_wheels.py, pack_report.py and the table's stages in gpu_table.py, with the GPU work stood in for by small scripts.

What is checked: the install step (a missing wheel, a missing import: one line, exit 2; nothing installed into this
Python: the wheels go into a folder), the preparation's dependency rules against the image's package list, the
budget split, the pack's cap and record (a stopped pack leaves no process, and says what it did not reach), the
table's order (fine-tunes first), its files rewritten as each part ends, a part cut by the budget still reporting,
and a dry run of the one command with CUDA absent. Quick: no recipe is launched.
"""

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import venv
import zipfile
from pathlib import Path

import pytest

from launching import REPO, run_command

sys.path.insert(0, str(REPO / "gpu_check"))
import gpu_call  # noqa: E402
import gpu_table  # noqa: E402
import gpu_wheels  # noqa: E402

NO_CUDA = {"CUDA_VISIBLE_DEVICES": ""}


def without_pythonpath():
    """This environment without PYTHONPATH: what a Python finds is then its own (its venv's, its site-packages)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def fake_wheel(folder, name, code, requires=()):
    """A pure-Python wheel of one module `name` (with '-' as '_') whose __init__ is `code`."""
    module = name.replace("-", "_")
    path = folder / f"{module}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{module}/__init__.py", code)
        whl.writestr(f"{module}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
                     + "".join(f"Requires-Dist: {r}\n" for r in requires))
        whl.writestr(f"{module}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                     "Tag: py3-none-any\n")
        whl.writestr(f"{module}-1.0.dist-info/RECORD", "")
    return path


# ---- the install -----------------------------------------------------------------------------------------------
def test_install_names_a_missing_wheel_in_one_line_and_exits_2(tmp_path):
    """The GPU node's install with .gpu/w lacking one of CARRY's wheels: one line naming it and what to do,
    exit 2, nothing installed. Also when there is no .gpu/w at all (it is git-ignored: a fresh clone has none)."""
    wheels = tmp_path / "w"
    wheels.mkdir()
    for name in gpu_wheels.CARRY:
        if name != "dill":
            (wheels / f"{name.replace('-', '_')}-1.0-py3-none-any.whl").touch()
    for folder, named in ((wheels, "has no wheel for dill"), (tmp_path / "absent", "there is no")):
        result = subprocess.run([sys.executable, "gpu_check/gpu_wheels.py", "install", "--wheels", str(folder),
                                 "--target", str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True)
        assert result.returncode == 2 and result.stdout == "", result
        [line] = result.stderr.splitlines()
        assert line.startswith(f"error: {folder} {named}" if folder == wheels else f"error: there is no {folder}")
        assert line.endswith("run `bash gpu_check/run.sh prepare` where pip works, then copy .gpu/w here "
                             "(README, 'On a GPU')"), line
        assert not (tmp_path / "site").exists()
    (wheels / "dill-0.9-py3-none-any.whl").touch()
    (wheels / "dill-1.0-py3-none-any.whl").touch()
    with pytest.raises(gpu_wheels.Refused, match="holds two versions of dill: keep one"):
        gpu_wheels.to_install(wheels)


def test_install_checks_every_import_after_the_install(tmp_path, monkeypatch, capsys):
    """pip installs with --no-deps whatever is missing; the import check then names the module that fails and the
    one it lacked, in one line (exit 2). A requirement the installed versions do not meet is a warning."""
    wheels, site = tmp_path / "w", tmp_path / "site"
    wheels.mkdir()
    fake_wheel(wheels, "gpucheck-ok", "VALUE = 1\n", requires=["gpucheck-absent>=2", "extra-only; extra == 'dev'"])
    fake_wheel(wheels, "gpucheck-broken", "import gpucheck_lacking  # a dependency nobody carried\n")
    monkeypatch.setattr(gpu_wheels, "CARRY", {"gpucheck-ok": "", "gpucheck-broken": ""})
    monkeypatch.setattr(gpu_wheels, "IMPORTS", ["gpucheck_ok", "gpucheck_broken"])
    assert gpu_wheels.main(["install", "--wheels", str(wheels), "--target", str(site)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: import gpucheck_broken fails after the install (ModuleNotFoundError: No module "
                           "named 'gpucheck_lacking'): this machine lacks gpucheck_lacking: add its distribution to "
                           "CARRY in gpu_check/gpu_wheels.py"), line
    assert (site / "gpucheck_ok" / "__init__.py").exists()  # installed; it imports
    result = gpu_wheels.import_check(sys.executable, ["gpucheck_ok"], ["gpucheck-ok"], site)
    assert result == {"failed": {}, "unmet": ["gpucheck-ok needs gpucheck-absent>=2, and this machine has none"]}


def test_prepare_follows_each_requirement_to_the_image_or_a_carried_wheel(tmp_path):
    """The preparation's rule for every requirement of a carried wheel: met by another carried wheel (at a version
    that satisfies it), by the GPU image (its version checked where the list gives one), or fetched when CARRY
    names it; anything else stops the preparation, naming it. CARRY itself holds nothing the image has."""
    metadata = {"deepspeed": ("0.19.8", ["hjson", "pydantic>=2.0.0", "torch>=2.0.0", "einops", "nope; extra == 'dev'",
                                         "winonly; sys_platform == 'win32'"]),
                "pydantic": ("2.13.4", ["pydantic-core==2.46.4", "typing-extensions>=4.14.1"]),
                "pydantic-core": ("2.46.0", []), "bitsandbytes": ("0.50.2", ["torch<3,>=2.12", "scipy-absent"])}
    carry = {"deepspeed": "0.19.8", "pydantic": "2.13.4", "pydantic-core": "", "hjson": "", "bitsandbytes": "0.50.2",
             "einops": ""}
    image = {"torch": "2.11.0", "einops": "", "typing-extensions": ""}
    to_fetch, problems, unchecked = gpu_wheels.closure(metadata, carry, image)
    assert to_fetch == {"hjson": ""}
    assert problems == ["bitsandbytes needs torch<3,>=2.12, and the GPU image has 2.11.0",
                        "bitsandbytes needs scipy-absent, which the GPU image lacks and CARRY does not name",
                        "pydantic needs pydantic-core==2.46.4, and the carried wheel is 2.46.0",
                        "CARRY names einops, which the GPU image has (carry only what it lacks)"]
    assert unchecked == ["pydantic needs typing-extensions>=4.14.1 (the image's version is checked on the machine)"]
    # the real list: CARRY carries only what the image lacks, and the image has what CARRY's imports expect of it
    image = gpu_wheels.read_image()
    assert image["torch"] == "2.11.0" and image["transformers"] == "5.17.0" and image["accelerate"] == "1.15.0"
    assert gpu_wheels.closure({}, gpu_wheels.CARRY, image) == ({}, [], [])
    assert {"einops", "msgpack", "pyarrow", "xxhash", "pandas", "pytest-xdist"} <= set(image)
    wheel = fake_wheel(tmp_path, "gpucheck-meta", "", requires=["numpy>=2"])
    assert gpu_wheels.wheel_metadata(wheel) == ("gpucheck-meta", "1.0", ["numpy>=2"])


# ---- the budget and the pack -----------------------------------------------------------------------------------
def test_budget_split_gives_the_table_what_the_pack_does_not_take():
    """The whole call within the caller's budget: the install as it went, the pack capped (each launch inside the
    cap), END_S kept; a lower budget shortens the table rather than losing it."""
    split = gpu_call.split_budget(540, 20)
    assert split == {"budget": 540, "install": 20, "pack": 175.0, "launch": 145.0, "table": 325.0, "end": 20}
    tables = []
    for budget in (600, 540, 420, 300, 200):
        split = gpu_call.split_budget(budget, 25)
        assert split["install"] + split["pack"] + split["table"] + split["end"] == pytest.approx(budget)
        assert gpu_call.PACK_MIN_S <= split["pack"] <= gpu_call.PACK_MAX_S
        assert 0 < split["launch"] == split["pack"] - gpu_call.PACK_STARTUP_S
        tables.append(split["table"])
    assert tables == sorted(tables, reverse=True) and tables[-1] >= gpu_call.TABLE_MIN_S
    assert gpu_call.split_budget(540, 20, only="table")["pack"] == 0 == gpu_call.split_budget(540, 20,
                                                                                            only="pack")["table"]
    assert gpu_call.split_budget(540, 20, only="table")["table"] == 500


# A pytest run's stand-in that never ends, with a child in a session of its own (as the pack's launches are).
HANGS = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
         "start_new_session=True); open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(600)")


def test_pack_is_stopped_at_its_cap_and_leaves_no_process(tmp_path):
    """At its cap the pack gets SIGINT (pytest then writes its summary) and SIGKILL later; every process it started,
    in whatever session, carries the phase's mark and is ended with it."""
    child = tmp_path / "child.pid"
    code, stopped = gpu_call.supervise([sys.executable, "-c", HANGS, str(child)], {}, cap_s=2, stop=signal.SIGINT,
                                       log_path=tmp_path / "pack.log")
    assert stopped and code != 0
    pid = int(child.read_text())

    def gone():  # exited (a zombie until its new parent reaps it) or reaped
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True
    deadline = time.monotonic() + 30  # SIGKILL is delivered at once: this only waits for the exit to finish
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(), f"the pack's child {pid} outlived the pack"


def test_pack_record_says_what_passed_failed_and_was_not_reached(tmp_path):
    """gpu_check/pack_report.py records the collected tests and each outcome as it comes; a pack cut short (here by
    -x after a failure) reads back with what it did not reach named."""
    (tmp_path / "test_three.py").write_text("def test_a():\n    pass\n\n\ndef test_b():\n    assert False\n\n\n"
                                            "def test_c():\n    pass\n")
    record = tmp_path / "pack.jsonl"
    code, output = run_command([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p",
                                "pack_report", "test_three.py"], cwd=tmp_path, timeout=120,
                               env={"GPU_PACK_RECORD": str(record), "PYTHONPATH": str(REPO / "gpu_check")})
    assert code == 1, output
    summary = gpu_call.pack_summary(record)
    assert summary == {"collected": ["test_three.py::test_a", "test_three.py::test_b", "test_three.py::test_c"],
                       "outcomes": {"test_three.py::test_a": "passed", "test_three.py::test_b": "failed"},
                       "not_reached": ["test_three.py::test_c"]}
    lines = gpu_call.pack_lines(summary, code, False, 3.0, 8)
    assert lines == ["pack: 1 failed, 1 passed, 1 not reached, of 3 collected (pytest exit 1 in 3 s, 8 workers; "
                     "pack.log, pack.jsonl)", "- failed: test_three.py::test_b", "- not reached: test_three.py::test_c"]
    cmd = gpu_call.pack_command(8, "python3")  # the GPU file alone: no worker collects the whole suite
    assert cmd[3:6] == ["tests/test_gpu.py", "-m", "gpu"] and cmd[cmd.index("-n") + 1] == "8"


# ---- the table's order, its files per part, a part cut by the budget -------------------------------------------
def test_parts_run_the_fine_tunes_first():
    """PARTS: the fine-tune parts (and the places of those to come) before everything the first contact measured."""
    first = [p.folder for p in gpu_table.PARTS if p.first]
    assert first == ["finetune-full", "finetune-lora", "finetune-padded", "finetune-lora-zero3",
                     "finetune-chunked-loss", "finetune-qlora", "finetune-flex-4096", "finetune-dense-4096",
                     "finetune-padded-4096", "finetune-flex-8192", "finetune-dense-8192", "finetune-padded-8192",
                     "finetune-chunk-tokens-8192", "finetune-chunks-8-8192", "dpo-lora",
                     *ISSUE_50_PARTS]
    assert [p.folder for p in gpu_table.PARTS][:len(first)] == first
    assert [name for name, _ in gpu_table.stages(gpu_table.selected(["mnist", "finetune-padded"]))] == \
        ["fine-tune", "the rest"]
    # what the budget reaches by the estimates, in order (a warm-up for a part never reached would waste it)
    parts = {p.folder: p for p in gpu_table.PARTS}
    assert [p.folder for p in gpu_table.reachable(gpu_table.stages(gpu_table.PARTS)[0][1], 200)] == [
        "finetune-full", "finetune-lora", "finetune-padded"]  # 90 + 80 + 35 s; ZeRO-3 LoRA's 60 s would not start
    # a compiled run whose warm-up did not end is left out of its part's command
    argv = gpu_table.part_argv(parts["finetune-full"], 989.0, {}, 1, leave_out=("1gpu_compile.yaml",))
    assert argv[argv.index("--configs") + 1:argv.index("--steps")] == ["1gpu.yaml"]


def test_the_dpo_part_runs_recipes_dpo_on_pairs_written_here(tmp_path, hf):
    """Issue 56: the GPU table's DPO part is bench/benchmark.py --recipe dpo, which launches recipes/dpo.py with LoRA
    r 16 on the 1B shape, 8 pairs a step; the pairs written on the machine (write_preference_pairs) are chat records
    dpo.py reads, every prompt leaving room for its response in the part's blocks of 1024."""
    import argparse

    from transformers import AutoTokenizer

    from accelrun.finetune.preference import load_pairs
    part = next(p for p in gpu_table.PARTS if p.folder == "dpo-lora")
    inputs = {"llama": hf / "model", "pairs": gpu_table.write_preference_pairs(tmp_path / "pairs.jsonl")}
    args = gpu_table.benchmark.parse_args(gpu_table.part_argv(part, 989.0, inputs, 1))
    assert (args.recipe, args.configs, args.batch_size) == ("dpo", ["1gpu.yaml"], 8)
    [(name, _, cmd, _)] = gpu_table.benchmark.plan_runs(args, 1, True, None)
    assert cmd[cmd.index("launch") + 1:].count(str(REPO / "recipes" / "dpo.py")) == 1
    assert " ".join(cmd).endswith(f"--model {hf / 'model'} --data-files {inputs['pairs']} --block-size 1024 "
                                  f"--eval-batches 1 --lora-r 16"), cmd
    flags = argparse.Namespace(data_files=str(inputs["pairs"]), dataset=None, dataset_config=None, seed=0)
    pairs = load_pairs(flags, AutoTokenizer.from_pretrained(hf / "model"), 1024, 8)
    assert pairs.format == "chat" and pairs.cuts == {"pairs": gpu_table.CHATS // 4, "cut_pairs": 0}


def test_issue_55s_comparisons_each_show_their_goal():
    """table.md's lines for the attention parts: flex packed against padded (goal 1.8x) and dense packed (1.3x) at
    each block, flex's peak memory below dense's at 8,192, token chunks against 8 chunks; a ratio not measured says
    so; each part runs the recipe's flags it names (finetune_lm.py's parser takes them)."""
    import shlex
    sys.path.insert(0, str(REPO / "recipes"))
    from finetune_lm import parse_args

    def row(throughput, peak):
        return {"throughput": throughput, "peak_memory_mb_per_rank": [peak]}
    c, e = gpu_table.COMPILED, gpu_table.EAGER
    by = {("finetune-flex-4096", c): row(90.0, 30.0), ("finetune-dense-4096", c): row(60.0, 31.0),
          ("finetune-padded-4096", c): row(40.0, 29.0), ("finetune-flex-8192", c): row(100.0, 30.0),
          ("finetune-dense-8192", c): row(90.0, 40.0), ("finetune-chunk-tokens-8192", e): row(50.0, 20.0)}
    lines = gpu_table.attention_lines(by)
    assert lines == [
        "- fine-tune at 4096 tokens, compiled, real tokens/s: flex packed / padded 2.250 (goal >= 1.8: met), "
        "flex / dense packed 1.500 (goal >= 1.3: met)",
        "- fine-tune at 8192 tokens, compiled, real tokens/s: flex packed / padded - (goal >= 1.8: not measured), "
        "flex / dense packed 1.111 (goal >= 1.3: NOT met); peak memory dense / flex 1.333 (goal >= 1: met) (flex "
        "below dense: above 1)",
        "- fine-tune at 8192 tokens, eager, loss chunks of 8192 tokens / 8 chunks (real tokens/s): - (goal >= 1: not "
        "measured); peak memory 8 chunks / token chunks -"], lines
    assert gpu_table.attention_lines({}) == []
    for part in gpu_table.attention_parts():
        flags = shlex.split(part.args[part.args.index("--recipe-args") + 1].format(llama="m", chats="d"))
        args = parse_args(flags)
        assert args.block_size in gpu_table.BLOCKS and args.batch_size * args.block_size == 8192, part.folder
        assert args.attention == ("sdpa" if "dense" in part.folder or "padded" in part.folder else "flex"), part
        assert args.packing == ("padded" not in part.folder), part.folder


# Issue 50, item 4: --optim-states on the 1B shape and the largest full fine-tune the planner fits on one GPU, then
# FP8 against bf16 on that fine-tune.
ISSUE_50_PARTS = [*(f"optim-states-{shape}-{states}" for shape in ("1b", "largest") for states in ("fp32", "bf16",
                                                                                                    "8bit")),
                  "finetune-fp8"]


def test_issue_50s_parts_are_planned_with_the_commands_they_should_run(tmp_path, monkeypatch):
    """The dry run lists the optimizer-state parts and the FP8 part in order with their goals, and names the largest
    full fine-tune bench/lm_memory.py fits on one GPU of 80 GB (Llama-3.2-3B: 8B takes 95.8 GB even with 8-bit
    states). Each part's runs, as bench/benchmark.py launches them on a one-GPU machine: the optimizer-state parts one
    eager run each with --optim-states as named and --gradient-checkpointing, on the model input of their shape; the
    FP8 pair fsdp_fp8.yaml with --num_processes 1 twice (the bf16 variant is not left out on one GPU), the two
    commands the same but for --mixed_precision fp8 / bf16; every run parses with finetune_lm.py's own parser."""
    sys.path[:0] = [str(REPO / "recipes"), str(REPO / "bench")]
    import lm_memory
    from finetune_lm import parse_args
    code, output = run_command([sys.executable, "gpu_check/gpu_table.py", "--dry-run", "--budget-s", "2000"],
                               env=NO_CUDA, timeout=120)
    assert code == 0, output
    at = [output.index(f". {part} ") for part in ["dpo-lora", *ISSUE_50_PARTS, "gpt"]]
    assert at == sorted(at), output
    for part in ISSUE_50_PARTS:
        goal = output[output.index(f". {part} "):].split("\n", 2)[1].strip()
        assert goal == ("goal: FP8 / bf16 >= 1.15x real tokens/s" if part == "finetune-fp8" else
                        "goal: peak memory within 15% of the planner's figure for this run"), goal
    assert lm_memory.largest_full(gpus=1, gpu_gb=80.0, tokens=gpu_table.STEP_TOKENS) == (
        "Llama-3.2-3B", ["full", "full bf16 states", "full 8-bit states"])
    assert lm_memory.largest_full(gpus=1, gpu_gb=96.0, tokens=8192) == ("Llama-3.1-8B", ["full 8-bit states"])
    assert ("fits on one GPU of 80 GB less 15% (on the machine: of its GPU's memory): Llama-3.2-3B, --optim-states "
            "fp32, bf16, 8bit (FP8 with fp32)") in output
    # the table's largest leaves the memory goal's margin: 8B's 8-bit plan fits 96 GB, not 96 GB less 15%
    assert gpu_table.large_shape(96.0)[0] == "Llama-3.2-3B"
    name, kind, shape, fits = gpu_table.large_shape(80.0)
    assert (name, kind, fits) == ("Llama-3.2-3B", "LlamaConfig", ["fp32", "bf16", "8bit"])
    assert shape["hidden_size"] == 3072 and "vocab_size" not in shape  # the tests' tokenizer's, as the 1B's

    inputs = {"llama": tmp_path / "llama", "chats": tmp_path / "c.jsonl", "large": tmp_path / "large",
              "large_states": "bf16"}
    parts = {p.folder: p for p in gpu_table.PARTS}
    runs = {}
    for folder in ISSUE_50_PARTS:
        args = gpu_table.benchmark.parse_args(gpu_table.part_command(parts[folder], tmp_path, 989.0, inputs, 1)[2:])
        assert args.num_processes == 1 and args.steps == 10, folder  # one GPU, on any machine
        runs[folder] = {name: cmd for name, _, cmd, _ in gpu_table.benchmark.plan_runs(args, 1, True, None)}
    for folder in ISSUE_50_PARTS[:-1]:
        (config, cmd), = runs[folder].items()
        recipe = parse_args(cmd[cmd.index(str(REPO / "recipes" / "finetune_lm.py")) + 1:])
        assert config == "1gpu.yaml" and cmd[cmd.index("--mixed_precision") + 1] == "bf16", folder
        assert recipe.optim_states == folder.rsplit("-", 1)[1] and recipe.gradient_checkpointing, folder
        assert recipe.model == str(inputs["llama" if "-1b-" in folder else "large"]) and recipe.packing, folder
        assert recipe.batch_size * recipe.block_size == gpu_table.STEP_TOKENS  # the planner's tokens
    assert "--optim-states 8bit" in " ".join(runs["optim-states-largest-8bit"]["1gpu.yaml"])
    fp8, bf16 = (runs["finetune-fp8"][config] for config in ("fsdp_fp8.yaml", "fsdp_fp8.yaml+bf16"))
    port = fp8.index("--main_process_port") + 1
    differ = [(a, b) for i, (a, b) in enumerate(zip(fp8, bf16)) if a != b and i != port]
    assert len(fp8) == len(bf16) and differ == [("fp8", "bf16")], differ
    assert fp8[fp8.index("--config_file") + 1] == str(REPO / "accelerate_configs" / "fsdp_fp8.yaml")
    assert fp8[fp8.index("--num_processes") + 1] == "1"
    recipe = parse_args(fp8[fp8.index(str(REPO / "recipes" / "finetune_lm.py")) + 1:])
    assert recipe.model == str(inputs["large"]) and recipe.optim_states == "bf16" and recipe.gradient_checkpointing
    # fp8 is the float8 configs' alone: the benchmark refuses it for another, in one line
    with pytest.raises(SystemExit):
        gpu_table.benchmark.parse_args(["--configs", "fsdp.yaml", "--mixed-precision", "fp8"])


def test_issue_50s_rows_set_each_peak_beside_the_planners_figure(tmp_path, monkeypatch):
    """table.md and table.json from made-up reports: each optimizer-state run's peak (max_memory_allocated, MiB)
    beside the planner's figure for the model it ran (bench/lm_memory.py's shape_parts, one GPU, STEP_TOKENS), the
    goal within 15% judged; FP8 / bf16 real tokens/s against 1.15. A state the planner does not fit on this GPU for the
    largest fine-tune is left out, saying so."""
    sys.path.insert(0, str(REPO / "bench"))
    import lm_memory
    shape = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 320}
    facts = {"models": {"llama": {"parameters": 1_000_000_000, "shape": shape},
                        "large": {"parameters": 3_000_000_000, "shape": {**shape, "hidden_size": 3072}}},
             "largest": {"model": "Llama-3.2-3B", "gpu_gb": 85.5, "states_that_fit": ["bf16", "8bit"]}}
    table = gpu_table.Table(tmp_path / "out", tmp_path / "work", "NVIDIA H100", "2026-11-28", 989.0, 1,
                            [p for p in gpu_table.PARTS if p.folder in ISSUE_50_PARTS])
    table.progress["facts"] = facts
    left = {p.folder: table.planned(p) for p in table.parts}
    assert left["optim-states-largest-fp32"] == ("left out: bench/lm_memory.py does not fit Llama-3.2-3B with "
                                                 "--optim-states fp32 on one GPU of 86 GB")
    assert [f for f, why in left.items() if why] == ["optim-states-largest-fp32"]
    planned = facts["planned_gb"]
    expected = sum(lm_memory.shape_parts(1_000_000_000, shape, "full 8-bit states", 8192, gpus=1).values())
    assert planned["optim-states-1b-8bit"] == pytest.approx(expected)
    assert planned["optim-states-1b-fp32"] - planned["optim-states-1b-8bit"] == pytest.approx(
        8 - lm_memory.STATE_BYTES["8bit"])  # the moments of 1e9 parameters: 8 bytes each against about 2
    assert "optim-states-largest-fp32" not in planned

    def report(*rows):
        return {"results.json": {"table": list(rows), "ratios": {}, "runs": [],
                                 "hardware": {"label": "1 x H100", "host": "h", "torch": "2.11"}}}

    def row(name, throughput, peak_mb):
        return {"name": name, "processes": 1, "unit": "tokens_per_s", "throughput": throughput, "mfu": 0.4,
                "step_ms": 100.0, "peak_memory_mb_per_rank": [peak_mb], "padding_share": 0.0}
    at_plan = planned["optim-states-1b-8bit"] * 1e9 / 2 ** 20  # MiB
    made_up = {"optim-states-1b-8bit": report(row("1gpu.yaml", 9000.0, 1.1 * at_plan)),
               "optim-states-1b-bf16": report(row("1gpu.yaml", 9000.0, 1.2 * planned["optim-states-1b-bf16"] * 1e9
                                                  / 2 ** 20)),
               "finetune-fp8": report(row("fsdp_fp8.yaml", 12000.0, 50000.0), row("fsdp_fp8.yaml+bf16", 10000.0,
                                                                                  50500.0))}
    for folder, files in made_up.items():
        (tmp_path / "work" / folder).mkdir(parents=True)
        (tmp_path / "work" / folder / "results.json").write_text(json.dumps(files["results.json"]))
    text = table.write()
    gb = 1.1 * planned["optim-states-1b-8bit"]
    assert (f"- optimizer states, 1B shape, --optim-states 8bit, one GPU: peak {gb:.1f} GB, the planner's "
            f"{planned['optim-states-1b-8bit']:.1f} GB: measured / planned 1.100 (goal within 15%: met)") in text
    assert "--optim-states bf16, one GPU: peak" in text
    assert "measured / planned 1.200 (goal within 15%: NOT met)" in text
    assert ("- optimizer states, Llama-3.2-3B shape, --optim-states 8bit, one GPU: peak -, the planner's "
            f"{planned['optim-states-largest-8bit']:.1f} GB: measured / planned - (goal within 15%: not measured)") \
        in text
    assert ("- FP8 / bf16, Llama-3.2-3B shape, fsdp_fp8.yaml on one process, compiled (real tokens/s): 1.200 (goal >= "
            "1.15: met)") in text
    assert "- optim-states-largest-fp32: left out: bench/lm_memory.py does not fit Llama-3.2-3B" in text
    data = json.loads((tmp_path / "out" / "table.json").read_text())
    assert data["fp8"] == {"fp8": "fsdp_fp8.yaml", "bf16": "fsdp_fp8.yaml+bf16", "ratio": 1.2, "met": True}
    by_part = {r["part"]: r for r in data["optim_states"]}
    assert by_part["optim-states-1b-8bit"]["met"] is True and by_part["optim-states-1b-bf16"]["met"] is False
    assert by_part["optim-states-1b-8bit"]["ratio"] == pytest.approx(1.1)
    assert "optim-states-largest-fp32" not in by_part  # left out: neither measured nor planned
    # a budget the estimates say never reaches the largest fine-tune's parts: its model is not written for nothing
    every, fp8 = gpu_table.selected(None), next(p for p in table.parts if p.folder == "finetune-fp8")
    assert table.out_of_reach(fp8, every, 540) is True
    assert table.progress["statuses"]["finetune-fp8"] == ("not reached: the estimates put its start beyond the "
                                                          "budget, so its model was not written")
    assert table.out_of_reach(fp8, [fp8], 300) is False  # asked alone (--parts), it is reached
    assert table.out_of_reach(next(p for p in table.parts if p.folder == "optim-states-1b-8bit"), every, 540) is False


def test_the_planners_figures_come_from_the_model_written(tmp_path):
    """model_facts: what the planner's figure needs of a saved model (its parameters, counted on the meta device, and
    its shape, the vocabulary the tokenizer's) from a model write_model saved (here a tiny Llama on the CPU)."""
    from transformers import AutoModelForCausalLM
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "tie_word_embeddings": True}
    tokenizer = gpu_table.write_model(tmp_path / "m", shape, device="cpu")
    facts = gpu_table.model_facts(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert facts == {"parameters": sum(p.numel() for p in model.parameters()),
                     "shape": {**{k: v for k, v in shape.items() if k != "tie_word_embeddings"},
                               "vocab_size": len(tokenizer)}}


STAND_IN = """
import json, os, pathlib, signal, sys, time
part, root = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
with open(root / "ran.txt", "a") as f:
    f.write(part.name + "\\n")
row = {"name": "1gpu.yaml", "processes": 1, "unit": "tokens_per_s", "throughput": 50000.0, "mfu": 0.3,
       "step_ms": 160.0, "peak_memory_mb_per_rank": [30000.0], "padding_share": 0.01}
def report(runs=()):
    part.mkdir(parents=True, exist_ok=True)
    (part / "results.json").write_text(json.dumps({"table": [row], "ratios": {}, "runs": list(runs), "settings": {},
                                                   "hardware": {"label": "1 x H100", "host": "h", "torch": "2.11"}}))
if part.name == "finetune-full":
    report()
elif part.name == "finetune-padded":
    (root / "seen.json").write_text((root / "out" / "table.json").read_text())
    (root / "padded.log").write_text("boom: out of memory\\n")
    report([{"name": "1gpu.yaml", "exit_code": 1, "failed": "boom", "log": str(root / "padded.log")}])
    sys.exit(1)
else:
    signal.signal(signal.SIGTERM, lambda *_: (report(), sys.exit(0)))
    time.sleep(60)
"""


def test_table_writes_each_part_as_it_ends_and_lists_what_it_did_not_reach(tmp_path, monkeypatch, capsys):
    """gpu_table() on a pretend GPU, its parts stood in for: they run in PARTS' order (the fine-tunes first,
    whatever the order asked), table.json and table.md are rewritten the moment each part ends (the next part reads
    them), a failed run's log tail lands in failures.log, a compiled run whose warm-up did not end is left out of
    its part, the part still running at the budget is stopped and its report kept, the parts after it are listed
    as not reached and the parts to come as not built yet; the exit code says the table is incomplete."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gpu_table, "write_inputs", lambda work, parts: ({}, {}))
    monkeypatch.setattr(gpu_table, "START_SHARE", 0.0)  # the stand-ins need no time of their own
    monkeypatch.setattr(gpu_table, "STOP_GRACE_S", 1)
    monkeypatch.chdir(REPO)
    # a part still to come (as QLoRA's was): listed in its place, never run
    monkeypatch.setattr(gpu_table, "PARTS", [dataclasses.replace(p, missing="recipes/finetune_lm.py has no QLoRA yet")
                                             if p.folder == "finetune-qlora" else p for p in gpu_table.PARTS])
    warmed, built = [], []

    def warm_phase(commands, parts, work, gpus, limit_s):
        warmed.append([folder for folder, _ in commands])
        return {"finetune-full: 1gpu_compile.yaml": "stopped after 40 s"} if len(warmed) == 1 else {}

    def part_command(part, work, peak, inputs, gpus, leave_out=()):
        built.append((part.folder, tuple(leave_out)))
        return [sys.executable, "-c", STAND_IN, str(work / part.folder), str(tmp_path)]
    monkeypatch.setattr(gpu_table, "warm_phase", warm_phase)
    monkeypatch.setattr(gpu_table, "part_command", part_command)
    args = argparse.Namespace(out=str(tmp_path / "out"), work=str(tmp_path / "work"), peak_tflops=0.0, no_warm=False,
                              parts=["fsdp-units", "mnist", "gpt", "finetune-qlora", "finetune-padded",
                                     "finetune-full"], budget_s=4.0)  # gpt waits for it: a few seconds
    assert gpu_table.gpu_table(args) == 1
    assert (tmp_path / "ran.txt").read_text().split() == ["finetune-full", "finetune-padded", "gpt"]
    assert warmed == [["finetune-full"], ["gpt"]]  # in each stage the first (the estimates reach no more)
    assert ("finetune-full", ("1gpu_compile.yaml",)) in built  # its unwarmed compiled run left out
    seen = json.loads((tmp_path / "seen.json").read_text())  # what finetune-padded found when it started
    assert seen["statuses"]["finetune-full"].startswith("done") and "finetune-full" in seen["parts"]
    table = json.loads((tmp_path / "out" / "table.json").read_text())
    statuses = table["statuses"]
    assert list(statuses) == ["finetune-full", "finetune-padded", "finetune-qlora", "gpt", "mnist", "fsdp-units"]
    assert statuses["finetune-full"] == ("done; not measured: 1gpu_compile.yaml (its compile warm-up did not end, "
                                         "so it would have compiled inside its measured run)")
    assert statuses["finetune-padded"] == "failed (exit 1): see failures.log"
    assert statuses["finetune-qlora"] == "not built yet: recipes/finetune_lm.py has no QLoRA yet"
    assert statuses["gpt"] == "stopped at the table's budget (the runs it finished are in its report)"
    assert statuses["mnist"].startswith("not reached: ") and statuses["fsdp-units"].startswith("not reached: ")
    assert set(table["parts"]) == {"finetune-full", "finetune-padded", "gpt"}  # the stopped part's report kept
    markdown = (tmp_path / "out" / "table.md").read_text()
    assert "| gpt | 1gpu.yaml | 1 | 50000 tokens/s | 30.0% |" in markdown and "- mnist: not reached: " in markdown
    assert "boom: out of memory" in (tmp_path / "out" / "failures.log").read_text()
    assert "gpu table: gpt: stopped at the table's budget" in capsys.readouterr().out


# ---- the one command -------------------------------------------------------------------------------------------
def test_one_command_dry_run_without_cuda_shows_the_plan_the_budget_and_the_order(tmp_path):
    """`bash gpu_check/run.sh --dry-run` where CUDA is absent: the plan, the budget split and the parts in the
    order they run; the real command there stops in one line (exit 2) before installing or writing anything."""
    code, output = run_command(["bash", "gpu_check/run.sh", "--dry-run", "--budget-s", "300"],
                               env={**NO_CUDA, "OUT": str(tmp_path / "env-out")}, timeout=120)
    assert code == 0, output
    # results go where --out says, else under bench/results/: an $OUT in the environment is nobody's choice here
    assert f"output: {REPO / 'bench' / 'results'}/" in output and "-gpu-check: README.md" in output, output
    assert str(tmp_path / "env-out") not in output
    assert "CUDA absent: a real call here stops (exit 2)" in output
    split = gpu_call.split_budget(300, gpu_call.INSTALL_EXPECTED_S)
    assert (f"budget: 300 s = install {gpu_call.INSTALL_EXPECTED_S} s + pack cap {split['pack']:.0f} s (each launch "
            f"at most {split['launch']:.0f} s) + table {split['table']:.0f} s") in output, output
    assert "pytest tests/test_gpu.py -m gpu" in output
    parts = [p.folder for p in gpu_table.PARTS]
    order = ["1. install", "2. pack", "3. table", "inputs", *(f"{i}. {part} " for i, part in enumerate(parts, 1)),
             "output:"]
    at = [output.index(word) for word in order]
    assert at == sorted(at), list(zip(order, at))
    assert "not built yet" not in output  # every part has its recipe's flags now (QLoRA's came last)
    # issue 56: a short 1B LoRA DPO part, listed with what it measures
    dpo = output[output.index(f"{parts.index('dpo-lora') + 1}. dpo-lora "):].split("\n", 1)[0]
    assert "~ 40 s" in dpo, dpo
    assert "beyond the budget by the estimates" in output  # 300 s reaches the fine-tunes, not the rest
    # issue 55's parts with their goals, each under the part it judges
    goals = {"finetune-flex-4096": "goal: flex / padded >= 1.8x and flex / dense >= 1.3x real tokens/s\n",
             "finetune-flex-8192": "goal: flex / padded >= 1.8x and flex / dense >= 1.3x real tokens/s; flex's peak "
                                   "memory below dense's\n",
             "finetune-chunk-tokens-8192": "goal: token chunks / 8 chunks >= 1 real tokens/s (no slower)\n"}
    for part, goal in goals.items():
        after = output[output.index(f". {part} "):]
        assert after.split("\n", 2)[1].endswith(goal.strip()), after[:400]
    code, output = run_command(["bash", "gpu_check/run.sh", "--budget-s", "300", "--out", str(tmp_path / "o")],
                               env=NO_CUDA, timeout=120)
    assert code == 2 and output.strip().splitlines() == [
        "error: no CUDA device here: the GPU check needs one (see its plan with --dry-run; on a CPU run the suite: "
        "README, 'Tests')"], output
    assert not (tmp_path / "o").exists()


def test_the_install_makes_this_trees_accelrun_importable(tmp_path):
    """On the GPU node the recipes import accelrun from the tree copied there: the install writes a .pth naming its
    src/ into the Python's site-packages (no build, no index), and `import accelrun` then finds this tree's package
    (a bare Python, without it, does not). PYTHONPATH is cleared: one naming a src/ would answer for the .pth."""
    venv.EnvBuilder(with_pip=False).create(tmp_path / "py")
    python = str(tmp_path / "py" / "bin" / "python")
    probe = [python, "-c", "import accelrun; print(accelrun.__file__)"]
    env = without_pythonpath()
    assert subprocess.run(probe, capture_output=True, text=True, cwd=tmp_path, env=env).returncode == 1
    gpu_wheels.tree_importable(python)
    found = subprocess.run(probe, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert found.stdout.strip() == str(gpu_wheels.REPO / "src" / "accelrun" / "__init__.py"), found.stderr


# ---- prepare, where pip works ----------------------------------------------------------------------------------
def test_prepare_checks_the_deepspeed_import_inside_a_virtual_environment(tmp_path):
    """Issue 53, item 4: `prepare` in a virtual environment (the README's install) refused its own DeepSpeed wheel
    with "No module named 'torch'": the no-compiler import check ran a link to the interpreter from another folder,
    which runs the base interpreter without the environment. Here a real venv (with the system's packages, as the
    README's is not, so that only what the venv itself holds tells the two apart) holds a module of its own, and a
    stand-in DeepSpeed wheel imports it as the real one imports torch: the check, run by that venv's Python, passes."""
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(tmp_path / "venv")
    python = str(tmp_path / "venv" / "bin" / "python")
    env = without_pythonpath()
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=env,
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "gpucheck_venv_only.py").write_text("VALUE = 1\n")
    wheel = fake_wheel(tmp_path, "deepspeed", "import gpucheck_venv_only  # as DeepSpeed imports the venv's torch\n")
    check = ("import pathlib, sys; sys.path.insert(0, sys.argv[1]); import gpu_wheels; "
             "gpu_wheels.check_import_without_compiler(pathlib.Path(sys.argv[2])); print('imported')")
    result = subprocess.run([python, "-c", check, str(REPO / "gpu_check"), str(wheel)], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout == "imported\n", result.stderr[-2000:]
    # the check still refuses a wheel that does not import there, in one line
    (tmp_path / "b").mkdir()
    broken = fake_wheel(tmp_path / "b", "deepspeed", "import gpucheck_nowhere\n")
    result = subprocess.run([python, "-c", check, str(REPO / "gpu_check"), str(broken)], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and ("Refused: the built DeepSpeed wheel does not import without a compiler: "
                                       "ModuleNotFoundError: No module named 'gpucheck_nowhere'") in result.stderr


def test_prepare_names_what_its_python_lacks_before_fetching(tmp_path):
    """A Python without pip, setuptools or torch (a bare venv) cannot build the DeepSpeed wheel: prepare says so in one
    line each, naming what to install, before anything is downloaded; a venv holding only an old setuptools (no
    bdist_wheel without the `wheel` package) is named too."""
    venv.EnvBuilder(with_pip=False).create(tmp_path / "bare")
    python = str(tmp_path / "bare" / "bin" / "python")
    assert [line.split(":")[0] for line in gpu_wheels.prepare_problems(python)] == [
        f"{python} has no pip", f"{python} has no setuptools>=70.1", f"{python} has no torch"]
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          env=without_pythonpath(), capture_output=True, text=True, check=True).stdout.strip()
    for name, version in (("setuptools", "65.5.0"), ("pip", "24.0"), ("torch", "2.11.0")):  # found, versioned
        (Path(site) / name).mkdir()
        (Path(site) / name / "__init__.py").write_text("")
        (Path(site) / f"{name}-{version}.dist-info").mkdir()
        (Path(site) / f"{name}-{version}.dist-info" / "METADATA").write_text(f"Name: {name}\nVersion: {version}\n")
    assert gpu_wheels.prepare_problems(python) == [
        f"{python} has no setuptools>=70.1: prepare with the Python the project is installed in (README, 'Install'), "
        f"after `{python} -m pip install 'setuptools>=70.1'`"]


def test_the_mode_word_reaches_its_branch():
    """`bash gpu_check/run.sh prepare ...` hands `prepare`'s own flags to gpu_wheels.py prepare (a dry run here:
    what it would build, and whether this Python can; nothing fetched), and `table ...` to gpu_call.py --only table:
    a run.sh that dropped its mode word, or sent it down another branch, answers neither."""
    code, output = run_command(["bash", "gpu_check/run.sh", "prepare", "--dry-run"], env={"PYTHON": sys.executable},
                               timeout=120)
    lines = output.strip().splitlines()
    assert code == 0 and lines[0] == "prepare (dry run): nothing is fetched or built", output
    assert lines[1].startswith(f"into {gpu_wheels.WHEELS}: wheels for CPython {gpu_wheels.PYTHON} on x86-64 Linux: "
                               "deepspeed==0.19.8 (built here from its source package), "), lines
    assert lines[3:] == ([f"not ready: {line}" for line in gpu_wheels.prepare_problems(sys.executable)]
                         or [f"this Python ({sys.executable}) can build them"]), lines
    code, output = run_command(["bash", "gpu_check/run.sh", "table", "--dry-run", "--budget-s", "300"], env=NO_CUDA,
                               timeout=120)
    split = gpu_call.split_budget(300, gpu_call.INSTALL_EXPECTED_S, only="table")
    assert code == 0 and "2. pack (left out)" in output and f"3. table ({split['table']:.0f} s and" in output, output
