"""The model built sharded from the start under ZeRO-3 and FSDP, never whole on every process: the words the summary
uses for how it was built, and the allocation without writing that FSDP2's building uses.

run.sharded_init() asks the run's engine (engines/): Engine.building yields one of these words. ZeRO-3 with
zero3_init_flag: DeepSpeed's zero.Init partitions each module's weights as its constructor returns, so no process
ever holds the whole model (engines/zero.py). FSDP: only the main process writes real weights, the others allocate
theirs without touching them (allocated_not_written), and prepare() sends each rank its shards (engines/fsdp2.py). A
Hugging Face model from from_pretrained is loaded partitioned by transformers itself under ZeRO-3; under FSDP every
process maps the weight files (safetensors, shared page cache) and prepare() shards the main process's values. A
quantised from_pretrained (finetune_lm's QLoRA) is loaded whole and quantised by every process, as transformers loads
a quantised model outside zero.Init and accelerate shards each process's own copy of 4-bit weights under FSDP2;
prepare() then shards or partitions it (QUANTISED_SHARDED). Under FSDP2 with float8 every process builds or loads it
whole and prepare() shards its own copy (FLOAT8_WHOLE): torchao's float8 weights do not survive accelerate's
broadcast. Anything else, and any model built outside
sharded_init(): built whole (BUILT_WHOLE). The one refusal that follows from it, a pretrained model ZeRO-3 without
zero3_init_flag would load whole on processes that cannot hold it, is the DeepSpeed engine's
(check_whole_model_fits).
"""

import contextlib

import torch

BUILT_WHOLE = "built whole on every process"  # any model built outside sharded_init(), too
QUANTISED_SHARDED = "loaded whole and quantised by every process, sharded by prepare()"
# FSDP2 with float8 (fsdp_fp8.yaml): accelerate refuses torchao's float8 with its broadcast from the main process. A
# model initialised at random is then the same on every process only when it is built after set_seed(), as every
# recipe here builds it; a from_pretrained one is the files'.
FLOAT8_WHOLE = "built whole on every process (float8: prepare() shards each process's own copy)"


@contextlib.contextmanager
def allocated_not_written():
    """torch.nn.init does nothing inside: the weights are allocated but never written, so the operating
    system never maps their pages and they take no memory; prepare() fills in the main process's values.
    (Not the meta device: accelerate matches the optimizer's parameters by address, and meta has none.)"""
    init = torch.nn.init
    saved = {name: getattr(init, name) for name in dir(init) if name.endswith("_") and not name.startswith("_")}
    for name in saved:
        setattr(init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(init, name, function)
