"""QLoRA (recipes/finetune_lm.py --load-in-4bit, accelrun/finetune/qlora.py): LoRA on the tiny model's base loaded in
NF4 through bitsandbytes, which trains NF4 on the CPU.

In-process: the refusals (--load-in-4bit without --lora-r; FSDP2 leaving the 4-bit base whole), what the 4-bit layers
store against the planner's NF4 model (bench/lm_memory.py), --merge-lora's weights against the dequantised base plus
the adapters' product (the export finetune_lm.py and dpo.py share), and the 4-bit layers set for training (an evaluation
between two steps, as every run makes one, left their weights as they were and the gradient flowing).

Launched (slow), one launch per engine serving every assertion about it: one process and DDP (fp32, step for step
alike), FSDP2 and ZeRO-3 (bf16, the 4-bit weights stored in bf16, the base sharded); each run checkpoints every 3
steps (the adapters only), and a run resumed from its step 3 ends with its losses and adapter, bit for bit; the
adapter PEFT puts on the 4-bit base, and the merged model from_pretrained loads, give the run's own answer.
"""

import functools
import json
import re
import sys

import pytest
import torch

from launching import REPO, deepspeed_json_in
from run_checks import assert_engine, assert_lora_resumes_exactly, saved_model_keys

sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "bench"))

QLORA = ("--lora-r", "4", "--load-in-4bit", "--merge-lora", "--checkpoint-every", "3", "--keep-last", "0")
# The precision each engine runs QLoRA in: one process and DDP in fp32 (compared step by step), FSDP2 and ZeRO-3 in
# bf16, as on GPUs (4-bit weights stored in bf16, which FSDP2's bf16 gather and DeepSpeed's cast leave as they are).
PRECISION = {"cpu.yaml": "no", "2gpu.yaml": "no", "fsdp.yaml": "bf16", "deepspeed_zero3.yaml": "bf16"}
SHARDED = ("fsdp.yaml", "deepspeed_zero3.yaml")
BASE_LINE = re.compile(r"4-bit base \(NF4\): (\d+) layers, ([\d,]+) of their ([\d,]+) packed elements on this process")


def launch_args(config, hf):
    """ZeRO-3: a copy of its JSON in bf16 with stage3_param_persistence_threshold 0, so that the tiny model's 4-bit
    layers are partitioned as a real model's are (DeepSpeed keeps a parameter below 1e5 elements whole on every
    rank)."""
    if config != "deepspeed_zero3.yaml":
        return ("--mixed_precision", PRECISION[config])
    copy = deepspeed_json_in(config, "bf16", hf / "qlora-json", {"zero_optimization":
                                                                  {"stage3_param_persistence_threshold": 0}})
    return ("--deepspeed_config_file", str(copy))


@pytest.fixture(scope="session")
def qlora(finetune, hf):
    """qlora(config, checkpoint_dir=None) -> LaunchResult of a QLoRA fine-tune (merged export too, a checkpoint every
    3 steps, all kept) into a checkpoint directory of the session's, or the one given."""
    def _qlora(config, checkpoint_dir=None):
        ckpt = checkpoint_dir or hf / f"ckpt-qlora-{config}"
        return finetune(config, *QLORA, "--checkpoint-dir", str(ckpt), launch_args=launch_args(config, hf))
    return _qlora


# ---- in-process -----------------------------------------------------------------------------------------------------

def tiny_4bit(hf, dtype):
    from transformers import AutoModelForCausalLM

    from accelrun.finetune.qlora import quantization_config
    return AutoModelForCausalLM.from_pretrained(hf / "model", dtype=dtype,
                                                quantization_config=quantization_config(dtype))


def test_load_in_4bit_without_lora_is_refused_in_one_line(capsys):
    from finetune_lm import parse_args
    with pytest.raises(SystemExit) as exc:
        parse_args(["--load-in-4bit"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert ": error: --load-in-4bit freezes the base model in 4 bits" in err[0] and "add --lora-r" in err[0]
    assert parse_args(["--load-in-4bit", "--lora-r", "16"]).load_in_4bit


def test_what_the_4bit_layers_store_is_the_planners_nf4(tmp_path):
    """bench/lm_memory.py models QLoRA's base at NF4_BYTES per weight of the decoder's linear layers: what a 4-bit
    layer of this implementation holds (its packed weight in the compute dtype, its scales: 8 bits per block of 64
    weights, and their fp32 scales) is that, to a tenth of a percent, in bf16 and fp32 storage alike."""
    import bitsandbytes as bnb

    from accelrun.finetune import qlora
    from lm_memory import NF4_BYTES
    assert qlora.NF4_BYTES == NF4_BYTES
    for dtype in (torch.bfloat16, torch.float32):
        config = qlora.quantization_config(dtype)
        assert (config.bnb_4bit_quant_storage, config.bnb_4bit_compute_dtype) == (dtype, dtype)
        assert config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
        layer = bnb.nn.Linear4bit(1024, 1024, bias=False, compute_dtype=dtype, compress_statistics=True,
                                  quant_type="nf4", quant_storage=dtype)
        layer.load_state_dict(torch.nn.Linear(1024, 1024, bias=False).state_dict())
        layer = layer.to("cpu")  # quantises
        state = layer.weight.quant_state
        stored = [layer.weight.data, state.absmax, state.state2.absmax]  # the tables (code) are per layer, 16 values
        held = sum(t.numel() * t.element_size() for t in stored)
        assert layer.weight.dtype == dtype and held == pytest.approx(NF4_BYTES * 1024 * 1024, rel=1e-3)


def test_the_4bit_layers_train_after_an_evaluation(hf):
    """for_training(): every run evaluates between steps. On a CPU with AVX512-BF16 bitsandbytes' Linear4bit rewrote
    its weight in place at its first forward in eval mode, and the next training step failed (RuntimeError: shape
    '[32, 0]' is invalid). Kept off, the weight is the same bytes after an evaluation, the adapters of the first layer
    get their gradient through every 4-bit layer above, and the layers' state dicts hold their weights only."""
    from accelrun.finetune.lora import with_lora
    from accelrun.finetune.qlora import for_training, four_bit_layers
    from finetune_lm import parse_args
    model = tiny_4bit(hf, torch.float32)
    assert for_training(model) == 14  # q, k, v, o, gate, up, down in each of the 2 layers
    model = with_lora(model, parse_args(["--model", str(hf / "model"), "--lora-r", "4"]))
    before = [module.weight.data.clone() for _, module in four_bit_layers(model)]
    ids = torch.arange(2, 34)[None]
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    model.train()
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    # The same bytes (a float view of packed bits reads as NaN in places: compared as integers)
    assert all(torch.equal(a.view(torch.int32), module.weight.data.view(torch.int32))
               for a, (_, module) in zip(before, four_bit_layers(model)))
    first = model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
    assert first.lora_A["default"].weight.grad.abs().sum() > 0 or first.lora_B["default"].weight.grad.abs().sum() > 0
    assert not [k for k in model.state_dict() if ".weight." in k]  # no absmax, quant_map...: the weight alone


def test_fsdp2_leaving_the_4bit_base_whole_is_refused_in_one_line(hf):
    """What accelerate does with a layer in fsdp_ignored_modules (or a 4-bit weight stored as integers): it stays
    whole on every rank, with at most a warning. base_note refuses it under FSDP2 with several processes, in one
    line that names the first layer and what to do; alone, or under DDP, the base is whole by design."""
    from accelrun.finetune.qlora import base_note
    model = tiny_4bit(hf, torch.bfloat16)
    problem, note = base_note(model, fsdp=True, world=2)
    assert problem.startswith("FSDP2 left the 4-bit base whole on every rank (model.layers.0.self_attn.q_proj and "
                              "13 more layers)") and "\n" not in problem and "fsdp_ignored_modules" in problem
    assert note == "4-bit base (NF4): 14 layers, 4,608 of their 4,608 packed elements on this process"
    assert base_note(model, fsdp=False, world=2)[0] is None and base_note(model, fsdp=True, world=1)[0] is None


def test_merge_lora_on_a_4bit_base_is_the_dequantised_base_plus_the_adapters(hf, tmp_path):
    """--merge-lora on a 4-bit base (export.export, the path finetune_lm.py and dpo.py share): every adapted layer of
    the written model is that layer's NF4 weight dequantised plus alpha/r * B @ A (nonzero adapters), computed here
    apart from the export's own merge; every other tensor is --model's; and the adapter written beside it is the
    adapters. Merging into the packed 4-bit weights instead of the dequantised base fails here."""
    import types

    from bitsandbytes.functional import dequantize_4bit
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from accelrun.finetune.export import export
    from accelrun.finetune.lora import with_lora
    from accelrun.finetune.qlora import dequantized_base, four_bit_layers
    from finetune_lm import parse_args
    args = parse_args(["--model", str(hf / "model"), "--lora-r", "4", "--lora-alpha", "8", "--load-in-4bit",
                       "--merge-lora", "--save-dtype", "float32"])
    model = with_lora(tiny_4bit(hf, torch.float32), args)
    for name, p in model.named_parameters():
        if "lora_" in name:  # PEFT starts B at zero: random adapters, so that the product matters
            p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) / 8
    expected = {}
    for name, module in four_bit_layers(model):
        layer = model.get_submodule(name.removesuffix(".base_layer"))
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        assert layer.scaling["default"] == 2.0  # alpha 8 / r 4
        base = dequantize_4bit(module.weight.data, module.weight.quant_state).float()
        expected[name.removeprefix("base_model.model.").removesuffix(".base_layer") + ".weight"] = (
            base + 2.0 * (b @ a)).detach()
    assert len(expected) == 14
    weights = {k: (v.float() if v.is_floating_point() else v).clone() for k, v in model.state_dict().items()}
    accelerator = types.SimpleNamespace(unwrap_model=lambda m, keep_torch_compile=False: m)  # one process
    export(weights, model, accelerator, AutoTokenizer.from_pretrained(hf / "model"), args, tmp_path,
           dequantized=dequantized_base(model, keep=True))
    merged, original = (load_file(d / "model" / "model.safetensors") for d in (tmp_path, hf))
    assert merged.keys() == original.keys()
    for key, value in merged.items():
        if key in expected:
            assert torch.allclose(value, expected[key], atol=1e-6, rtol=0), key
            assert (value - original[key]).abs().max() > 1e-2, key  # the adapters are in it
        else:
            assert torch.equal(value, original[key].float()), key
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(adapter) == 28 and all(".lora_A." in k or ".lora_B." in k for k in adapter)


# ---- launched -------------------------------------------------------------------------------------------------------

def logprobs_of(model, summary, bf16):
    """The log-probabilities `model` gives the run's greedy answer."""
    import torch.nn.functional as F
    prompt, new = summary["sample_prompt_ids"], summary["sample_token_ids"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=torch.tensor([prompt + new])).logits
    logp = F.log_softmax(logits[0].float(), dim=-1)[len(prompt) - 1:-1]
    return [logp[i, t].item() for i, t in enumerate(new)]


def assert_exports_answer_as_the_run(run, hf, bf16):
    """The adapter PEFT loads onto the 4-bit base, and the merged model from_pretrained loads (a plain model: no
    quantisation in its config), give the run's greedy answer the run's log-probabilities; the base without the
    adapter does not. The merged model differs from --model in the adapted layers only."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from accelrun.finetune.qlora import for_training
    s, tolerance = run.summary, 2e-2 if bf16 else 1e-4
    base = tiny_4bit(hf, torch.bfloat16 if bf16 else torch.float32)
    for_training(base)  # as the run computed it: no CPU inference repacking
    before = logprobs_of(base, s, bf16)
    assert logprobs_of(PeftModel.from_pretrained(base, run.out_dir / "adapter"), s, bf16) == pytest.approx(
        s["sample_logprobs"], abs=tolerance)
    assert max(abs(a - b) for a, b in zip(before, s["sample_logprobs"])) > 5 * tolerance  # the adapter matters
    config = json.loads((run.out_dir / "model" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    merged = AutoModelForCausalLM.from_pretrained(run.out_dir / "model")
    assert logprobs_of(merged, s, bf16) == pytest.approx(s["sample_logprobs"], abs=tolerance)
    original, exported = (load_file(d / "model.safetensors") for d in (hf / "model", run.out_dir / "model"))
    assert original.keys() == exported.keys()
    for key, weight in original.items():
        dtype = torch.float32 if key.endswith("proj.weight") or not bf16 else torch.bfloat16
        assert torch.equal(weight.to(dtype).float(), exported[key]) == (not key.endswith("proj.weight")), key


def assert_checkpoint_holds_the_adapters_only(step):
    """What a save of each engine wrote for the model: LoRA's adapters, and not one tensor of the 4-bit base (its
    packed weights, nor bitsandbytes' quantisation state: absmax, quant_map...)."""
    keys = saved_model_keys(step)
    assert len(keys) >= 28 and all(".lora_A." in key or ".lora_B." in key for key in keys), keys


@pytest.mark.slow
def test_qlora_trains_alike_under_one_process_and_ddp(qlora, hf):
    """One process and DDP (fp32): the same losses step by step (the loss token-weighted over the whole step), the
    4-bit base whole on every process; the exports give the run's answer."""
    one, ddp = qlora("cpu.yaml"), qlora("2gpu.yaml")
    for run, config in ((one, "cpu.yaml"), (ddp, "2gpu.yaml")):
        s = run.summary
        assert_engine(s, config)
        assert s["quantized_base"] == "nf4" and s["lora_r"] == 4 and s["frozen_dtype"] == "float32"
        assert s["model_init"] == "built whole on every process" and s["final_loss"] < s["first_loss"]
        assert len(set(s["param_elements_per_rank"])) == 1 and len(set(s["param_checksum_per_rank"])) == 1
        layers, held, whole = BASE_LINE.search(run.output).groups()
        assert layers == "14" and held == whole, run.output[-3000:]
    assert [m["loss"] for m in ddp.metrics] == pytest.approx([m["loss"] for m in one.metrics], rel=1e-5)
    assert_exports_answer_as_the_run(one, hf, bf16=False)


@pytest.mark.slow
@pytest.mark.parametrize("config", SHARDED)
def test_qlora_shards_the_4bit_base_under_fsdp2_and_zero3(qlora, hf, config):
    """FSDP2 and ZeRO-3 in bf16: each of the 2 processes holds half the 4-bit base (the first line says so, and the
    summary's parameters per rank); it trains, and the exports give the run's answer at bf16's resolution."""
    run = qlora(config)
    s = run.summary
    assert_engine(s, config)
    assert s["mixed_precision"] == "bf16" and s["frozen_dtype"] == "bfloat16" and s["final_loss"] < s["first_loss"]
    assert s["model_init"] == "loaded whole and quantised by every process, sharded by prepare()"
    layers, held, whole = (int(n.replace(",", "")) for n in BASE_LINE.search(run.output).groups())
    assert layers == 14 and held < whole <= 2 * held, run.output[-3000:]
    assert all(n < s["param_elements"] for n in s["param_elements_per_rank"])
    assert_exports_answer_as_the_run(run, hf, bf16=True)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["cpu.yaml", *SHARDED])
def test_qlora_checkpoint_holds_the_adapters_and_resumes_exactly(qlora, hf, tmp_path, config):
    """Each checkpoint format (one process's, FSDP2's, DeepSpeed's) holds the adapters only; resumed from step 3 (the
    checkpoint a stop leaves), the run ends with the uninterrupted run's losses and adapter, bit for bit."""
    ref = qlora(config)
    step3 = hf / f"ckpt-qlora-{config}" / "step-00000003"
    assert_checkpoint_holds_the_adapters_only(step3)
    assert_lora_resumes_exactly(functools.partial(qlora, config), ref, step3, tmp_path)
