"""torch.compile by config (accelerate_configs/*_compile.yaml): real compiled runs on CPU (inductor's C++ kernels).

Swapping the file is the whole change. What must hold compiled, and can be seen from outside the run:
the same training as eager, no graph break in the model's forward, one graph: no recompile even where the shape or
mode truly changes (training -> evaluation), and a model.safetensors with the model's own key names.
gpt and mnist are launched here under both compiled configs, with dynamo's logs; finetune_lm, resnet and
linear_regression run under them in their own matrices (every config of CONFIG_FILES); pi and data_sharding build no
model, and run under one config of each kind of process group (launching.NO_MODEL_CONFIGS).
"""

import re
import sys

import pytest
import torch

from launching import EXPECTED, REPO

pytestmark = pytest.mark.slow

# Dynamo says what it recompiles and where it breaks a graph, one line each.
LOGS = {"TORCH_LOGS": "recompiles,graph_breaks"}


def compile_report(output):
    """(recompile indices and reasons, graph breaks located in the recipes) from dynamo's log lines."""
    recompiles = [int(m.group(1)) for m in re.finditer(r"\[\d+/(\d+)\] \[__recompiles\] Recompiling function", output)]
    reasons = re.findall(r"\[__recompiles\]\s+- \d+/\d+: (.*)", output)
    breaks = re.findall(r"Graph break.* in user code at (\S*/recipes/\S+)", output)
    return recompiles, reasons, breaks


def test_models_forward_has_no_graph_break():
    """The recipes' own models trace as one graph each (DDP's wrapper has breaks of its own, outside the model)."""
    sys.path.insert(0, str(REPO / "recipes"))
    from gpt import GPT, PRESETS
    from mnist import ConvNet
    layers, heads, d, block = PRESETS["tiny"]
    for model, example in ((GPT(layers, heads, d, block), torch.zeros(2, block, dtype=torch.long)),
                           (ConvNet(), torch.zeros(4, 1, 28, 28))):
        torch._dynamo.reset()  # a fresh cache: what other tests in this process compiled (and its limits) left aside
        explained = torch._dynamo.explain(model)(example)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


# Each compiled config beside its eager twin: the same launch with the dynamo_config removed.
EAGER = {"1gpu_compile.yaml": "1gpu.yaml", "2gpu_compile.yaml": "2gpu.yaml"}


def test_a_finished_run_leaves_torch_compile_compiling(tmp_path, monkeypatch):
    """A run's training ends with torch.compiler.set_stance('force_eager') (one graph per run), which holds for the
    whole process: Run.finish sets the default back, so that the next model compiled in this process (a notebook's,
    a test's) is compiled, not run eagerly without a word."""
    from in_process import run_main
    monkeypatch.chdir(tmp_path)
    code, output = run_main("linear_regression", ["--num-points", "64", "--epochs", "1", "--output-dir", "out"])
    assert code == 0, output[-2000:]
    graphs = []

    def counting(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    assert torch.compile(lambda x: x * 2 + 1, backend=counting)(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]
    assert len(graphs) == 1


@pytest.mark.parametrize("config", list(EAGER))
def test_gpt_compiled_trains_like_eager(shelf, config):
    eager = shelf("gpt", EAGER[config])  # the matrix runs of tests/test_gpt.py
    compiled = shelf("gpt", config, env=LOGS)
    s = compiled.summary
    assert (s["distributed_type"], s["world_size"]) == EXPECTED[config][:2]
    recompiles, reasons, breaks = compile_report(compiled.output)
    assert not breaks, breaks
    # Compiled once, for training: evaluation (no_grad) runs eagerly, so nothing recompiles, for a mode or a shape.
    assert not recompiles and s["compiled_graphs"] == 1, (reasons, s["compiled_graphs"])
    assert len(compiled.metrics) == len(eager.metrics) == 12
    for a, b in zip(eager.metrics, compiled.metrics):  # inductor's kernels round differently: 1e-3
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3), (a, b)
    # model.safetensors keeps the model's own names (no _orig_mod.) and loads into the uncompiled class.
    weights = compiled.params()
    sys.path.insert(0, str(REPO / "recipes"))
    from gpt import GPT, PRESETS
    model = GPT(*PRESETS["tiny"])
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied to wte, exported once
    assert weights.keys() == eager.params().keys()
    for name, value in eager.params().items():
        torch.testing.assert_close(weights[name], value, atol=1e-3, rtol=1e-3, msg=name)


@pytest.mark.parametrize("config", list(EAGER))
def test_mnist_compiled(launch, config):
    """The MNIST recipe under each compiled config (1gpu_compile.yaml: full graph, a break would be an error):
    trains, compiles training once and evaluates eagerly (no second graph), and exports weights the plain
    ConvNet loads."""
    run = launch(config, "--epochs", "1", "--max-steps", "8", "--log-every", "1",
                 launch_args=("--mixed_precision", "no"), env=LOGS)
    s = run.summary
    assert (s["distributed_type"], s["world_size"], s["steps"]) == (*EXPECTED[config][:2], 8)
    assert s["final_loss"] < s["first_loss"]
    recompiles, reasons, breaks = compile_report(run.output)
    assert not breaks and not recompiles and s["compiled_graphs"] == 1, (reasons, breaks, s["compiled_graphs"])
    sys.path.insert(0, str(REPO / "recipes"))
    from mnist import ConvNet
    ConvNet().load_state_dict(run.params(), strict=True)
