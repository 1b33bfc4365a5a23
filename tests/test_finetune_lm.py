"""recipes/finetune_lm.py on a tiny random Llama and a tokenizer built here (tests/tiny_hf.py), saved in
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
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

from launching import (
    CONFIG_FILES,
    FINETUNE_BATCH,
    FINETUNE_BLOCK,
    FINETUNE_STEPS,
    LORA_PRECISION,
    OFFLOAD,
    LaunchResult,
    finetune_args,
    run_command,
)
from run_checks import assert_engine, assert_refused, assert_shards_held
from tiny_hf import corpus, uneven_pairs

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
    run = finetune(config)
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
@pytest.mark.parametrize("config", ["2gpu.yaml", "deepspeed_zero3.yaml"])
def test_lora_checkpoint_holds_the_adapters_and_resumes_exactly(lora, hf, tmp_path, config):
    """The checkpoint leaves the frozen base out (the resumed run loads it from --model again); resumed from
    step 3, the run ends with the uninterrupted run's losses and adapter, bit for bit."""
    ref = lora(config)
    step3 = hf / f"ckpt-lora-{config}" / "step-00000003"
    if config == "2gpu.yaml":
        from safetensors import safe_open
        with safe_open(step3 / "model.safetensors", "pt") as f:
            assert f.keys() and all(".lora_" in key for key in f.keys())
    else:  # DeepSpeed's module files: no fragments of the frozen parameters
        for part in (step3 / "pytorch_model").glob("*_model_states.pt"):
            states = torch.load(part, weights_only=True)
            assert not states["frozen_param_fragments"] and all(".lora_" in key for key in states["module"])
    shutil.copytree(step3, tmp_path / "ckpt" / step3.name)
    resumed = lora(config, checkpoint_dir=tmp_path / "ckpt")
    assert resumed.summary["resumed_from_step"] == 3
    assert [m["loss"] for m in resumed.metrics] == [m["loss"] for m in ref.metrics if m["step"] > 3]
    adapter = "adapter/adapter_model.safetensors"
    assert (resumed.out_dir / adapter).read_bytes() == (ref.out_dir / adapter).read_bytes()


@pytest.mark.slow
def test_resume_with_another_grad_accum_from_an_odd_step(finetune, tmp_path):
    """A checkpoint of step 3 written with --grad-accum 1, resumed with --grad-accum 2 (what a job back on fewer
    GPUs does): the steps go on exactly as before. accelerate's restored micro-batch counter (3) would make
    the first micro-batch after the resume an optimizer step of its own (4.89 at step 4 instead of 5.34)."""
    ckpt = ["--checkpoint-every", "3", "--keep-last", "0"]
    ref = finetune("cpu.yaml", "--checkpoint-dir", str(tmp_path / "ref"), *ckpt)
    shutil.copytree(tmp_path / "ref" / "step-00000003", tmp_path / "ckpt" / "step-00000003")
    resumed = finetune("cpu.yaml", "--checkpoint-dir", str(tmp_path / "ckpt"), *ckpt, "--grad-accum", "2")
    assert resumed.summary["resumed_from_step"] == 3
    assert any("--grad-accum 1 -> 2" in change for change in resumed.summary["resume_changes"])
    assert [m["step"] for m in resumed.metrics] == list(range(4, STEPS + 1))
    for a, b in zip([m for m in ref.metrics if m["step"] > 3], resumed.metrics):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["lr"] == a["lr"], (a, b)


@pytest.mark.slow
def test_each_input_error_is_one_clear_message(finetune, hf, tmp_path):
    offline = {"HF_HUB_OFFLINE": "1"}
    for args, env, words in [
        (["--model", "no-such-org/no-such-model"], offline, "cannot load model 'no-such-org/no-such-model'"),
        (["--block-size", "4096"], {}, "longer than"),
    ]:
        out = tmp_path / f"out{len(words)}"
        cmd = [sys.executable, "recipes/finetune_lm.py", *finetune_args(hf), "--output-dir", str(out), *args]
        assert_refused(LaunchResult(*run_command(cmd, env=env), out), words)
    # Columns that are not there, found by the main process while the other waits for its cache: both leave.
    (hf / "qa.jsonl").write_text("".join(json.dumps({"question": p, "answer": r}) + "\n" for p, r in corpus(40)))
    columns = finetune("2gpu.yaml", data="qa.jsonl", check=False)
    assert_refused(columns, "not ['prompt', 'response']: name them with --prompt-column")
    # ZeRO-3 without zero3_init_flag: every process would load all 70B parameters first.
    big = finetune("deepspeed_zero3.yaml", model="big", check=False,
                   launch_args=("--mixed_precision", "no", "--zero3_init_flag", "false"))
    assert_refused(big, "Set zero3_init_flag: true")
