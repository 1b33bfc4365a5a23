"""The shipped accelerate configs: they parse with accelerate's own loader, every key is commented, each way of
running the README promises has one, none overrides the GPUs Slurm assigned, and a broken one is rejected before
any process starts. Quick, but for the one launch (slow)."""

import json
import os
import re
import subprocess

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from launching import CONFIG_DIR, CONFIG_FILES, NO_MODEL_CONFIGS, REPO, YAML_FILES, load_yaml, process_group


def test_the_promised_configs_exist():
    assert set(CONFIG_FILES) >= {"cpu.yaml", "1gpu.yaml", "2gpu.yaml", "multinode.yaml", "deepspeed_zero1.yaml",
                                "deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "deepspeed_zero3_offload.yaml",
                                "fsdp.yaml", "1gpu_compile.yaml", "2gpu_compile.yaml"}


def test_the_recipes_without_a_model_meet_every_kind_of_process_group():
    """pi.py and data_sharding.py run under one config of each (distributed type, world size) the shipped configs make
    on this machine (launching.NO_MODEL_CONFIGS), not under all of them: a config that makes a new kind joins them."""
    kinds = {process_group(config) for config in CONFIG_FILES}
    for recipe, configs in NO_MODEL_CONFIGS.items():
        assert {process_group(config) for config in configs} == kinds, recipe
        assert len(configs) == len(kinds) and set(configs) <= set(CONFIG_FILES), recipe


@pytest.mark.parametrize("config", YAML_FILES)
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


DEEPSPEED_JSONS = sorted(p.name for p in CONFIG_DIR.glob("deepspeed_*.json") if not p.stem.endswith("_fp32"))


@pytest.mark.parametrize("name", DEEPSPEED_JSONS)
def test_each_deepspeed_json_has_its_fp32_twin(name):
    """Issue 41, item 5: `--mixed_precision no` does not reach DeepSpeed (its JSON sets the precision), and none
    shipped in fp32: the quickstart's ZeRO-2 command with that flag ran bf16, 5x slower on a CPU without bf16
    instructions. Each JSON has a twin, NAME_fp32.json, that differs in bf16 off and nothing else (the tests' fp32
    DeepSpeed launches use them: launching.deepspeed_precision)."""
    bf16 = json.loads((CONFIG_DIR / name).read_text())
    fp32 = json.loads((CONFIG_DIR / name.replace(".json", "_fp32.json")).read_text())
    assert bf16["bf16"] == {"enabled": True} and fp32["bf16"] == {"enabled": False}
    assert {**fp32, "bf16": bf16["bf16"]} == bf16


def test_the_first_line_says_where_deepspeeds_precision_comes_from():
    """Issue 41, item 5: under DeepSpeed in bf16 the first line names the JSON that set it, and the fp32 twin."""
    from accelrun.engines import precision_source
    env = {"ACCELERATE_DEEPSPEED_CONFIG_FILE": "accelerate_configs/deepspeed_zero2.json"}
    cwd = os.getcwd()
    os.chdir(REPO)  # the path is relative to where the launch started, as in the YAMLs
    try:
        note = precision_source({"distributed_type": "DEEPSPEED", "mixed_precision": "bf16"}, env)
        assert note == (" (set by accelerate_configs/deepspeed_zero2.json, not by --mixed_precision; fp32: "
                        "--deepspeed_config_file accelerate_configs/deepspeed_zero2_fp32.json)")
        assert precision_source({"distributed_type": "DEEPSPEED", "mixed_precision": "no"}, env) == ""
        assert precision_source({"distributed_type": "MULTI_GPU", "mixed_precision": "bf16"}, env) == ""
    finally:
        os.chdir(cwd)


def test_the_first_line_says_that_the_json_overrode_mixed_precision_no():
    """Issue 53, item 10: `--mixed_precision no` under DeepSpeed trained in the JSON's bf16 (4.5x slower on a CPU
    without bf16 units) and the first line named the JSON and its fp32 twin, not that the flag was overridden. Now
    it says so; without the flag (accelerate launch passes "no" then too) it says where the precision came from."""
    from accelrun.engines.zero import mixed_precision_flag_given, precision_source
    env = {"ACCELERATE_DEEPSPEED_CONFIG_FILE": "accelerate_configs/deepspeed_zero2.json",
           "ACCELERATE_MIXED_PRECISION": "no"}
    typed = ["/venv/bin/accelerate", "launch", "--config_file", "accelerate_configs/deepspeed_zero2.yaml",
             "--mixed_precision", "no", "recipes/mnist.py"]
    bf16 = {"distributed_type": "DEEPSPEED", "mixed_precision": "bf16"}
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        assert precision_source(bf16, env, typed) == (
            " (--mixed_precision no overridden by accelerate_configs/deepspeed_zero2.json; fp32: "
            "--deepspeed_config_file accelerate_configs/deepspeed_zero2_fp32.json)")
        untyped = [arg for arg in typed if arg not in ("--mixed_precision", "no")]
        assert precision_source(bf16, env, untyped) == (
            " (set by accelerate_configs/deepspeed_zero2.json, not by --mixed_precision; fp32: "
            "--deepspeed_config_file accelerate_configs/deepspeed_zero2_fp32.json)")
        fp32_json = {"ACCELERATE_DEEPSPEED_CONFIG_FILE": "accelerate_configs/deepspeed_zero2_fp32.json",
                     "ACCELERATE_MIXED_PRECISION": "bf16"}
        assert precision_source({**bf16, "mixed_precision": "no"}, fp32_json, typed[:4] + ["--mixed_precision=bf16"]) \
            == " (--mixed_precision bf16 overridden by accelerate_configs/deepspeed_zero2_fp32.json)"
        assert precision_source({**bf16, "mixed_precision": "no"}, {**env, **fp32_json, "ACCELERATE_MIXED_PRECISION":
                                                                        "no"}, typed) == ""
    finally:
        os.chdir(cwd)
    assert mixed_precision_flag_given(typed) is True and mixed_precision_flag_given(untyped) is False


def test_the_cpu_commands_take_the_fp32_twin_jsons():
    """Issue 53, item 10: the README's DeepSpeed command for a CPU took the bf16 JSON (several times slower than fp32
    on a CPU without bf16 units). Every DeepSpeed command on the CPU route in README.md and docs/ names the config's
    _fp32 twin as --deepspeed_config_file."""
    commands = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8").replace("\\\n", " ")
        commands += [(page.name, line) for line in text.splitlines()
                     if re.search(r"PYTHONPATH=cpu_route accelerate launch .*deepspeed_zero\w*\.yaml", line)]
    assert len(commands) >= 3, commands
    for page, line in commands:
        config = re.search(r"(deepspeed_zero\w*)\.yaml", line).group(1)
        twin = "deepspeed_zero3" if config == "deepspeed_zero3_sp2" else config
        assert f"--deepspeed_config_file accelerate_configs/{twin}_fp32.json" in line, (page, line)


@pytest.mark.parametrize("config", YAML_FILES)
def test_every_key_has_a_comment(config):
    for line in (CONFIG_DIR / config).read_text().splitlines():
        if re.match(r"^\s*[A-Za-z_0-9]+:", line):
            assert "#" in line, f"{config}: key without a comment: {line!r}"


def test_no_config_overrides_the_gpus_slurm_assigned(tmp_path):
    """CUDA_VISIBLE_DEVICES (set by Slurm, or by the user) reaches the worker unchanged: no shipped config
    names its own GPU ids (1gpu.yaml once said '0' and took GPU 0 whatever Slurm had assigned)."""
    assert all(load_yaml(c).get("gpu_ids", "all") == "all" for c in YAML_FILES)
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nprint('visible=' + os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>'))\n")
    result = subprocess.run(["accelerate", "launch", "--config_file", str(CONFIG_DIR / "1gpu.yaml"), str(probe)],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "visible=1" in result.stdout, result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("content, message", [
    ("distributed_type: MULTI_GPU\nnum_processes: [2\n", "while parsing"),
    ("distributed_type: MULTI_GPU\nnum_procesess: 2\n", "unknown keys (['num_procesess'])"),
])
def test_bad_yaml_is_rejected_before_any_process_starts(launch, tmp_path, content, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text("compute_environment: LOCAL_MACHINE\n" + content)
    run = launch(str(bad), "--epochs", "1", check=False)
    assert run.returncode != 0
    assert message in run.output and "bad.yaml" in run.output
    assert "DATA:" not in run.output  # the recipe never started
