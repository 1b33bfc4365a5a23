"""recipes/finetune_lm.py on a tiny random Llama and a tokenizer built here (accelrun.data.tiny_hf), saved in
Hugging Face's formats, launched for real under every config (2 CPU processes).

One launch per config serves every assertion about it: the engine, the step-by-step match with one
process, and the exported model directory loaded back with from_pretrained. The data is uneven.jsonl,
whose responses run from 1 to 30 words, so a loss that were not weighted by tokens over the whole
optimizer step would differ between 1 and 2 processes. The LoRA runs serve the adapter checks and,
through their checkpoints, the resume tests. The model, the data and the cached runs are conftest.py's fixtures (hf,
finetune, lora), shared with test_stop_and_crash.py, which stops and kills fine-tunes; the data's own tests are in
test_finetune_data.py.
"""

import json
import re
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

from accelrun.data.tiny_hf import conversations, corpus, uneven_pairs
from launching import (
    CONFIG_FILES,
    FINETUNE_BATCH,
    FINETUNE_BLOCK,
    FINETUNE_STEPS,
    LORA,
    LORA_PRECISION,
    OFFLOAD,
    REPO,
    LaunchResult,
    finetune_args,
    run_command,
    run_commands,
)
from planted import planted_copy
from run_checks import assert_engine, assert_refused, assert_shards_held

sys.path.insert(0, str(REPO / "recipes"))
STEPS, BATCH, BLOCK = FINETUNE_STEPS, FINETUNE_BATCH, FINETUNE_BLOCK


def sample_logprobs(model, summary, bf16=False):
    """The log-probabilities `model` gives the run's greedy answer, and its own greedy choices at each position."""
    prompt, new = summary["sample_prompt_ids"], summary["sample_token_ids"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=torch.tensor([prompt + new])).logits
    logp = F.log_softmax(logits[0].float(), dim=-1)[len(prompt) - 1:-1]
    return [logp[i, t].item() for i, t in enumerate(new)], logp.argmax(-1).tolist()


def reloaded_logprobs(model_dir, summary):
    from transformers import AutoModelForCausalLM
    return sample_logprobs(AutoModelForCausalLM.from_pretrained(model_dir), summary)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIG_FILES)  # the *_compile.yaml ones too
def test_finetune_under_every_config(finetune, config):
    run = finetune(config, env=GRAPH_CODE if config == "1gpu_compile.yaml" else None)
    s = run.summary
    assert_engine(s, config)
    assert s["steps"] == STEPS and s["data_format"] == "pairs" and s["exported_dtype"] == "float32"
    assert s["optimizer"] == ("DeepSpeedCPUAdam" if config == OFFLOAD else "AdamW")
    assert_shards_held(s, config)
    loaded = {"deepspeed_zero3.yaml": "partitioned while loaded (transformers, zero.Init)",
              OFFLOAD: "partitioned while loaded (transformers, zero.Init)",
              "fsdp.yaml": "weight files mapped by every process, sharded by prepare() from the main process's copy"}
    assert s["model_init"] == loaded.get(config, "built whole on every process")
    assert len(s["host_peak_gb_at_start_per_rank"]) == s["world_size"] and s["device_peak_gb_at_start_per_rank"] is None
    # FSDP2 shards per decoder layer (the model's _no_split_modules): the 2 layers, the embedding, the final norm
    # and the head (one group of two modules), and the root.
    assert s["fsdp_units"] == (6 if config == "fsdp.yaml" else None)
    tokens = STEPS * BATCH * BLOCK
    assert tokens / s["wall_time_s"] <= s["tokens_per_s"] <= tokens / run.metrics[-1]["train_time_s"], s
    assert s["mfu"] > 0 and s["final_loss"] < s["first_loss"]
    # DeepSpeed's per-step collectives no longer print torch's deprecation warning at every step.
    assert "is deprecated. Please use `torch.distributed" not in run.output, run.output[-3000:]
    # The exported directory: from_pretrained loads it (tokenizer too), and its logits are the run's.
    from transformers import AutoTokenizer
    model_dir = run.out_dir / "model"
    assert AutoTokenizer.from_pretrained(model_dir).decode(s["sample_prompt_ids"]) == s["sample_prompt"]
    logprobs, choices = reloaded_logprobs(model_dir, s)
    assert choices == s["sample_token_ids"] and len(choices) >= 1
    assert logprobs == pytest.approx(s["sample_logprobs"], abs=1e-5)
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "float32"
    if config == "cpu.yaml":
        return
    one = finetune("cpu.yaml")  # the reference: DDP, ZeRO and FSDP follow it step by step
    # DeepSpeed's CPU Adam and inductor's fused kernels round differently from eager torch.
    tolerance = 1e-3 if config == OFFLOAD or "compile" in config else 1e-4
    assert [m["step"] for m in run.metrics] == [m["step"] for m in one.metrics] == list(range(1, STEPS + 1))
    for a, b in zip(one.metrics, run.metrics):
        assert b["loss"] == pytest.approx(a["loss"], rel=tolerance), (config, a, b)


@pytest.mark.slow
def test_pad_token_never_reaches_the_loss(finetune, hf):
    """The same run with the pad token swapped for the end-of-sequence token trains exactly the same: padding
    is neither learned nor attended to (it follows the last real token, and attention is causal)."""
    a, b = finetune("cpu.yaml"), finetune("cpu.yaml", model="model_pad_is_eos")
    assert [m["loss"] for m in a.metrics] == [m["loss"] for m in b.metrics]
    assert a.summary["val_loss"] == b.summary["val_loss"]
    # The share of positions in the loss is the responses' tokens and their end-of-sequence tokens, as far
    # as the block holds them.
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(hf / "model")
    per_pair = [min(len(tok(p)["input_ids"]) + len(tok(r, add_special_tokens=False)["input_ids"]) + 1, BLOCK)
                - len(tok(p)["input_ids"]) for p, r in uneven_pairs()]
    kept = [n for n in per_pair if n > 0]
    assert min(kept) / (BLOCK - 1) <= a.summary["loss_positions_share"] <= max(kept) / (BLOCK - 1)


@pytest.mark.slow
def test_packed_text_and_bf16_export(finetune):
    run = finetune("2gpu.yaml", "--save-dtype", "bfloat16", data="text.txt")
    s = run.summary
    assert s["data_format"] == "text" and s["loss_positions_share"] == 1.0 and s["exported_dtype"] == "bfloat16"
    from safetensors import safe_open
    with safe_open(run.out_dir / "model" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    # config.json names the dtype of the file, not of the fp32 model that wrote it: from_pretrained then loads bf16.
    assert json.loads((run.out_dir / "model" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.slow
def test_loss_is_weighted_by_tokens_over_the_whole_step(finetune):
    """Responses of 1 to 30 words: 1 process, --grad-accum 2 and 2-process DDP give the same losses, because
    the loss is the mean over every loss token of the optimizer step (a mean per micro-batch or per rank
    differs by 3e-4 at step 2). The evaluation at step 4 reads the same examples in all three."""
    one, accumulated, ddp = finetune("cpu.yaml"), finetune("cpu.yaml", "--grad-accum", "2"), finetune("2gpu.yaml")
    for run in (accumulated, ddp):
        assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
        for a, b in zip(one.metrics, run.metrics):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
            assert b.get("val_loss", 0) == pytest.approx(a.get("val_loss", 0), rel=1e-5), (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("config", list(LORA_PRECISION))
def test_lora_adapter_loads_with_peft(lora, hf, config):
    """The adapter PEFT loads onto the untouched base gives the run's own answer; so does the merged export;
    only the adapted layers' weights differ from the base. FSDP2 runs in bf16: a bf16 frozen base with fp32
    adapters, compared at bf16's resolution."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    run = lora(config)
    s = run.summary
    assert_engine(s, config)
    assert s["mixed_precision"] == LORA_PRECISION[config] and s["lora_r"] == 4 and s["final_loss"] < s["first_loss"]
    assert s["frozen_dtype"] == ("bfloat16" if LORA_PRECISION[config] == "bf16" else "float32")
    assert_shards_held(s, config)  # ZeRO-3 and FSDP2: the frozen base sharded too
    if config == "deepspeed_zero3.yaml":
        assert s["model_init"] == "partitioned while loaded (transformers, zero.Init)"
    cfg = json.loads((hf / "model" / "config.json").read_text())
    d, ff = cfg["hidden_size"], cfg["intermediate_size"]
    kv = d // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    # Rank-4 A and B matrices on q, o (d -> d), k, v (d -> kv), gate, up (d -> ff) and down (ff -> d).
    assert s["trainable_params"] == cfg["num_hidden_layers"] * 4 * (2 * 2 * d + 2 * (d + kv) + 3 * (d + ff))
    bf16 = LORA_PRECISION[config] == "bf16"
    tolerance = 2e-2 if bf16 else 1e-5
    dtype = torch.bfloat16 if bf16 else torch.float32
    base = AutoModelForCausalLM.from_pretrained(hf / "model", dtype=dtype)
    before, _ = sample_logprobs(base, s, bf16)
    adapted = PeftModel.from_pretrained(base, run.out_dir / "adapter")
    after, choices = sample_logprobs(adapted, s, bf16)
    assert after == pytest.approx(s["sample_logprobs"], abs=tolerance)
    assert max(abs(a - b) for a, b in zip(before, s["sample_logprobs"])) > 10 * tolerance  # the adapter matters
    merged = AutoModelForCausalLM.from_pretrained(run.out_dir / "model")
    assert sample_logprobs(merged, s, bf16)[0] == pytest.approx(s["sample_logprobs"], abs=tolerance)
    assert json.loads((run.out_dir / "model" / "config.json").read_text())["dtype"] == "float32"
    original, exported = (load_file(d / "model.safetensors") for d in (hf / "model", run.out_dir / "model"))
    assert original.keys() == exported.keys()
    for key, weight in original.items():
        same = torch.equal(weight.to(dtype).float(), exported[key])
        assert same == (not key.endswith("proj.weight")), key


@pytest.mark.slow
def test_a_lora_run_on_a_base_whose_weights_were_replaced_is_refused(hf, tmp_path):
    """Issue 41, item 2: a LoRA checkpoint recorded its base as a path only, and the same command resumed onto
    another model's weights in silence (an adapter trained on two bases). Now the checkpoint holds the base's
    fingerprint: the run continued (--max-steps 3 -> 6) after the weights in --model were replaced is refused in one
    line (exit 2 from python; 1 under accelerate launch), and the documented adapter snippet's check_base refuses the
    adapter. The finished run's own command again trains nothing whatever the base holds now (it says the run is
    complete, before any model loads)."""
    from transformers import AutoTokenizer

    from accelrun.data.tiny_hf import write_model
    from accelrun.finetune.weights import WeightsProblem, check_base
    base, out = shutil.copytree(hf / "model", tmp_path / "base"), tmp_path / "out"
    cmd = [sys.executable, "recipes/finetune_lm.py", *finetune_args(hf), "--model", str(base), *LORA,
           "--max-steps", "3", "--checkpoint-dir", str(tmp_path / "ckpt"), "--output-dir", str(out)]
    first = LaunchResult(*run_command(cmd), out)
    assert first.returncode == 0 and first.summary["steps"] == 3, first.output[-3000:]
    check_base(out / "adapter", str(base))  # its own base: accepted
    write_model(tmp_path / "other", AutoTokenizer.from_pretrained(base), seed=1)  # the same shapes, other weights
    shutil.copy(tmp_path / "other" / "model.safetensors", base / "model.safetensors")
    complete = LaunchResult(*run_command(cmd), out)
    assert complete.returncode == 0 and "this run is already complete" in complete.output, complete.output[-3000:]
    again = LaunchResult(*run_command([*cmd, "--max-steps", "6"]), out)
    assert again.returncode == 2, again.output[-3000:]
    assert_refused(again, f"step-00000003: its LoRA adapters were trained on other base weights than --model {base} "
                          f"holds now")
    with pytest.raises(WeightsProblem, match="does not hold the weights the adapter in"):
        check_base(out / "adapter", str(base))


@pytest.mark.slow
def test_each_input_error_is_one_clear_message(finetune, hf, tmp_path):
    offline = {"HF_HUB_OFFLINE": "1"}
    planted = {problem: str(planted_copy(hf / "model", tmp_path / problem, problem))
               for problem in ("pickle", "raising-template")}  # test_model_dir.py has each problem in this process
    cases = [
        (["--model", "no-such-org/no-such-model"], offline, "cannot load model 'no-such-org/no-such-model'"),
        (["--block-size", "4096"], {}, "longer than"),
        (["--model", "./llama-8b"], offline, "--model './llama-8b': no such directory"),  # not "a malformed hub id"
        (["--model", planted["pickle"]], {}, "pytorch_model.bin holds a pickle that would run code"),
        (["--model", planted["raising-template"], "--data-files", str(hf / "chat.jsonl")], {},
         f"{hf / 'chat.jsonl'}, line 1: the chat template of {planted['raising-template']} fails on this conversation"),
    ]
    outs = [tmp_path / f"out{i}" for i in range(len(cases))]
    commands = [([sys.executable, "recipes/finetune_lm.py", *finetune_args(hf), "--output-dir", str(out), *args], env)
                for out, (args, env, _) in zip(outs, cases)]
    for out, (_, _, words), result in zip(outs, cases, run_commands(commands)):
        assert_refused(LaunchResult(*result, out), words)
    # Columns that are not there, found by the main process while the other waits for its cache: both leave.
    (hf / "qa.jsonl").write_text("".join(json.dumps({"question": p, "answer": r}) + "\n" for p, r in corpus(40)))
    columns = finetune("2gpu.yaml", data="qa.jsonl", check=False)
    assert_refused(columns, "not ['prompt', 'response']: name them with --prompt-column")
    # ZeRO-3 without zero3_init_flag: every process would load all 70B parameters first.
    big = finetune("deepspeed_zero3.yaml", model="big", check=False,
                   launch_args=("--mixed_precision", "no", "--zero3_init_flag", "false"))
    assert_refused(big, "Set zero3_init_flag: true")


# finetune_lm.py under two watches, for the attention tests below: transformers' packed-sequence check
# (masking_utils.find_packed_sequence_indices, whose `.all()` on a device tensor is a host sync in every forward)
# must not be reached outside compilation, and what PyTorch's SDPA receives is written to OUTPUT_DIR/sdpa.json.
WATCH = """
import atexit, json, os, runpy, sys
import torch
import transformers.masking_utils as masking

calls, first_mask = {}, []
real_check, real_sdpa = masking.find_packed_sequence_indices, torch.nn.functional.scaled_dot_product_attention


def check(position_ids):
    if not torch.compiler.is_compiling():
        raise RuntimeError("WATCH: find_packed_sequence_indices reached outside compilation (a host sync)")
    return real_check(position_ids)


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
    kind = "none" if attn_mask is None else f"{attn_mask.dtype} {list(attn_mask.shape)}"
    calls[f"{kind} causal={is_causal}"] = calls.get(f"{kind} causal={is_causal}", 0) + 1
    if attn_mask is not None and not first_mask and query.requires_grad:
        first_mask.append(attn_mask[0, 0].tolist())
    return real_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)


def dump():
    out = sys.argv[sys.argv.index("--output-dir") + 1]
    with open(os.path.join(out, "sdpa.json"), "w") as f:
        json.dump({"calls": calls, "first_mask": first_mask[0] if first_mask else None}, f)


masking.find_packed_sequence_indices = check
torch.nn.functional.scaled_dot_product_attention = sdpa
atexit.register(dump)
sys.argv[0] = "recipes/finetune_lm.py"
sys.path.insert(0, "recipes")
runpy.run_path("recipes/finetune_lm.py", run_name="__main__")
"""
# Dynamo prints the graphs it compiles: each SDPA call with its arguments.
GRAPH_CODE = {"TORCH_LOGS": "graph_code"}


def sdpa_in_graphs(output):
    """(attn_mask, is_causal) of every SDPA call in the graphs dynamo compiled (TORCH_LOGS=graph_code)."""
    return re.findall(r"scaled_dot_product_attention\(.*?attn_mask = (\w+).*?is_causal = (\w+)", output)


def assert_block_diagonal(mask):
    """Each position attends to itself and the positions before it in its own example, and nothing else: its row
    is one run of True from its example's first position to itself, and an example starts where the last ended."""
    start = 0
    for q, row in enumerate(mask):
        allowed = [k for k, a in enumerate(row) if a]
        if allowed[0] == q:
            start = q  # a new example (or the padding after the last one) starts here
        assert allowed == list(range(start, q + 1)), (q, allowed)
    assert any(row.index(True) > 0 for row in mask), "one example per block: nothing was packed"


@pytest.fixture(scope="module")
def watch(hf):
    path = hf / "watched_finetune_lm.py"
    path.write_text(WATCH)
    return str(path)


@pytest.mark.slow
def test_no_host_sync_in_eager_steps(finetune, watch):
    """Issue 32, item 2: the model is given what it needs to never look for packed sequences itself (a host sync
    per forward on a GPU): an eager run never reaches find_packed_sequence_indices, and SDPA gets the
    block-diagonal causal mask of the packed pairs in training and evaluation."""
    run = finetune("cpu.yaml", recipe=watch, check=False)
    assert run.returncode == 0 and "WATCH" not in run.output, run.output[-3000:]
    seen = json.loads((run.out_dir / "sdpa.json").read_text())
    micro = f"torch.bool [{BATCH}, 1, {BLOCK}, {BLOCK}] causal=False"
    assert seen["calls"].get(micro, 0) > 0, seen["calls"]
    assert_block_diagonal(seen["first_mask"])
    assert run.summary["final_loss"] == finetune("cpu.yaml").summary["final_loss"]  # the watch changes nothing


@pytest.mark.slow
def test_compiled_attention_is_causal_without_a_mask_where_nothing_is_packed(finetune):
    """Issue 32, item 2: under torch.compile transformers' packed-sequence check always answers "packed" and
    builds a mask; here SDPA gets none and is_causal (the flash kernel on a GPU) where examples are not packed
    (plain text), and the block-diagonal mask where they are (the pairs)."""
    text = finetune("1gpu_compile.yaml", data="text.txt", env=GRAPH_CODE)
    calls = sdpa_in_graphs(text.output)
    assert calls and set(calls) == {("None", "True")}, calls
    packed = finetune("1gpu_compile.yaml", env=GRAPH_CODE)
    calls = sdpa_in_graphs(packed.output)
    assert calls and all(mask != "None" and causal == "False" for mask, causal in calls), calls


def per_position_losses(model, block, given_mask):
    """The next-token loss at each position of one block, from what the recipe gives the model (given_mask: the
    dense block-diagonal mask, else the model's own)."""
    from accelrun.finetune.packing import block_causal_mask
    from finetune_lm import model_inputs
    batch = {k: torch.tensor([v]) for k, v in block.items() if k in ("input_ids", "labels", "position_ids")}
    with torch.no_grad():
        logits = model(**model_inputs(batch, block_causal_mask if given_mask else None)).logits[0, :-1]
    return F.cross_entropy(logits, batch["input_ids"][0, 1:], reduction="none")


@pytest.mark.parametrize("attention", ["given mask", "the model's own"])
def test_a_packed_example_attends_only_to_itself(hf, attention):
    """Three examples packed in one block: changing the middle one changes its own losses and no other's, and each
    example's losses are those it has alone in a block (its positions restart at 0). Both ways the recipe runs
    attention: the block-diagonal mask it gives (packing.GIVEN_MASK), and for models with a sliding window
    shorter than the block, transformers' own masks built from the positions."""
    from transformers import AutoModelForCausalLM

    from accelrun.finetune.packing import GIVEN_MASK, pack_blocks
    implementation = GIVEN_MASK if attention == "given mask" else None
    if implementation:
        from accelrun.finetune.packing import attention_implementation
        assert attention_implementation(AutoModelForCausalLM.from_pretrained(hf / "model").config, 64) == GIVEN_MASK
    model = AutoModelForCausalLM.from_pretrained(hf / "model", attn_implementation=implementation).eval()
    model.config.use_cache = False  # as the recipe trains: with a cache, transformers looks for no packing
    generator = torch.Generator().manual_seed(0)
    examples = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (14, 20, 17)]
    changed = [examples[0], torch.randint(3, 300, (20,), generator=generator).tolist(), examples[2]]
    pack = pack_blocks(block_size=64, pad_id=2)
    blocks = [pack({"input_ids": e, "labels": e}) for e in (examples, changed)]
    assert all(len(b["input_ids"]) == 1 and b["examples"] == [3] for b in blocks)
    before, after = (per_position_losses(model, {k: v[0] for k, v in b.items()}, implementation is not None)
                     for b in blocks)
    order = [20, 17, 14]  # longest first: the middle example is first in the block
    spans = dict(zip(order, [(0, 20), (20, 37), (37, 51)]))
    first, middle, last = spans[14], spans[20], spans[17]
    for start, end in (first, last):  # an example's losses: its own tokens after its first one
        assert torch.allclose(before[start:end - 1], after[start:end - 1], atol=1e-6, rtol=0)
    assert not torch.allclose(before[middle[0]:middle[1] - 1], after[middle[0]:middle[1] - 1])
    for example, (start, end) in zip(examples, (first, middle, last)):
        alone = pack({"input_ids": [example], "labels": [example]})
        own = per_position_losses(model, {k: v[0] for k, v in alone.items()}, implementation is not None)
        assert torch.allclose(before[start:end - 1], own[:end - start - 1], atol=1e-5, rtol=0)


def test_lora_adapters_compute_in_the_compute_dtype(hf):
    """LoRA's adapters keep fp32 weights (the optimizer's), and under autocast take their bf16 input as it comes:
    PEFT's default would copy it to fp32 for autocast to cast it back. The logits are exactly PEFT's default ones.
    Where no autocast runs (DeepSpeed in bf16), the adapters are bf16 themselves and give the same to bf16
    rounding. The default dropout is 0 (it copies every adapted layer's input)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from accelrun.finetune.lora import with_lora
    from finetune_lm import parse_args
    args = parse_args(["--model", str(hf / "model"), "--lora-r", "4"])
    assert args.lora_dropout == 0
    base = AutoModelForCausalLM.from_pretrained(hf / "model", dtype=torch.bfloat16)
    ours = with_lora(copy.deepcopy(base), args)
    default = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    engine_cast = with_lora(copy.deepcopy(base), args, adapter_dtype=torch.bfloat16)
    for model in (ours, default, engine_cast):
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))).to(p.dtype) / 8
    assert {p.dtype for n, p in ours.named_parameters() if "lora_" in n} == {torch.float32}
    assert {p.dtype for n, p in engine_cast.named_parameters() if "lora_" in n} == {torch.bfloat16}
    seen = {}

    def input_dtype(name):
        def hook(module, inputs):
            seen.setdefault(name, inputs[0].dtype)
        return hook
    for name, model in (("ours", ours), ("default", default)):
        next(m for m in model.modules() if hasattr(m, "lora_A")).lora_A["default"].register_forward_pre_hook(
            input_dtype(name))
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits, reference = ours(input_ids=ids).logits, default(input_ids=ids).logits
    assert seen == {"ours": torch.bfloat16, "default": torch.float32}
    assert torch.equal(logits, reference)
    with torch.no_grad():  # no autocast: bf16 adapters on a bf16 base
        cast = engine_cast(input_ids=ids).logits
    assert torch.allclose(cast.float(), reference.float(), atol=0.1, rtol=0.05)


# Packed and padded runs that train on exactly the same tokens: one optimizer step is one epoch, every training
# example (all the padded blocks, all the packed ones), so each step's token-weighted loss, its gradient and the
# evaluation of the same held-out examples agree whatever the blocks hold. (format, block size, config, extra
# flags): the chats, of 30 to 120 tokens, in blocks of the tiny model's whole context.
SAME_LOSS_CASES = {"pairs, one process": ("pairs", BLOCK, "cpu.yaml", ()),
                   "chat, --grad-accum 2, LoRA": ("chat", 128, "cpu.yaml", ("--grad-accum", "2", "--lora-r", "4")),
                   "pairs, 2 processes, --grad-accum 2, LoRA": ("pairs", BLOCK, "2gpu.yaml",
                                                                 ("--grad-accum", "2", "--lora-r", "4"))}


def whole_epoch_data(hf, fmt, block):
    """A data file of pairs or chats whose training examples and packed blocks are both a multiple of 4 (2 processes
    × 2 micro-batches), and those two counts: the facts the recipe itself will find (the same load_examples)."""
    from transformers import AutoTokenizer

    from accelrun.finetune.examples import load_examples
    from finetune_lm import parse_args
    tok, path = AutoTokenizer.from_pretrained(hf / "model"), hf / f"whole_epoch_{fmt}.jsonl"
    for n in range(60, 120):
        records = ([{"prompt": p, "response": r} for p, r in uneven_pairs(n)] if fmt == "pairs"
                   else [{"messages": m} for m in conversations(n)])
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        counts = []
        for flag in ("--no-packing", "--packing"):
            args = parse_args(["--model", str(hf / "model"), "--data-files", str(path), flag])
            counts.append(load_examples(args, tok, block, 1000).facts["train_blocks"])
        if all(c % 4 == 0 for c in counts):
            return path.name, counts
    raise AssertionError("no size found")


@pytest.mark.slow
@pytest.mark.parametrize("case", SAME_LOSS_CASES)
def test_packed_and_padded_give_the_same_loss(finetune, hf, case):
    """Issue 34, item 5: the same tokens in packed blocks or one example per padded block give the same loss at
    every step and the same validation loss (positions restart at 0, nothing attends across an example's edge,
    the loss is the token-weighted mean over the optimizer step)."""
    fmt, block, config, extra = SAME_LOSS_CASES[case]
    data, (padded_blocks, packed_blocks) = whole_epoch_data(hf, fmt, block)
    assert packed_blocks < padded_blocks
    runs = {}
    for flag, blocks in (("--no-packing", padded_blocks), ("--packing", packed_blocks)):
        runs[flag] = finetune(config, flag, *extra, "--block-size", str(block), "--batch-size", str(blocks),
                              "--max-steps", "3", "--eval-every", "1", "--eval-batches", "1", data=data)
    padded, packed = runs["--no-packing"], runs["--packing"]
    assert packed.summary["train_examples"] == padded.summary["train_examples"]
    assert packed.summary["padding_share"] < padded.summary["padding_share"]
    assert packed.summary["examples_per_block"] > 1 == padded.summary["examples_per_block"]
    losses = [[m["loss"] for m in run.metrics if "loss" in m] for run in (padded, packed)]
    assert len(losses[0]) == len(set(losses[0])) == 3  # the steps train: each step's loss is another
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    evals = [[json.loads(line)["val_loss"] for line in (run.out_dir / "eval.jsonl").read_text().splitlines()]
             for run in (padded, packed)]
    assert len(evals[0]) == 3 and evals[1] == pytest.approx(evals[0], rel=1e-4)


@pytest.mark.slow
def test_token_chunks_train_to_the_plain_losss_validation_loss(hf, tmp_path):
    """Issue 55's done-when: --loss-chunk-tokens 64 (chunks of at most 64 of a micro-batch's several hundred loss
    positions, the last one shorter) trains step by step to the losses and the validation losses of --loss-chunks 1,
    the plain loss, to 1e-5 relative. Both in this process (in_process.run_main): no launch is added."""
    from in_process import run_main
    runs = {}
    for flags in (("--loss-chunks", "1"), ("--loss-chunk-tokens", "64")):
        out = tmp_path / flags[0].strip("-")
        code, output = run_main("finetune_lm", [*finetune_args(hf), *flags, "--output-dir", out], timeout=300)
        assert code == 0, output[-3000:]
        runs[flags[0]] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert json.loads((out / "summary.json").read_text())["attention"] == "sdpa"  # auto on a CPU: today's path
    plain, tokens = runs["--loss-chunks"], runs["--loss-chunk-tokens"]
    assert [m["step"] for m in tokens if "loss" in m] == list(range(1, STEPS + 1))
    evals = [[m["val_loss"] for m in run if "val_loss" in m] for run in (plain, tokens)]
    assert len(evals[0]) == 2 and evals[1] == pytest.approx(evals[0], rel=1e-5)
    losses = [[m["loss"] for m in run if "loss" in m] for run in (plain, tokens)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5) and losses[0][-1] < losses[0][0]


def test_help_gives_each_default_once(capsys):
    """Issue 35, item 12: `--help` said "(default: 1024, or the context if shorter) (default: None)"."""
    from finetune_lm import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    entries = re.split(r"\n  (?=-)", capsys.readouterr().out.split("options:", 1)[1])  # one per flag
    entries = {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries if entry.strip()}
    assert len(entries) > 30 and "(default: None)" not in " ".join(entries.values())
    assert {flag for flag, text in entries.items() if text.lower().count("default") > 1} == set()
    assert entries["--block-size"].endswith("(default: 1024, or the context if shorter)")
    assert entries["--packing"].endswith("(default: True)")


def test_full_lora_packed_and_padded_runs_keep_their_own_output_directories():
    """Issue 35, item 8: a LoRA run's results overwrote a full fine-tune's (one default directory for both)."""
    from accelerate import Accelerator

    from finetune_lm import default_output_dir, parse_args
    accelerator = Accelerator(cpu=True)
    dirs = {default_output_dir(parse_args(flags), accelerator)
            for flags in ([], ["--lora-r", "16"], ["--lora-r", "8"], ["--no-packing"],
                          ["--lora-r", "16", "--no-packing"], ["--lora-r", "16", "--load-in-4bit"])}
    assert len(dirs) == 6 and "runs/finetune_lm/1proc" in dirs and "runs/finetune_lm/1proc-lora-r16" in dirs
    assert "runs/finetune_lm/1proc-qlora-r16" in dirs  # QLoRA trains another model than LoRA (issue 44)


def test_lora_prints_no_library_warning_before_the_first_line(hf):
    """Issue 41, item 8: with LoRA every rank printed transformers' FutureWarning (`is_gradient_checkpointing` is
    deprecated, asked by PEFT) before the run's error line, which the README promises comes first."""
    import warnings

    from transformers import AutoModelForCausalLM

    from accelrun.finetune.lora import with_lora
    from finetune_lm import parse_args
    base = AutoModelForCausalLM.from_pretrained(hf / "model")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with_lora(base, parse_args(["--model", str(hf / "model"), "--lora-r", "4"]))
    assert [str(w.message) for w in shown if issubclass(w.category, (FutureWarning, DeprecationWarning))] == []


def test_lora_flags_without_a_rank_are_refused(capsys):
    """Issue 35, item 8: TRL and torchtune build LoRA from the LoRA settings given; here the rank switches it on,
    so a LoRA flag without --lora-r is refused rather than ignored. Issue 41, item 3: decided from the flags alone,
    it is refused as a flag error is, by the parser, before torch is imported (test_source.py: no torch then)."""
    from accelrun.finetune.lora import flags_without_rank
    from finetune_lm import parse_args
    for argv in (["--merge-lora"], ["--lora-dropout=0.1"], ["--lora-alpha", "32", "--lora-targets", "q_proj"]):
        with pytest.raises(SystemExit) as refused:
            parse_args(argv)
        err = capsys.readouterr().err
        assert refused.value.code == 2 and err.count("\n") == 1, err
        assert ": error: " in err and "add --lora-r" in err and argv[0].split("=")[0] in err  # prog: pytest here
    args = parse_args(["--lora-r", "4", "--merge-lora"])
    assert flags_without_rank(args, ["--lora-r", "4", "--merge-lora"]) is None
    assert flags_without_rank(parse_args([]), []) is None
