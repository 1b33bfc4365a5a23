"""The quickstart pair: plain PyTorch MNIST (torch_only.py) and the same file with accelerate (with_accelerate.py).

Quick: the diff between the two files is only accelerate lines (the repo's promise, in one diff), and
both files train with plain `python` to the very same printed numbers. Slow: the accelerate file
launched as 2 processes under DDP and under DeepSpeed ZeRO-2 (fp32: bf16 on a CPU is 7x slower) on
the synthetic digits, printing once, counting every test image once, well above chance; and as 1 process and under
FSDP, so that the launches meet every kind of engine the configs make.
"""

import ast
import difflib
import re

import pytest

from launching import (
    CONFIG_DIR,
    CONFIG_FILES,
    EXPECTED,
    FP32,
    REPO,
    TEST_SIZE,
    TRAIN_SIZE,
    cpu_route,
    deepspeed_precision,
    free_port,
    process_group,
    run_command,
)

QUICKSTART = REPO / "recipes" / "quickstart"
TORCH_ONLY, WITH_ACCELERATE = QUICKSTART / "torch_only.py", QUICKSTART / "with_accelerate.py"
WITH_CHECKPOINTS = QUICKSTART / "with_checkpoints.py"
MAX_LINES = 9  # at most this many lines added (or changed) and this many removed
TRAINING = ["--epochs", "1", "--batch-size", "32"]  # tiny: 1 epoch of the 2000 synthetic digits
EPOCH_LINE = re.compile(r"^epoch (\d+): train loss (\S+) \| test loss (\S+) \| test accuracy (\S+)% \((\d+)/(\d+)\)$",
                        re.MULTILINE)
MIN_ACCURACY = 50.0  # chance is 10%; measured: 90% for 1 process, 72% for 2 (twice the batch, half the steps)


def unified_diff():
    """(the diff's text, added lines, removed lines) of torch_only.py -> with_accelerate.py."""
    old, new = TORCH_ONLY.read_text().splitlines(), WITH_ACCELERATE.read_text().splitlines()
    diff = list(difflib.unified_diff(old, new, "torch_only.py", "with_accelerate.py", lineterm="", n=0))
    body = [line for line in diff[2:] if not line.startswith("@@")]  # past the ---/+++ header
    assert all(line[:1] in "+-" for line in body), body  # n=0: no context lines
    return "\n".join(diff), [line[1:] for line in body if line[0] == "+"], [line[1:] for line in body if line[0] == "-"]


def plain_counterpart(line):
    """What accelerate replaces: the device setup, moving to the device, loss.backward()."""
    code = line.strip()
    return ".to(device)" in code or re.match(r"device\s*=", code) is not None or code == "loss.backward()"


def test_the_diff_is_only_accelerate_lines():
    text, added, removed = unified_diff()
    assert added, "the two files are identical"
    assert len(added) <= MAX_LINES, f"{len(added)} lines added or changed (at most {MAX_LINES}):\n{text}"
    assert len(removed) <= MAX_LINES, f"{len(removed)} lines removed (at most {MAX_LINES}):\n{text}"
    words = ("accelerator", "Accelerator", "accelerate")
    not_accelerate = [line for line in added if not any(word in line for word in words)]
    assert not not_accelerate, f"added lines that do not mention accelerate: {not_accelerate}\n{text}"
    not_counterparts = [line for line in removed if not plain_counterpart(line)]
    assert not not_counterparts, \
        f"removed lines that are not device setup or loss.backward(): {not_counterparts}\n{text}"
    # The few lines are the whole distributed API, not a subset that happens to run on 1 process.
    for needed in ("from accelerate import Accelerator", "Accelerator(", "accelerator.prepare(",
                   "accelerator.backward(loss)", "accelerator.gather_for_metrics(", "accelerator.end_training()"):
        assert any(needed in line for line in added), f"no {needed!r} among the added lines:\n{text}"
    # The docstring (the same in both files) states the size of the change: keep it true.
    assert f"{len(added)} added lines" in ast.get_docstring(ast.parse(TORCH_ONLY.read_text()))


def code_lines(path):
    """A file's lines after its module docstring."""
    source = path.read_text()
    return source[source.index('"""', source.index('"""') + 3) + 3:].splitlines()


def test_the_third_level_adds_only_checkpoint_lines():
    """with_checkpoints.py is with_accelerate.py plus what a checkpoint and a mid-epoch resume take with accelerate
    alone (save_state, load_state, skip_first_batches, a step counter registered for checkpointing, a shuffle by
    seed and epoch): no training line changes, and the change stays small enough to read in one diff."""
    old, new = code_lines(WITH_ACCELERATE), code_lines(WITH_CHECKPOINTS)
    diff = [line for line in list(difflib.unified_diff(old, new, lineterm="", n=0))[2:] if not line.startswith("@@")]
    added, removed = [line[1:] for line in diff if line[0] == "+"], [line[1:] for line in diff if line[0] == "-"]
    assert len(added) <= 36 and len(removed) <= 5, "\n".join(diff)
    stated = f"({len(added)} added lines, {len(removed)} of them replacing"  # the docstring says the size: keep it true
    assert stated in " ".join(ast.get_docstring(ast.parse(WITH_CHECKPOINTS.read_text())).split()), stated
    for needed in ("accelerator.save_state()", "accelerator.load_state()", "accelerator.skip_first_batches(",
                   "accelerator.register_for_checkpointing(", "ProjectConfiguration(", ".set_epoch(epoch)"):
        assert any(needed in line for line in added), f"no {needed!r} among the added lines:\n" + "\n".join(diff)
    # What is replaced: the Accelerator's construction, the loaders (generators of their own) and the loops' heads.
    kinds = ("Accelerator(", "DataLoader(", "for epoch in", "for data, target in")
    assert all(any(kind in line for kind in kinds) for line in removed), removed
    assert "accelerate" not in " ".join(a for a in added if "import" in a and "accelerate" not in a)


def test_the_pair_is_self_contained_plain_pytorch():
    plain = {"argparse", "sys", "torch", "torchvision"}
    allowed = {TORCH_ONLY: plain, WITH_ACCELERATE: plain | {"accelerate"},
               WITH_CHECKPOINTS: plain | {"accelerate", "os"}}
    for path, modules in allowed.items():
        source = path.read_text()
        tree = ast.parse(source)
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert {name.split(".")[0] for name in imported} <= modules, f"{path.name} imports {sorted(imported)}"
        for hand_written in (".cuda(", "DistributedSampler", "DistributedDataParallel", "torch.distributed"):
            assert hand_written not in source, f"{path.name} uses {hand_written}: accelerate's job"
        doc = ast.get_docstring(tree)
        commands = [f"python recipes/quickstart/{name}.py" for name in (
            ("with_checkpoints",) if path == WITH_CHECKPOINTS else ("torch_only", "with_accelerate"))]
        for command in commands:
            assert command in doc, f"{path.name}'s docstring lacks {command!r}"
        for config in re.findall(r"--config_file (\S+)", doc):
            assert (REPO / config).is_file(), f"{path.name}'s docstring launches a missing config {config}"
        for folder in re.findall(r"PYTHONPATH=(\S+)", doc):
            assert (REPO / folder).is_dir(), f"{path.name}'s docstring puts a missing {folder}/ on PYTHONPATH"
    assert "accelerate" not in TORCH_ONLY.read_text().split('"""', 2)[2], "torch_only.py's code mentions accelerate"


def test_offline_without_mnist_is_one_line(tmp_path, monkeypatch, capsys):
    """Issue 41, item 10: offline, with no MNIST in --data-dir, the quickstart ended in torchvision's traceback.
    Now one line that says what to do, and exit 2. Run as `python torch_only.py` runs it (runpy, as __main__), in
    this process; offline for certain: every download goes through a proxy that refuses connections."""
    import runpy
    import sys
    closed = f"http://127.0.0.1:{free_port()}"
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(name, closed)
    monkeypatch.setenv("no_proxy", "")
    monkeypatch.setattr(sys, "argv", [str(TORCH_ONLY), "--data-dir", str(tmp_path / "data"), "--epochs", "0"])
    with pytest.raises(SystemExit) as ended:
        runpy.run_path(str(TORCH_ONLY), run_name="__main__")
    out, err = capsys.readouterr()
    assert ended.value.code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: MNIST is not in {tmp_path / 'data'}/MNIST/raw and could not be downloaded"), err
    assert "python -m accelrun.data.synthetic_mnist data/synthetic, then --data-dir data/synthetic" in err


def epoch_lines(output):
    """Parsed epoch lines: (epoch, train loss, test loss, accuracy %, correct, counted)."""
    return [(int(e), float(train), float(test), float(acc), int(c), int(n))
            for e, train, test, acc, c, n in EPOCH_LINE.findall(output)]


@pytest.fixture(scope="module")
def mnist_root(data_dir):
    """The session's synthetic digits, laid out as torchvision's MNIST(root) reads them (root/MNIST/raw)."""
    root = data_dir / f"synthetic-{TRAIN_SIZE}-{TEST_SIZE}"
    assert (root / "MNIST" / "raw" / "train-images-idx3-ubyte").is_file()
    return root


@pytest.fixture(scope="module")
def torch_only_run(mnist_root):
    return run_command(["python", str(TORCH_ONLY), "--data-dir", str(mnist_root), *TRAINING], timeout=300)


def test_torch_only_trains_on_a_cpu(torch_only_run):
    returncode, output = torch_only_run
    assert returncode == 0, output[-3000:]
    [(epoch, train_loss, test_loss, accuracy, correct, counted)] = epoch_lines(output)
    assert epoch == 1 and counted == TEST_SIZE and correct == round(accuracy * counted / 100)
    assert accuracy > MIN_ACCURACY and test_loss < 2.3, output  # 2.3 = ln 10, the loss of a uniform guess


def test_with_accelerate_under_python_prints_the_same_numbers(torch_only_run, mnist_root):
    """One process through accelerate: the same seed gives the same weights, batches and dropout, so the
    same printed line as plain PyTorch, to the last digit."""
    returncode, output = run_command(["python", str(WITH_ACCELERATE), "--data-dir", str(mnist_root), *TRAINING],
                                     timeout=300)
    assert returncode == 0, output[-3000:]
    assert "Distributed environment: DistributedType.NO" in output and "Num processes: 1" in output, output
    assert epoch_lines(output) == epoch_lines(torch_only_run[1]) != [], output


@pytest.mark.slow
def test_the_third_level_resumes_mid_epoch_to_the_uninterrupted_runs_numbers(mnist_root, tmp_path):
    """2 epochs of 63 steps with a checkpoint every 20: uninterrupted, and as 1 epoch then the same command with 2,
    which resumes from step 60, mid-epoch: the resumed epoch's test numbers, and all of epoch 2's, are the
    uninterrupted run's to the last digit (weights, shuffle and dropout continue exactly)."""
    def run(directory, epochs):
        code, output = run_command(["python", str(WITH_CHECKPOINTS), "--data-dir", str(mnist_root), "--epochs",
                                    str(epochs), "--batch-size", "32", "--checkpoint-every", "20",
                                    "--checkpoint-dir", str(tmp_path / directory)], timeout=300)
        assert code == 0, output[-3000:]
        return output
    whole = epoch_lines(run("whole", 2))
    assert "resumed from" not in run("stopped", 1)
    resumed = run("stopped", 2)
    assert "resumed from step 60" in resumed, resumed[-3000:]
    first, second = epoch_lines(resumed)
    assert first[2:] == whole[0][2:] and second == whole[1], (epoch_lines(resumed), whole)
    assert sorted(p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir()) == ["checkpoint_4", "checkpoint_5"]


def launch_quickstart(config, mnist_root, tmp_path, training=TRAINING):
    """accelerate launch of with_accelerate.py under `config` on this CPU (fp32); returns its output."""
    route_args, route_env = cpu_route(config)
    route_args += deepspeed_precision(config, FP32, tmp_path / "run")  # fp32 for a DeepSpeed JSON too
    cmd = ["accelerate", "launch", "--config_file", str(CONFIG_DIR / config), *route_args, *FP32,
           str(WITH_ACCELERATE), "--data-dir", str(mnist_root), *training]
    returncode, output = run_command(cmd, env=route_env, timeout=600)
    assert returncode == 0, f"launch failed ({returncode}):\n{output[-6000:]}"  # run_command: no process aborted
    return output


TWO_PROCESSES = [("2gpu.yaml", "MULTI_CPU"), ("deepspeed_zero2.yaml", "DEEPSPEED")]


@pytest.mark.slow
@pytest.mark.parametrize("config, distributed_type", TWO_PROCESSES)
def test_with_accelerate_launched_as_two_processes(config, distributed_type, mnist_root, tmp_path):
    output = launch_quickstart(config, mnist_root, tmp_path)
    # accelerator.state and the epoch line come once, from the main process, not once per process.
    assert output.count("Distributed environment:") == 1, output[-6000:]
    assert f"Distributed environment: DistributedType.{distributed_type}" in output, output[-6000:]
    assert "Num processes: 2" in output and "Mixed precision type: no" in output, output[-6000:]
    if distributed_type == "DEEPSPEED":
        assert "'zero_optimization': {'stage': 2" in output, output[-6000:]
    [(epoch, train_loss, test_loss, accuracy, correct, counted)] = epoch_lines(output)
    # 501 images over 2 processes: accelerate pads the last batch, gather_for_metrics drops the padding.
    assert epoch == 1 and counted == TEST_SIZE, output[-3000:]
    assert accuracy > MIN_ACCURACY and test_loss < 2.3, output[-3000:]


SMALL_TRAIN, SMALL_TEST = 256, 101  # the other configs' launches: the file runs there; learning is checked above
# "Any config fits" (the README), launched for one config of each kind beside DDP and ZeRO-2 above: 1 process through
# accelerate launch, and FSDP. The others (1gpu, multinode, ZeRO-1/3, offload, the compiled ones) run the same
# accelerate calls on one of these four engines, and every recipe of recipes/ is launched under each of them.
OTHER_CONFIGS = ["cpu.yaml", "fsdp.yaml"]


@pytest.fixture(scope="module")
def small_mnist_root(tmp_path_factory):
    from accelrun.data.synthetic_mnist import write_synthetic_mnist
    root = tmp_path_factory.mktemp("small-mnist")
    write_synthetic_mnist(root, SMALL_TRAIN, SMALL_TEST, seed=0)
    return root


def test_the_launches_meet_every_kind_of_process_group():
    """The quickstart's launches (below and above) cover each (distributed type, world size) the shipped configs make:
    a config that makes a new kind must join OTHER_CONFIGS."""
    launched = [config for config, _ in TWO_PROCESSES] + OTHER_CONFIGS
    assert {process_group(config) for config in launched} == {process_group(config) for config in CONFIG_FILES}


@pytest.mark.slow
@pytest.mark.parametrize("config", OTHER_CONFIGS)
def test_with_accelerate_under_one_process_and_fsdp(config, small_mnist_root, tmp_path):
    """The quickstart's claim, "any config of accelerate_configs/ fits", launched for the kinds of engine the two
    launches above leave out (1 process, FSDP): the engine each config asks for, one printed line, every test image
    counted once, every process exiting cleanly."""
    output = launch_quickstart(config, small_mnist_root, tmp_path, training=["--epochs", "1", "--batch-size", "32"])
    distributed_type, processes = EXPECTED[config][:2]
    assert output.count("Distributed environment:") == 1, output[-6000:]
    assert f"Distributed environment: DistributedType.{distributed_type}" in output, output[-6000:]
    assert f"Num processes: {processes}" in output, output[-6000:]
    [(epoch, train_loss, test_loss, accuracy, correct, counted)] = epoch_lines(output)
    assert epoch == 1 and counted == SMALL_TEST and correct == round(accuracy * counted / 100), output[-3000:]
