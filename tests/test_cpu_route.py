"""cpu_route/: what it tells a user before DeepSpeed's silent first-run compilation (quick, no launch)."""

import importlib.util

import torch

from launching import REPO


def load_route():
    spec = importlib.util.spec_from_file_location("cpu_route_under_test", REPO / "cpu_route" / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # outside a launched worker (no LOCAL_RANK) it patches nothing
    return module


def test_says_which_deepspeed_ops_a_first_run_compiles(monkeypatch, tmp_path):
    route = load_route()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", raising=False)
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)
    assert route.deepspeed_ops_to_build(torch) == ["deepspeed_shm_comm"]
    # The shipped configs name a DeepSpeed JSON: the offload is read from there.
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(REPO / "accelerate_configs" / "deepspeed_zero3.json"))
    assert route.deepspeed_ops_to_build(torch) == ["deepspeed_shm_comm"]
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE",
                       str(REPO / "accelerate_configs" / "deepspeed_zero3_offload.json"))
    assert route.deepspeed_ops_to_build(torch) == ["deepspeed_shm_comm", "cpu_adam"]
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    assert route.deepspeed_ops_to_build(torch) == ["deepspeed_shm_comm", "cpu_adam"]
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")  # built before
    assert route.deepspeed_ops_to_build(torch) == ["cpu_adam"]
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    assert route.deepspeed_ops_to_build(torch) == []
