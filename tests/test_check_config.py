"""launch/check_config.py: every shipped config passes, and each trap a hand-made config can fall into is
rejected with one line naming its key and the fix, also before launch/slurm_launch.py starts anything."""

import json
import subprocess
import sys

import pytest

from launching import CONFIG_DIR, REPO, YAML_FILES

sys.path.insert(0, str(REPO / "launch"))
import check_config  # noqa: E402
import slurm_launch  # noqa: E402


@pytest.mark.parametrize("config", YAML_FILES)
def test_every_shipped_config_passes(config):
    for recipe in ("recipes/mnist.py", "recipes/gpt.py", None):
        errors, notes = check_config.check(str(CONFIG_DIR / config), recipe)
        assert errors == [], errors
        assert not [n for n in notes if n.startswith("warning:")], notes  # no key that accelerate ignores


def test_keys_accelerate_ignores_are_warned_about(tmp_path):
    """accelerate launch applies a top-level key only when its command-line option defaults to None:
    rdzv_backend and same_network (once in multinode.yaml) never reached the launch."""
    config = tmp_path / "multi.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\n"
                      "rdzv_backend: c10d\nsame_network: false\nmain_process_port: 29500\n")
    errors, notes = check_config.check(str(config))
    warned = sorted(n.split(": ")[2] for n in notes if n.startswith("warning:"))
    assert errors == [] and warned == ["rdzv_backend", "same_network"], notes
    assert "--rdzv_backend has its own default ('static')" in " ".join(notes)


DS_YAML = ("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_machines: 1\nnum_processes: 2\n"
           "{mixed}deepspeed_config:\n{deepspeed}")
WITH_JSON = "  deepspeed_config_file: ds.json\n"


@pytest.mark.parametrize("yaml_text, ds_json, recipe, key, fix", [
    # auto values that need a hidden_size
    (DS_YAML.format(mixed="", deepspeed=WITH_JSON),
     {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}},
     None, "zero_optimization.stage3_prefetch_bucket_size", "write a number"),
    # an optimizer / scheduler block forces DummyOptim / DummyScheduler
    (DS_YAML.format(mixed="", deepspeed=WITH_JSON), {"zero_optimization": {"stage": 2},
                                                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
     None, "optimizer: a DeepSpeed optimizer block", "delete the \"optimizer\" block"),
    (DS_YAML.format(mixed="", deepspeed=WITH_JSON), {"zero_optimization": {"stage": 2},
                                                     "scheduler": {"type": "WarmupLR"}},
     None, "scheduler: a DeepSpeed scheduler block", "delete the \"scheduler\" block"),
    # offload with a torch optimizer that is not Adam
    (DS_YAML.format(mixed="", deepspeed="  zero_stage: 2\n  offload_optimizer_device: cpu\n"), None,
     "recipes/linear_regression.py", "offload_optimizer_device", "zero_force_ds_cpu_optimizer"),
    # stage-3 options on stage 1 / 2
    (DS_YAML.format(mixed="", deepspeed="  zero_stage: 2\n  offload_param_device: cpu\n"), None,
     None, "deepspeed_config.offload_param_device", "set zero_stage: 3"),
    (DS_YAML.format(mixed="", deepspeed=WITH_JSON),
     {"zero_optimization": {"stage": 1, "stage3_max_live_parameters": 1e9}},
     None, "zero_optimization.stage3_max_live_parameters", "set \"stage\": 3"),
    # mixed precision that disagrees between the YAML and the JSON
    (DS_YAML.format(mixed="mixed_precision: bf16\n", deepspeed=WITH_JSON),
     {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}, None,
     "mixed_precision: the YAML says bf16 but the DeepSpeed JSON says fp16", "remove mixed_precision from the YAML"),
    # ... and even when they agree, accelerate refuses the YAML key next to a JSON
    (DS_YAML.format(mixed="mixed_precision: bf16\n", deepspeed=WITH_JSON),
     {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, None,
     "mixed_precision: set in the YAML next to deepspeed_config_file", "remove mixed_precision from the YAML"),
    # accelerate's own loader and YAML syntax
    ("distributed_type: DEEPSPEED\nnum_processes: 2\nzero_stage: 2\n", None, None, "accelerate's loader rejects it",
     "remove or correct the key"),
    ("distributed_type: DEEPSPEED\n num_processes: 2\n", None, None, "not valid YAML (line 2", "indentation"),
])
def test_each_trap_is_rejected_with_its_key_and_fix(tmp_path, monkeypatch, capsys, yaml_text, ds_json, recipe, key,
                                                   fix):
    """check_config.py's main() in this process, from the config's directory (its ds.json is relative to it): exit
    code 2 and one line on stderr. The command itself, run as a process: the test below."""
    config = tmp_path / "broken.yaml"
    config.write_text(yaml_text)
    if ds_json is not None:
        (tmp_path / "ds.json").write_text(json.dumps(ds_json))
    monkeypatch.chdir(tmp_path)
    code = check_config.main([str(config), *(["--recipe", str(REPO / recipe)] if recipe else [])])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0] and "Fix: " in lines[0], lines
    assert fix in lines[0].split("Fix: ", 1)[1]


def test_a_trap_is_one_line_and_exit_2_from_the_command(tmp_path):
    """The command as a user runs it (a process of its own), on one of the traps above: exit code 2, one line."""
    config = tmp_path / "broken.yaml"
    config.write_text("distributed_type: DEEPSPEED\n num_processes: 2\n")
    out = subprocess.run([sys.executable, str(REPO / "launch" / "check_config.py"), str(config)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "not valid YAML (line 2" in lines[0], lines
    assert "indentation" in lines[0].split("Fix: ", 1)[1]


def test_offload_with_an_adam_recipe_passes_with_a_note():
    out = subprocess.run([sys.executable, "launch/check_config.py", "accelerate_configs/deepspeed_zero3_offload.yaml",
                          "--recipe", "recipes/gpt.py"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "DeepSpeedCPUAdam" in out.stdout and out.stdout.rstrip().endswith(": ok")


def test_slurm_launch_runs_the_check_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    env = {line.partition("=")[0]: line.partition("=")[2] for line in
           (REPO / "tests/fixtures/slurm_env/step_1node_1task.env").read_text().splitlines()}
    args = slurm_launch.parse_args(["accelerate_configs/deepspeed_zero3_offload.yaml", "recipes/resnet.py"])
    refusal = "replace recipes/resnet.py's torch.optim.SGD by DeepSpeedCPUAdam"
    with pytest.raises(slurm_launch.LaunchError, match=refusal):
        slurm_launch.plan(args, env, resolve=False)


HSDP_YAML = (CONFIG_DIR / "hsdp.yaml").read_text()


def mesh_config(tmp_path, replicate, shard, processes):
    """hsdp.yaml with other sizes and num_processes."""
    text = (HSDP_YAML.replace("parallelism_config_dp_replicate_size: 2 ", f"parallelism_config_dp_replicate_size: "
                              f"{replicate} ")
            .replace("parallelism_config_dp_shard_size: 2 ", f"parallelism_config_dp_shard_size: {shard} ")
            .replace("num_processes: 4 ", f"num_processes: {processes} "))
    config = tmp_path / "mesh.yaml"
    config.write_text(text)
    return config


def test_an_hsdp_product_that_is_not_the_process_count_is_named_in_one_line(tmp_path, capsys):
    """Issue 50, item 2: dp_replicate_size x dp_shard_size must be the number of processes (accelerate refuses a
    mismatch only once every process has started): 2 x 4 against num_processes 4, and hsdp.yaml's 2 x 2 against a
    launch of 8 (--num-processes), each one line naming the product and the count. The shipped 2 x 2 on 4 passes."""
    assert check_config.check(str(CONFIG_DIR / "hsdp.yaml")) == ([], [])
    assert check_config.main([str(mesh_config(tmp_path, 2, 4, 4))]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "parallelism_config: dp_replicate_size 2 x dp_shard_size 4 = 8 processes, but the " \
                               "launch starts 4 (num_processes)" in lines[0] and "Fix: " in lines[0], lines
    assert check_config.main([str(CONFIG_DIR / "hsdp.yaml"), "--num-processes", "8"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "= 4 processes, but the launch starts 8" in lines[0], lines
    # Under Slurm the launcher fills the two sizes itself (replicate = nodes, shard = processes per node).
    assert check_config.check(str(mesh_config(tmp_path, 2, 4, 4)), filled=True)[0] == []


def test_hsdp_without_a_shard_dimension_is_refused(tmp_path):
    """dp_replicate_size 2 with dp_shard_size 1 under FSDP: nothing to shard over (accelerate refuses it)."""
    errors, _ = check_config.check(str(mesh_config(tmp_path, 2, 1, 2)))
    assert len(errors) == 1 and "parallelism_config_dp_shard_size: is 1 with dp_replicate_size 2" in errors[0], errors
    assert "DDP (2gpu.yaml, multinode.yaml)" in errors[0]


def test_check_config_names_the_float8_traps(tmp_path):
    shipped = (CONFIG_DIR / "fsdp_fp8.yaml").read_text()
    assert check_config.check(str(CONFIG_DIR / "fsdp_fp8.yaml")) == ([], [])
    cases = {"distributed_type: FSDP": ("distributed_type: MULTI_GPU", "mixed_precision: with torch.compile under "
                                                                        "DDP fails upstream (torchao issue 1308)"),
             "backend: AO": ("backend: TE", "fp8_config.backend: TE: accelrun runs torchao's float8 (AO)"),
             "fsdp_cpu_ram_efficient_loading: false": ("fsdp_cpu_ram_efficient_loading: true",
                                                       "accelerate refuses torchao's float8 with it")}
    for old, (new, message) in cases.items():
        bad = tmp_path / "bad.yaml"
        bad.write_text(shipped.replace(old, new))
        errors, _ = check_config.check(str(bad))
        assert len(errors) == 1 and message in errors[0], errors


@pytest.mark.parametrize("content", [
    "distributed_type: MULTI_GPU\nmixed_precision: fp8\ndynamo_config:\n  dynamo_backend: INDUCTOR\n",
    "distributed_type: FSDP\nmixed_precision: fp8\nfp8_config: 5\nfsdp_config: 3\ndynamo_config: 4\n",
])
def test_a_float8_config_with_sections_missing_or_malformed_gets_lines_not_a_traceback(tmp_path, content):
    """No num_processes under MULTI_GPU: DDP's several processes, so compile is refused; sections that are not
    mappings: read as empty."""
    config = tmp_path / "m.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\n" + content)
    errors, _ = check_config.check(str(config))
    assert all(isinstance(line, str) for line in errors)
    assert any("torchao issue 1308" in line for line in errors) == content.startswith("distributed_type: MULTI_GPU")
