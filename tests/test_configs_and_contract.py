"""Quick checks: configs parse with accelerate's own loader, are commented, and recipes keep the contract."""

import ast
import re
import subprocess
import sys

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from conftest import ALL_CONFIGS, CONFIG_DIR, REPO, load_yaml

RECIPES = sorted((REPO / "recipes").glob("*.py"))


def test_the_promised_configs_exist():
    assert set(ALL_CONFIGS) >= {"cpu.yaml", "1gpu.yaml", "2gpu.yaml", "multinode.yaml", "deepspeed_zero1.yaml",
                                "deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "deepspeed_zero3_offload.yaml",
                                "fsdp.yaml"}


@pytest.mark.parametrize("config", ALL_CONFIGS)
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
    if "zero3" in config:
        assert ds["zero_stage"] == 3 and ds["zero3_save_16bit_model"] is True


@pytest.mark.parametrize("config", ALL_CONFIGS)
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
    assert contract_violations("model = torch.nn.parallel.DistributedDataParallel(model)") == {"DistributedDataParallel"}
    assert contract_violations("x = x.cuda()") == {".cuda()"}
    assert contract_violations("x = x.to(accelerator.device)") == set()


TRAINING_RECIPES = [r for r in RECIPES if r.name not in ("common.py", "checkpointing.py", "synthetic_mnist.py")]


@pytest.mark.parametrize("recipe", TRAINING_RECIPES, ids=lambda p: p.name)
def test_unknown_recipe_flag_is_a_clear_error(recipe):
    result = subprocess.run([sys.executable, str(recipe), "--bogus-flag"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "unrecognized arguments: --bogus-flag" in result.stderr


@pytest.mark.parametrize("recipe", TRAINING_RECIPES, ids=lambda p: p.name)
def test_recipe_docstring_gives_commands_and_results(recipe):
    doc = ast.get_docstring(ast.parse(recipe.read_text()))
    assert "accelerate launch --config_file accelerate_configs/" in doc
    assert re.search(r"measured\s+2026-\d\d-\d\d", doc), "say what the recipe reaches and where it was measured"


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
