"""src/accelrun/refusals.py: launches that would train wrongly, refused at start-up with one clear line and a
non-zero exit, before the data and the model are built. Each slow test is a real launch of recipes/mnist.py on CPU;
the quick ones call the refusal in this process, with the launch's environment set as accelerate launch sets it.

The refusals a recipe adds for itself are with its own tests (an SGD recipe under optimizer offload: test_resnet.py,
test_linear_regression.py; ZeRO-3 loading a whole model that does not fit: test_finetune_lm.py).
"""

import json

import pytest
import torch

from launching import CONFIG_DIR, LaunchResult, launch_command, run_commands
from run_checks import assert_refused

FP32 = ["--mixed_precision", "no"]
SHORT = ("--max-steps", "8", "--log-every", "1")


@pytest.mark.slow
def test_global_batch_must_divide(launch):
    run = launch("2gpu.yaml", "--batch-size", "127", launch_args=FP32, check=False)
    assert run.returncode == 1  # torchrun reports any failed worker as 1; the recipe itself exits 2
    assert "error: --batch-size 127 is the global batch" in run.output
    assert "Traceback" not in run.output.split("error: --batch-size")[0][-2000:]
    assert "eval-batch-size" not in run.output  # 1000 divides by 2: only the real problem is named
    # The launcher's failure summary, printed last, ends with the same line instead of a docs pointer.
    summary = run.output[run.output.rindex("Root Cause"):]
    assert "traceback : error: --batch-size 127 is the global batch" in summary, summary


@pytest.mark.slow
def test_gpu_config_on_cpu_refuses_independent_copies(launch):
    """A MULTI_GPU config on a machine without GPUs would train 2 unrelated copies; the recipe stops."""
    run = launch("2gpu.yaml", *SHORT, launch_args=FP32, env={"ACCELERATE_USE_CPU": "0"}, check=False)
    assert run.returncode != 0
    assert "the launcher started 2 processes" in run.output and "ACCELERATE_USE_CPU=1" in run.output


@pytest.mark.slow
def test_more_processes_than_gpus_is_refused_before_anything_is_built(launch):
    """2gpu.yaml on a node with one GPU (simulated: torch.cuda reports 1) fails at once with the fixes, instead
    of CUDA's 'invalid device ordinal' after the model and data are built."""
    run = launch("2gpu.yaml", *SHORT, launch_args=FP32, env={"ACCELERATE_USE_CPU": "0", "TEST_FAKE_GPUS": "1"},
                 check=False)
    assert run.returncode == 1
    errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert errors == ["error: this node has 1 GPU(s) and the launch starts 2 processes on it (num_processes 2): pass "
                      "--num_processes 1 to accelerate launch, or use accelerate_configs/1gpu.yaml, or set "
                      "ACCELERATE_USE_CPU=1 for a run on the CPU."], run.output[-3000:]
    assert "DATA:" not in run.output  # refused before the data (and the model)


@pytest.fixture
def engine_without_gpu(monkeypatch):
    """A worker of a launch of a DeepSpeed config on a machine without a GPU, as accelerate launch starts it; returns
    (the refusal, its exit code and its stderr) for the environment the test then sets."""
    from accelrun import refusals
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("ACCELERATE_USE_CPU", "ACCELERATE_USE_FSDP", "TORCHELASTIC_ERROR_FILE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")

    def refused(capsys):
        with pytest.raises(SystemExit) as stopped:
            refusals.check_gpus_before_start()
        return stopped.value.code, capsys.readouterr().err
    return refused


def test_an_engine_without_a_gpu_or_the_cpu_route_is_refused_from_the_environment(engine_without_gpu, capsys,
                                                                                     monkeypatch):
    """Issue 41, item 3: a DeepSpeed config launched on a CPU without PYTHONPATH=cpu_route compiled a DeepSpeed op
    for minutes (Accelerator() imports DeepSpeed) before the refusal. The refusal is decided from the launch's
    environment, in Run() before Accelerator(): one line, exit 2. With ACCELERATE_USE_CPU=1 (which turns DeepSpeed
    and FSDP off) too; on the CPU route, and for a DDP config, nothing is refused."""
    from accelerate.state import PartialState

    from accelrun import refusals
    code, err = engine_without_gpu(capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: the config asks for DEEPSPEED and this machine has no GPU: launch it as "
                          "PYTHONPATH=cpu_route accelerate launch ..."), err
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    code, err = engine_without_gpu(capsys)
    assert code == 2 and err.startswith("error: the config asks for DEEPSPEED, and ACCELERATE_USE_CPU=1 turns it "
                                        "off (accelerate would run MULTI_CPU)"), err
    monkeypatch.delenv("ACCELERATE_USE_CPU")

    def routed(self, cpu=False, sagemaker_dp=False, backend=None):
        return "gloo", None
    routed.cpu_route = True  # what cpu_route/sitecustomize.py marks its backend choice with
    monkeypatch.setattr(PartialState, "_prepare_backend", routed)
    refusals.check_gpus_before_start()  # on the route: no refusal
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    monkeypatch.setattr(PartialState, "_prepare_backend", lambda *a, **k: None)
    refusals.check_gpus_before_start()  # a DDP config needs no route
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_deepspeed_config_without_its_cpu_route_is_refused_before_deepspeed_builds(tmp_path):
    """Both ways of launching a DeepSpeed config on a CPU without the route, at once: without PYTHONPATH=cpu_route,
    and with ACCELERATE_USE_CPU=1 (which silently turns DeepSpeed off). Each is refused in one line before any
    data, and before DeepSpeed compiles anything into the (empty) extensions directory."""
    cases = {"no route": {}, "ACCELERATE_USE_CPU=1": {"ACCELERATE_USE_CPU": "1"}}
    commands, outs = [], []
    (tmp_path / "data").mkdir()  # there, empty: a named --data-dir that is missing is refused before the config
    for i, env in enumerate(cases.values()):
        out = tmp_path / f"out{i}"
        cmd, _ = launch_command("deepspeed_zero2.yaml", tmp_path / "data", out, *SHORT, launch_args=FP32)
        commands.append((cmd, {"PYTHONPATH": "", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), **env}))
        outs.append(out)
    results = [LaunchResult(*result, out) for result, out in zip(run_commands(commands), outs)]
    no_route, use_cpu = results
    assert_refused(no_route, "the config asks for DEEPSPEED and this machine has no GPU: launch it as "
                             "PYTHONPATH=cpu_route")
    assert_refused(use_cpu, "the config asks for DEEPSPEED, and ACCELERATE_USE_CPU=1 turns it off")
    for run in results:
        assert run.returncode == 1 and "DATA:" not in run.output, run.output[-3000:]
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").iterdir())


@pytest.mark.slow
def test_deepspeed_config_may_not_contradict_the_flags(launch, tmp_path):
    ds = json.loads((CONFIG_DIR / "deepspeed_zero2.json").read_text())
    ds["gradient_accumulation_steps"] = 4  # contradicts --grad-accum
    (tmp_path / "zero2_gas4.json").write_text(json.dumps(ds))
    bad = tmp_path / "zero2_gas4.yaml"
    bad.write_text((CONFIG_DIR / "deepspeed_zero2.yaml").read_text().replace(
        "accelerate_configs/deepspeed_zero2.json", str(tmp_path / "zero2_gas4.json")))
    run = launch(str(bad), *SHORT, launch_args=FP32, check=False)
    assert run.returncode != 0
    assert "gradient_accumulation_steps=4" in run.output and "remove those keys" in run.output
    assert "DATA:" not in run.output, run.output[-3000:]  # refused before the data loads (issue 41, item 3)


def test_a_resume_whose_batch_does_not_split_is_told_only_the_resumes_way(tmp_path, monkeypatch):
    """Issue 53, item 11: a 1-process checkpoint of --batch-size 128 resumed on 3 processes was told "give
    --batch-size 126 for a new run; a resume keeps ...": the first half, followed, was refused 44 s later (batch_size
    128 vs 126). Where --checkpoint-dir holds checkpoints (or --resume names one) the line gives the resume's way
    alone, and each process count it names splits the batch; a new run still gets the other --batch-size."""
    import re
    from argparse import Namespace
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from accelrun import refusals

    ckpt = tmp_path / "ckpt"
    (ckpt / "step-00000050").mkdir(parents=True)
    said = []
    monkeypatch.setattr(refusals, "fail", lambda accelerator, message, everyone=False: said.append(message))
    three = SimpleNamespace(num_processes=3, parallelism_config=None, distributed_type=DistributedType.MULTI_CPU)
    refusals.check_batch(three, 128, 1, None, Namespace(resume="auto", checkpoint_dir=str(ckpt)))
    assert len(said) == 1 and "for a new run" not in said[0] and "--batch-size 126" not in said[0], said
    assert said[0] == (f"--batch-size 128 is the global batch of one optimizer step and must divide by processes x "
                       f"--grad-accum = 3: this run resumes {ckpt}, which keeps its --batch-size, so launch 1, 2, 4 "
                       f"or 8 processes (accelerate launch --num_processes N)")
    for n in map(int, re.findall(r"\d+", re.search(r"launch ([\d, or]+) processes", said[0]).group(1))):
        assert refusals.batch_problem(n, 128, 1, None, str(ckpt)) is None
    step = str(ckpt / "step-00000050")
    assert f"this run resumes {step}, which keeps" in refusals.batch_problem(
        3, 128, 1, None, refusals.resumed_from(Namespace(resume=step, checkpoint_dir=None)))
    for new_run in (Namespace(resume="auto", checkpoint_dir=str(tmp_path / "empty")),
                    Namespace(resume="auto", checkpoint_dir=None), Namespace(resume="none", checkpoint_dir=str(ckpt))):
        assert refusals.resumed_from(new_run) is None
    (tmp_path / "empty").mkdir()
    refusals.check_batch(three, 128, 1, None, Namespace(resume="auto", checkpoint_dir=str(tmp_path / "empty")))
    assert "give --batch-size 126 for a new run" in said[1]


def test_a_data_dir_that_does_not_exist_is_named_in_one_line(tmp_path):
    """Issue 53, item 12: `mnist.py --data-dir /nonexistent` trained on synthetic digits (exit 0) with a DATA line
    naming a download error, not the missing directory. A --data-dir that is named must exist: one line, exit 2,
    before anything is imported or built. The documented fallbacks stay: without --data-dir (data/, created), and
    with --data synthetic, which writes the digits there."""
    import mnist
    from in_process import run_main
    missing = tmp_path / "nonexistent"
    code, output = run_main("mnist", ["--data-dir", missing, "--output-dir", tmp_path / "out"])
    lines = [line for line in output.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, output  # the program's name is pytest's here
    assert lines[0].split(": ", 1)[1].startswith(
        f"error: --data-dir {missing}: no such directory. Give the directory that holds MNIST (MNIST/raw/), create it "
        f"first for a download into it, or leave --data-dir out (data/; offline, synthetic digits)"), output
    assert not missing.exists() and not (tmp_path / "out").exists()
    assert mnist.parse_args(["--data", "synthetic", "--data-dir", str(missing)]).data_dir == str(missing)
    assert mnist.parse_args([]).data_dir == "data" and mnist.data_dir_problem(mnist.parse_args([])) is None
    assert mnist.parse_args(["--data-dir", str(tmp_path)]).data_dir == str(tmp_path)


def test_the_small_ones_each_say_it_once_and_right(monkeypatch, capsys, tmp_path):
    """Issue 53, item 14: `--loss-chunks 0` or a negative count was taken silently; forgetting ACCELERATE_USE_CPU=1
    printed its error once per rank (every process, set up alone, was accelerate's main process); a resume said
    "written by 1 processes"."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from accelrun import refusals
    from accelrun.checkpoint import load
    from finetune_lm import parse_args

    for count in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as refused:
            parse_args(["--model", "m", "--data-files", "d", "--loss-chunks", count])
        lines = capsys.readouterr().err.strip().splitlines()
        assert refused.value.code == 2 and len(lines) == 1, lines
        assert f"--loss-chunks: {count!r}: give a whole number of chunks, 1 or more (1: the plain loss)" in lines[0]
    assert parse_args(["--model", "m", "--data-files", "d", "--loss-chunks", "1"]).loss_chunks == 1

    monkeypatch.setattr(refusals, "teardown", lambda accelerator, code: code)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    alone = SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO, is_main_process=True)
    said = []
    for rank in ("0", "1"):  # two processes of `accelerate launch --config_file 2gpu.yaml` on a CPU, each alone
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(SystemExit) as refused:
            refusals.check_launch(alone)
        assert refused.value.code == 2
        said.append(capsys.readouterr().err)
    assert said[0].startswith("error: the launcher started 2 processes, but accelerate set up 1") and said[1] == ""
    assert "ACCELERATE_USE_CPU=1" in said[0] and said[0].count("\n") == 1

    class Held:
        def replaced(self):
            return []

        def close(self):
            pass
    acc = SimpleNamespace(is_main_process=True, num_processes=2)
    for world, words in ((1, "written by 1 process;"), (2, "written by 2 processes;")):
        load._loaded(acc, Held(), "ckpt/step-00000003", {"step": 3, "layout": {"world_size": world}}, [], (0.1, 0.2))
        assert words in capsys.readouterr().out
