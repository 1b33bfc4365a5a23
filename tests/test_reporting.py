"""What a run reports: --report-to and --profile in the recipes (TensorBoard scalars read back, curves.png, the
profiler's traces of every rank, the step's time split in the summary), the SUMMARY line against summary.json,
what the end of a run costs by part, and docs/measuring.md's snippets loading each result."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from charts import TAB_BLUE, TAB_ORANGE, assert_drawn_png
from launching import REPO, run_command


def tensorboard_scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tags = set()
    for events in Path(log_dir).rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events.parent))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    return tags


def tensorboard_series(log_dir, tag):
    """[(step, value)] of one scalar as TensorBoard reads it back, in the order it was written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    points = []
    for folder in sorted({events.parent for events in Path(log_dir).rglob("events.out.tfevents.*")}):
        accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            points += [(event.step, event.value) for event in accumulator.Scalars(tag)]
    return points


def assert_same_series(log_dir, metrics_path, key):
    """The tracker got metrics.jsonl's `key`, step by step (TensorBoard keeps float32: 1e-6 relative)."""
    logged = [(r["step"], r[key]) for r in map(json.loads, metrics_path.read_text().splitlines()) if key in r]
    read_back = tensorboard_series(log_dir, key)
    assert len(logged) >= 2 and [step for step, _ in read_back] == [step for step, _ in logged], (read_back, logged)
    assert [value for _, value in read_back] == pytest.approx([value for _, value in logged], rel=1e-6), \
        (read_back, logged)


def traces(out_dir):
    """{rank: events} of the torch.profiler traces a run wrote."""
    found = {}
    for path in (out_dir / "profile").glob("rank*.pt.trace.json"):
        found[int(path.name.split(".")[0][4:])] = json.loads(path.read_text())["traceEvents"]
    return found


@pytest.mark.slow
def test_mnist_reports_to_tensorboard_and_profiles_every_rank(launch):
    run = launch("deepspeed_zero2.yaml", "--epochs", "2", "--batch-size", "200", "--log-every", "2",
                 "--report-to", "tensorboard", "--profile", "2", launch_args=("--mixed_precision", "no"))
    tags = tensorboard_scalars(run.out_dir / "tensorboard")
    assert {"loss", "lr", "samples_per_s", "data_ms", "forward_backward_ms", "optimizer_ms", "other_ms",
            "data_fraction", "test_accuracy", "test_loss"} <= tags, tags
    assert_same_series(run.out_dir / "tensorboard", run.out_dir / "metrics.jsonl", "loss")
    # figsize (11, 4) at dpi 100: the loss panel (train loss in blue, test loss in orange) and the accuracy panel
    assert_drawn_png(run.out_dir / "curves.png", (1100, 400), [TAB_BLUE, TAB_ORANGE])
    evals = [json.loads(line) for line in (run.out_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [10, 20] and evals[-1]["test_accuracy"] == run.summary["test_accuracy"]
    by_rank = traces(run.out_dir)
    assert sorted(by_rank) == [0, 1]  # every rank traced its own steps
    for events in by_rank.values():
        steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#2", "ProfilerStep#3"}, steps  # one skipped, one warm-up, 2 recorded
    timing = run.summary["timing"]
    assert timing["micro_batches"] == 19 and timing["optimizer_in_backward"] is True  # DeepSpeed steps in backward
    assert timing["forward_backward_ms"] > 0 and timing["other_ms"] > 0 and timing["samples_per_s"] > 0
    assert len(run.summary["peak_memory_mb_per_rank"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("recipe, args, tags, size, colours", [
    # curves.png: figsize (6, 4) with the loss panel only, (11, 4) with an accuracy panel; dpi 100
    ("linear_regression", ["--epochs", "1", "--num-points", "128"], {"loss", "lr", "m", "n"}, (600, 400),
     [TAB_BLUE]),
    ("gpt", ["--preset", "tiny", "--max-steps", "6", "--batch-size", "8", "--log-every", "1", "--eval-every", "3",
             "--eval-batches", "2", "--sample-tokens", "0"],
     {"loss", "lr", "tokens_per_s", "data_ms", "forward_backward_ms", "optimizer_ms", "val_loss"}, (600, 400),
     [TAB_BLUE, TAB_ORANGE]),
    ("resnet", ["--image-size", "16", "--batch-size", "16", "--epochs", "2", "--num-workers", "1", "--log-every", "1"],
     {"loss", "lr", "samples_per_s", "data_ms", "forward_backward_ms", "optimizer_ms", "val_accuracy"}, (1100, 400),
     [TAB_BLUE]),
    ("finetune_lm", ["--block-size", "32", "--max-steps", "6", "--batch-size", "8", "--log-every", "1", "--eval-every",
                     "3", "--eval-batches", "2", "--sample-tokens", "0"],
     {"loss", "lr", "tokens_per_s", "data_ms", "forward_backward_ms", "optimizer_ms", "val_loss"}, (600, 400),
     [TAB_BLUE, TAB_ORANGE]),
])
def test_every_training_recipe_reports_and_profiles(recipe, args, tags, size, colours, tmp_path):
    from accelrun.data.image_folder import write_image_folder
    if recipe == "gpt":
        (tmp_path / "corpus.txt").write_text("\n".join(f"line {i} of a small corpus {i * 7 % 11}" for i in range(800)))
        args = [*args, "--data-files", str(tmp_path / "corpus.txt")]
    if recipe == "resnet":
        args = [*args, "--data-dir", str(write_image_folder(tmp_path / "images", 16, 4, size=16))]
    if recipe == "finetune_lm":
        from accelrun.data.tiny_hf import write_all
        hf = write_all(tmp_path / "hf")
        args = [*args, "--model", str(hf / "model"), "--data-files", str(hf / "pairs.jsonl")]
    out = tmp_path / "out"
    code, output = run_command([sys.executable, f"recipes/{recipe}.py", *args, "--output-dir", str(out),
                                "--report-to", "tensorboard", "--profile", "2"])
    assert code == 0, output[-3000:]
    assert tags <= tensorboard_scalars(out / "tensorboard")
    assert_same_series(out / "tensorboard", out / "metrics.jsonl", "loss")
    assert_drawn_png(out / "curves.png", size, colours)
    assert list(traces(out)) == [0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["timing"]["micro_batches"] > 0 and summary["timing"]["optimizer_ms"] > 0


def test_unknown_report_target_is_one_line():
    out = subprocess.run([sys.executable, "recipes/mnist.py", "--report-to", "wandb"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "invalid choice: 'wandb'" in out.stderr


def loading_snippets():
    """The Python blocks of docs/measuring.md's "Loading what a run wrote", in order."""
    text = (REPO / "docs" / "measuring.md").read_text()
    section = re.search(r"^## Loading what a run wrote\s*$(.*?)(?=^## )", text, re.M | re.S).group(1)
    return re.findall(r"^```python\n(.*?)^```", section, re.M | re.S)


@pytest.mark.slow
def test_the_docs_snippets_load_each_result(reference, lora, hf):
    """model.safetensors into the recipe's class, the from_pretrained directory with its tokenizer, and PEFT's adapter
    on its base: each snippet as the docs give it, on the outputs of runs the suite makes anyway, its paths replaced."""
    mnist_run, _ = reference("2gpu.yaml")
    finetuned = lora("2gpu.yaml")  # LoRA with --merge-lora: OUTPUT_DIR/adapter and OUTPUT_DIR/model
    snippets = loading_snippets()
    assert len(snippets) == 3, snippets
    for snippet, out_dir in zip(snippets, (mnist_run.out_dir, finetuned.out_dir, finetuned.out_dir)):
        code = re.sub(r'^output_dir = ".*"', f"output_dir = {str(out_dir)!r}", snippet, count=1, flags=re.M)
        code = re.sub(r'^base_model = ".*"', f"base_model = {str(hf / 'model')!r}", code, count=1, flags=re.M)
        assert code.count(str(out_dir)) == 1, code
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"{snippet}\n{out.stderr[-3000:]}"
        if "ConvNet" in snippet:
            assert re.fullmatch(r"tensor\(\[\d, \d, \d, \d\]\)", out.stdout.strip()), out.stdout
        if "generate" in snippet:
            assert out.stdout.strip(), "the fine-tuned model generated nothing"


def test_summary_line_is_short_and_summary_json_complete():
    """The SUMMARY line: the figures a person reads, floats to 4 significant digits, nulls left out, JSON a script
    parses; without `shown` (pi.py, data_sharding.py) every field but args, as is."""
    from accelrun.reporting import summary_line

    summary = {"recipe": "finetune_lm", "distributed_type": "MULTI_CPU", "world_size": 2, "mixed_precision": "no",
               "deepspeed_stage": None, "steps": 40, "resumed_from_step": None, "first_loss": 5.736412048339844,
               "final_loss": 5.2712049961090095, "eval_loss": 5.123456789, "tokens_per_s": 1234.5678901,
               "mfu": None, "timing": {"forward_backward_ms": 1.23456789}, "checkpoints": [{"save_s": 0.1}],
               "peak_memory_mb": 934.2123, "wall_time_s": 65.31234, "args": {"lr": 1e-3}}
    line = summary_line(summary, shown=["eval_loss", "tokens_per_s", "mfu"])
    assert line.startswith("SUMMARY ")
    assert json.loads(line[len("SUMMARY "):]) == {
        "recipe": "finetune_lm", "distributed_type": "MULTI_CPU", "world_size": 2, "mixed_precision": "no",
        "steps": 40, "first_loss": 5.736, "final_loss": 5.271, "eval_loss": 5.123, "tokens_per_s": 1235.0,
        "peak_memory_mb": 934.2, "wall_time_s": 65.31}
    whole = json.loads(summary_line({"recipe": "pi", "pi": 3.141592653589793, "args": {}})[len("SUMMARY "):])
    assert whole == {"recipe": "pi", "pi": 3.141592653589793}


def test_a_compiled_model_evaluates_without_a_second_graph():
    """run.eager_if_compiled, around every evaluation and after the last step: the compiled model of training runs
    its eager code in eval mode under no_grad, where torch.compile would otherwise compile a second graph (its guards
    on grad mode and the batch's shape fail). The counter shows it: one graph, and two without the context."""
    import torch
    from torch._dynamo.utils import counters

    from accelrun.run import eager_if_compiled

    torch._dynamo.reset()
    counters.clear()
    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1)), backend="eager")
    model(torch.randn(8, 4)).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    model.eval()
    with torch.no_grad(), eager_if_compiled():
        model(torch.randn(3, 4))
    assert counters["stats"]["unique_graphs"] == 1
    with torch.no_grad():
        model(torch.randn(3, 4))  # what the evaluation did before: a second graph
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()


@pytest.mark.slow
def test_the_end_of_a_run_by_part_and_the_summary_line(reference):
    """After the last step: the final evaluation, the export and the report, each timed in summary.json's end_of_run,
    within its total; and the SUMMARY line the run printed is summary.json's figures, short and rounded."""
    run, _ = reference("2gpu.yaml")
    summary = run.summary
    end = summary["end_of_run"]
    parts = ("evaluation_s", "checkpoint_s", "recipe_s", "export_s", "report_s")
    assert set(end) == {*parts, "total_s"} and all(end[p] >= 0 for p in parts), end
    assert end["evaluation_s"] > 0 and end["export_s"] > 0, end  # the last step's evaluation, model.safetensors
    assert sum(end[p] for p in parts) <= end["total_s"] * 1.01 + 1e-3 and end["total_s"] < summary["wall_time_s"]
    line = next(x for x in run.output.splitlines() if x.startswith("SUMMARY "))
    shown = json.loads(line[len("SUMMARY "):])
    assert len(line) < 500 and "args" not in shown and "timing" not in shown, line
    for key, value in shown.items():
        full = summary[key]
        assert value == (float(f"{full:.4g}") if isinstance(full, float) else full), (key, value, full)
    assert {"test_accuracy", "samples_per_s", "final_loss", "wall_time_s"} <= set(shown), line


QUIET = """
import os, sys
sys.path.insert(0, "src")
import datasets
from accelrun.engines import name_the_cpu_for_deepspeed
from accelrun.exits import one_line
from accelrun.reporting import quiet_progress_bars
name_the_cpu_for_deepspeed()
quiet_progress_bars()
import transformers
print(datasets.utils.are_progress_bars_disabled(), os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"),
      transformers.utils.logging.is_progress_bar_enabled(), os.environ.get("DS_ACCELERATOR"))
print(one_line("RuntimeError: Error downloading x.gz:\\nTried https://a/, got:\\n<urlopen error>\\n\\nTried http://b/"))
"""


def test_a_log_file_gets_no_progress_bars_and_one_line_errors():
    """stderr to a file (a redirected run, a Slurm job): datasets', transformers' and the Hub's bars off, whether
    imported before or after; DeepSpeed told it runs on the CPU without a GPU (no 'Setting accelerator to CPU' from
    every process); an exception's text over several lines (urllib's) printed as one."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    out = subprocess.run([sys.executable, "-c", QUIET], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "True 1 False cpu", "RuntimeError: Error downloading x.gz: Tried https://a/, got: <urlopen error> Tried http://b/"]
