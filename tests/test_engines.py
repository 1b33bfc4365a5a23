"""src/accelrun/engines/: one engine object per way of running, asked once, and no other module of accelrun branching
on the engine (issue 54, items 1 and 6). Quick: fake accelerators, no launch; the launches under each engine are the
recipes' matrices and test_checkpoint_resume.py."""

import ast
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from accelrun.engines import FSDP2, DeepSpeed, Engine, OneProcessOrDDP
from launching import REPO

PACKAGE = REPO / "src" / "accelrun"
ENGINE_MODULES = PACKAGE / "engines"

# What reading the engine looks like: accelerate's distributed type, by its enum or the accelerator's attribute, and
# the engines' own objects on the accelerator's state.
ENGINE_ATTRIBUTES = {"DistributedType", "distributed_type", "deepspeed_plugin", "fsdp_plugin"}
# An engine named by a string: a DistributedType value ("DEEPSPEED", "FSDP", "MULTI_GPU"...), a checkpoint family
# ("deepspeed", "fsdp", "full"), the variable accelerate launch sets for a config of it. Compared whole: prose that
# names DeepSpeed in a message or a docstring branches on nothing.
ENGINE_STRINGS = ({t.value for t in DistributedType} | {kind.family for kind in Engine.kinds}
                  | {kind.launch_env for kind in Engine.kinds if kind.launch_env} | {"deepspeed", "fsdp", "ddp"})


def docstrings(tree):
    """The docstring nodes of a module, its classes and functions (prose, not branches)."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    owners = [tree] + [n for n in ast.walk(tree) if isinstance(n, kinds)]
    return {id(owner.body[0].value) for owner in owners if owner.body and isinstance(owner.body[0], ast.Expr)
            and isinstance(owner.body[0].value, ast.Constant) and isinstance(owner.body[0].value.value, str)}


def engine_mentions(source):
    """Where a module's source reads which engine runs: a DistributedType or an engine object of the accelerator's
    (by name or attribute), or an engine's name as a string constant (docstrings aside)."""
    tree = ast.parse(source)
    prose, found = docstrings(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in ENGINE_ATTRIBUTES:
            found.append(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in ENGINE_ATTRIBUTES:
            found.append(f".{node.attr}")
        elif isinstance(node, ast.ImportFrom):
            found += [alias.name for alias in node.names if alias.name in ENGINE_ATTRIBUTES]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
              and (node.value in ENGINE_STRINGS or node.value.lower() in {"deepspeed", "fsdp"})):
            found.append(repr(node.value))
    return found


def test_the_check_sees_each_way_of_branching_on_the_engine():
    """The check below is sound: each way a module could branch on the engine is caught, prose is not."""
    assert sorted(engine_mentions("if accelerator.distributed_type == DistributedType.FSDP: pass")) == [
        ".distributed_type", "DistributedType"]
    assert engine_mentions("from accelerate.utils import DistributedType") == ["DistributedType"]
    assert engine_mentions("x = facts['distributed_type'] == 'DEEPSPEED'") == ["'DEEPSPEED'"]
    assert engine_mentions("x = layout['family'] == 'fsdp'") == ["'fsdp'"]
    assert engine_mentions("x = os.environ.get('ACCELERATE_USE_FSDP')") == ["'ACCELERATE_USE_FSDP'"]
    assert engine_mentions("x = config.sp_backend == 'DeepSpeed'") == ["'DeepSpeed'"]
    assert engine_mentions("p = accelerator.state.deepspeed_plugin") == [".deepspeed_plugin"]
    prose = 'def f():\n    """Under DeepSpeed and FSDP: deepspeed."""\n    return "DeepSpeed clips"'
    assert engine_mentions(prose) == []


def test_no_module_outside_the_engines_branches_on_the_engine():
    """Issue 54, item 1: what each way of running needs is its engine's (src/accelrun/engines/); every other module
    of accelrun asks the engine (Engine.of(accelerator), or Run's, the checkpointer's) and names no distributed type or
    engine by string."""
    modules = [p for p in sorted(PACKAGE.rglob("*.py")) if ENGINE_MODULES not in p.parents]
    assert len(modules) > 40, modules
    found = {str(p.relative_to(PACKAGE)): engine_mentions(p.read_text()) for p in modules}
    assert {name: where for name, where in found.items() if where} == {}


class FakeAccelerator:
    """What an engine reads of an Accelerator: its distributed type and processes, its accumulation steps and
    precision, accelerate's parallelism_config (sequence parallelism) and the DeepSpeed plugin's JSON."""

    def __init__(self, distributed_type, processes=2, sp=1, stage=None, rank=0):
        self.distributed_type, self.num_processes, self.process_index = distributed_type, processes, rank
        self.is_main_process, self.gradient_accumulation_steps, self.mixed_precision = rank == 0, 1, "no"
        self.parallelism_config = (SimpleNamespace(sp_size=sp, sp_backend="deepspeed", sp_handler=None)
                                   if sp > 1 else None)
        zero = {"zero_optimization": {"stage": stage}}
        plugin = SimpleNamespace(deepspeed_config=zero) if stage is not None else None
        self.state = SimpleNamespace(deepspeed_plugin=plugin, dynamo_plugin=None)


@pytest.mark.parametrize("distributed_type", list(DistributedType), ids=lambda t: t.value)
def test_one_engine_per_distributed_type_decided_once(distributed_type):
    """Engine.of gives DeepSpeed for DEEPSPEED, FSDP2 for FSDP, OneProcessOrDDP for every other type; the same object
    each time it is asked for one accelerator; and a checkpoint layout it records names the engine back."""
    wanted = {DistributedType.DEEPSPEED: DeepSpeed, DistributedType.FSDP: FSDP2}.get(distributed_type, OneProcessOrDDP)
    accelerator = FakeAccelerator(distributed_type, stage=2 if wanted is DeepSpeed else None)
    engine = Engine.of(accelerator)
    assert type(engine) is wanted and Engine.of(accelerator) is engine
    assert Engine.of_layout(engine.layout()) is wanted
    assert Engine.of(FakeAccelerator(distributed_type, stage=2 if wanted is DeepSpeed else None)) is not engine


def test_each_engine_labels_its_runs_as_before():
    """The default output directory's label, per engine (runs/<recipe>/<label>): unchanged by the regrouping."""
    labels = {(DistributedType.NO, 1, 1, None): "1proc", (DistributedType.MULTI_CPU, 2, 1, None): "ddp-2proc",
              (DistributedType.DEEPSPEED, 2, 1, 2): "zero2-2proc",
              (DistributedType.DEEPSPEED, 2, 2, 3): "zero3-sp2-2proc", (DistributedType.FSDP, 2, 1, None): "fsdp-2proc"}
    for (kind, processes, sp, stage), label in labels.items():
        assert Engine.of(FakeAccelerator(kind, processes, sp, stage)).label() == label


def test_the_batch_is_split_over_the_data_parallel_readers_not_every_process(monkeypatch):
    """Issue 54, item 6: under sequence parallelism the processes of a group read the same sequences, so the global
    batch must divide by the data-parallel readers (processes / sp size) x --grad-accum, not by every process: 4
    processes in groups of 2 train a batch of 2 (one sequence per group); a batch of 3 is refused, naming 2. A check
    that counted every process (readers = num_processes) refused the batch of 2."""
    from accelrun import refusals
    from accelrun.finetune.ulysses import SequenceParallel

    said = []
    monkeypatch.setattr(refusals, "fail", lambda accelerator, message, everyone=False: said.append(message))
    grouped = FakeAccelerator(DistributedType.DEEPSPEED, processes=4, sp=2, stage=3)
    assert Engine.of(grouped).readers == 2 == SequenceParallel.of(grouped).data_parallel
    refusals.check_batch(grouped, 2, 1, None, Namespace(resume="none", checkpoint_dir=None))
    assert said == []
    refusals.check_batch(grouped, 3, 1, None, Namespace(resume="none", checkpoint_dir=None))
    assert len(said) == 1 and "must divide by processes x --grad-accum = 2" in said[0], said
    refusals.check_batch(FakeAccelerator(DistributedType.DEEPSPEED, processes=4, stage=3), 2, 1, None, None)
    assert len(said) == 2 and "= 4" in said[1], said  # without sequence parallelism every process reads its own


def test_the_checkpoint_layout_records_the_sequence_parallel_size_and_a_resume_is_judged_by_it():
    """Issue 54, item 6: the layout a run's checkpoints record (the checkpointer's, from its engine) holds the
    sequence-parallel size where it is above 1, so a resume under another size is refused; layouts are the engines'
    here, not written by hand. A layout that dropped the size let a run without sequence parallelism resume one
    written with it."""
    from accelrun.checkpoint.checkpointer import Scope
    from accelrun.checkpoint.manifest import _layout_problem
    from accelrun.checkpoint.rules import incompatibility

    model = torch.nn.Linear(2, 2)
    with_sp, without = (Scope(FakeAccelerator(DistributedType.DEEPSPEED, 2, sp, 3), None, {}, model, "x").layout
                        for sp in (2, 1))
    assert with_sp["sequence_parallel"] == 2 and "sequence_parallel" not in without
    assert _layout_problem(with_sp) is None and _layout_problem(without) is None
    problem = incompatibility({"layout": with_sp, "must_match": {}}, without, {})
    assert "written with sequence parallelism of size 2 and this run has 1" in problem, problem
    assert "of size 1 and this run has 2" in incompatibility({"layout": without, "must_match": {}}, with_sp, {})
    assert incompatibility({"layout": with_sp, "must_match": {}}, with_sp, {}) is None
