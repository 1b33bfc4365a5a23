"""Fine-tune a pretrained Hugging Face causal language model: the job ZeRO-3 and FSDP exist for.

    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml recipes/finetune_lm.py \\
        --model meta-llama/Llama-3.2-1B --data-files chat.jsonl --block-size 1024 --peak-tflops 989
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/finetune_lm.py \\
        --model ./my-llama-8b --data-files 'books/*.txt' --gradient-checkpointing
    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/finetune_lm.py \\
        --model Qwen/Qwen2.5-7B-Instruct --data-files chat.jsonl --lora-r 16 --lr 2e-4 --merge-lora   # LoRA
    python tests/tiny_hf.py /tmp/tiny && python recipes/finetune_lm.py --model /tmp/tiny/model \\
        --data-files /tmp/tiny/pairs.jsonl --block-size 32 --max-steps 300 --batch-size 16 --lr 3e-3   # CPU
    python recipes/finetune_lm.py --model /tmp/tiny/model --data-files /tmp/tiny/chat.jsonl \\
        --max-steps 300 --batch-size 16 --lr 3e-3   # CPU, chat
    python recipes/finetune_lm.py --model runs/finetune_lm/1proc/model --data-files /tmp/tiny/chat.jsonl \\
        --lora-r 16 --merge-lora --max-steps 200 --batch-size 16 --lr 1e-2 --output-dir runs/chat-lora   # CPU

--model: a hub id or a local save_pretrained directory. The Accelerator exists before from_pretrained:
under ZeRO-3 with zero3_init_flag (deepspeed_zero3*.yaml) transformers loads the model partitioned;
under FSDP2 prepare() shards the main process's copy. The summary has the loading's peak memory.

Data through `datasets`: --data-files (text or JSON Lines, globs, comma-separated) or --dataset (hub).
--format auto reads the columns: `messages` (--messages-column), lists of {role, content} turns, is chat,
rendered with the tokenizer's chat template, the loss on the assistant turns and their end-of-turn
tokens only (from the template's {% generation %} markers, or else from rendering each conversation's
prefixes); prompt/response records are pairs, the loss on the response and its end-of-sequence token;
plain text is packed into blocks. Examples are padded to --block-size (default: the model's context, at
most 1024); labels are set by position, not token id: padding never counts. The first line and the
summary (cut_examples, dropped_examples) count the examples whose last response --block-size cut, and
those dropped with nothing left to learn. The result, OUTPUT_DIR/model, is save_pretrained (safetensors)
with the tokenizer, gathered from every rank. tokens/s counts every position (padding too); MFU: --peak-tflops.
The loss is the mean over every loss token of the whole optimizer step (all micro-batches, all ranks): 1
process, --grad-accum and N processes agree. LoRA (--lora-r, through PEFT): the base frozen in the dtype it
is loaded in (the config's compute dtype), fp32 adapters alone in the optimizer, OUTPUT_DIR/adapter in
PEFT's format, --merge-lora also OUTPUT_DIR/model; checkpoints leave the frozen base out except under FSDP2.

Memory on 2x80 GB (docs/recipes.md: the table, from parameter counts; 4k tokens per GPU): a full AdamW
fine-tune of 1B fits under every engine, 3B under DDP with --gradient-checkpointing, 8B under ZeRO-2/3
or FSDP2 with it, 14B only under ZeRO-3 with CPU offload. LoRA r 16: 8B under DDP, ZeRO-3 or FSDP2,
14B and 32B with --gradient-checkpointing.

Result: loss 5.74 to 0.39 (first CPU command), LoRA 3.49 to 1.38 (last), measured 2026-11-24, CPU (docs/recipes.md).
"""

import argparse
import glob
import itertools
import math
import os
import re
import sys
from datetime import timedelta

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, broadcast, set_seed
from torch.utils.data import DataLoader

from runkit import Run, add_run_args

IGNORE = -100  # label of a position that is not in the loss (cross_entropy's ignore_index)


# Flags a resumed run may change: they act after training or only on what is reported.
AFTER_TRAINING = {"sample_tokens": "the answer at the end", "save_dtype": "the exported model",
                  "merge_lora": "the exported model", "peak_tflops": "MFU's denominator",
                  "timeout": "how long a collective may wait"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B",
                   help="hub id, or a local directory written by save_pretrained")
    p.add_argument("--data-files", default=None, help="local .txt or .jsonl/.json files or globs, comma-separated")
    p.add_argument("--dataset", default=None, help="a Hugging Face hub dataset (needs internet)")
    p.add_argument("--dataset-config", default=None, help="its configuration name")
    p.add_argument("--format", choices=("auto", "chat", "pairs", "text"), default="auto",
                   help="chat: conversations in the tokenizer's chat template, the assistant turns learned; pairs: "
                        "prompt/response records; text: packed plain text; auto: chat when the records have "
                        "--messages-column, pairs when they have the prompt and response columns, else text")
    p.add_argument("--messages-column", default="messages",
                   help="chat: the column with each conversation, a list of {role, content} turns")
    p.add_argument("--prompt-column", default="prompt", help="pairs: the column with the prompt")
    p.add_argument("--response-column", default="response", help="pairs: the column with the response to learn")
    p.add_argument("--text-column", default="text", help="text: the column with the text")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per sequence, at most the model's context (default: 1024, or the context if shorter)")
    p.add_argument("--max-steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch in sequences, split across processes")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=2e-5, help="peak AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, default=30, help="linear warm-up, then cosine decay to lr/10")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (not on biases and norms)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm (0: no clipping)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute each layer in backward")
    p.add_argument("--lora-r", type=int, default=0,
                   help="LoRA rank: train low-rank adapters on a frozen base model (0: a full fine-tune)")
    p.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA: the adapters' output is scaled by alpha/r")
    p.add_argument("--lora-dropout", type=float, default=0.05, help="LoRA: dropout on the adapters' input")
    p.add_argument("--lora-targets", default="all-linear",
                   help="LoRA: comma-separated names of the linear layers to adapt (all-linear: every linear "
                        "layer of the decoder blocks)")
    p.add_argument("--merge-lora", action="store_true",
                   help="LoRA: also export the base model with the adapters merged in, to OUTPUT_DIR/model")
    p.add_argument("--eval-every", type=int, default=100, help="validation loss every N steps (and at the end)")
    p.add_argument("--eval-batches", type=int, default=10, help="global batches of held-out data per evaluation")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="peak TFLOP/s of ONE GPU, for MFU (H100 SXM bf16: 989)")
    p.add_argument("--sample-tokens", type=int, default=32,
                   help="greedy answer to a held-out prompt at the end (0: none)")
    p.add_argument("--save-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="dtype of the exported model")
    p.add_argument("--seed", type=int, default=1234, help="shuffling and the held-out split")
    # NCCL's default is 10 minutes, while the main process tokenises alone and the others wait in a barrier.
    p.add_argument("--timeout", type=int, default=1800,
                   help="seconds a collective waits for a missing rank (the others wait while the main process "
                        "tokenises) before the run fails")
    add_run_args(p, "finetune_lm", log_every=10)
    return p.parse_args(argv)


def encode_pair(prompt, response, eos, pad_id, block_size):
    """(input_ids, labels) of a prompt/response pair, block_size long. Labels by position: the prompt and the padding
    are IGNORE whatever their ids, so a pad token that is also the end-of-sequence token is learned only as the end."""
    return encode_chat(prompt + response + [eos], [False] * len(prompt) + [True] * (len(response) + 1), pad_id,
                       block_size)


def encode_chat(ids, learned, pad_id, block_size):
    """(input_ids, labels) of a rendered conversation, block_size long: learned[i] says whether position i is in
    the loss (an assistant turn's token, or the end of its turn); labels by position, as encode_pair's."""
    labels = [t if keep else IGNORE for t, keep in zip(ids, learned)][:block_size]
    pad = block_size - len(labels)
    return ids[:block_size] + [pad_id] * pad, labels + [IGNORE] * pad


class DataProblem(ValueError):
    """A record the chosen format cannot use: reported as one message, never as a tokenizer's traceback."""


def assistant_positions(tokenizer, messages):
    """(ids, learned) of a conversation in the tokenizer's chat template; learned marks the assistant turns and
    their end-of-turn tokens. The template's {% generation %} markers say where they are when it has them;
    otherwise each assistant turn is what it adds to the conversation before it rendered with the generation
    prompt (character spans, so a token merged across a boundary cannot shift the labels)."""
    if re.search(r"\{%-?\s*generation\s*-?%\}", tokenizer.get_chat_template()):
        rendered = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        return rendered["input_ids"], [bool(m) for m in rendered["assistant_masks"]]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not (through.startswith(before) and text.startswith(through)):  # a template that rewrites history
            raise DataProblem("the chat template renders a conversation's start differently once it goes on, so "
                              "its assistant turns cannot be found; add {% generation %} ... {% endgeneration %} "
                              "around the assistant content and its end-of-turn token in the template")
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return encoded["input_ids"], [any(a <= start < b for a, b in spans) for start, _ in encoded["offset_mapping"]]


def is_conversation(value):
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def value_problem(column, value, conversation):
    """Why a record's `column` value cannot be used (a conversation when `conversation`, else text), or None."""
    if conversation:
        if is_conversation(value):
            return None
        if isinstance(value, str):
            return (f"the column {column!r} holds text, not conversations (lists of {{role, content}} turns): "
                    f"use --format text --text-column {column}, or --format pairs")
        return f"the column {column!r} holds {value!r:.60}, not a list of {{role, content}} turns with text content"
    if isinstance(value, str):
        return None
    if value and is_conversation(value):
        return (f"the column {column!r} holds conversations (lists of {{role, content}} turns), not text: use "
                f"--format chat --messages-column {column}")
    return f"the column {column!r} holds {value!r:.60}, not text: name a column of strings"


def choose_format(args, records, columns):
    """--format, or for auto the format the columns say: records (JSON, or a hub dataset) or plain text files."""
    if args.format != "auto":
        return args.format
    if not records:
        return "text"
    if args.messages_column in columns:
        return "chat"
    if args.prompt_column in columns and args.response_column in columns:
        return "pairs"
    return "text" if args.text_column in columns else "pairs"  # pairs' missing-column message names every format


def tokenise(fmt, args, tokenizer, block_size):
    """The batched map from records to input_ids and labels (block_size long), in_loss (positions in the loss
    after the first) and cut (the end of the last response lost to block_size)."""
    eos = tokenizer.eos_token_id
    pad_id = eos if tokenizer.pad_token_id is None else tokenizer.pad_token_id

    def checked(batch, column, conversation=False):
        for value in batch[column]:
            if problem := value_problem(column, value, conversation):
                raise DataProblem(problem)
        return batch[column]

    def examples(encoded, cut):
        return {"input_ids": [x for x, _ in encoded], "labels": [y for _, y in encoded],
                "in_loss": [sum(t != IGNORE for t in y[1:]) for _, y in encoded], "cut": cut}

    def pairs(batch):
        prompts = tokenizer(checked(batch, args.prompt_column))["input_ids"]
        responses = tokenizer(checked(batch, args.response_column), add_special_tokens=False)["input_ids"]
        return examples([encode_pair(p, r, eos, pad_id, block_size) for p, r in zip(prompts, responses)],
                        [len(p) + len(r) + 1 > block_size for p, r in zip(prompts, responses)])

    def chat(batch):
        rendered = [assistant_positions(tokenizer, m) for m in checked(batch, args.messages_column, True)]
        return examples([encode_chat(ids, learned, pad_id, block_size) for ids, learned in rendered],
                        [any(learned[block_size:]) for _, learned in rendered])

    def packed(batch):  # documents joined by end-of-sequence tokens, cut into whole blocks
        stream = [t for ids in tokenizer(checked(batch, args.text_column))["input_ids"] for t in ids + [eos]]
        blocks = [stream[i:i + block_size] for i in range(0, len(stream) // block_size * block_size, block_size)]
        return {"input_ids": blocks, "labels": blocks, "in_loss": [block_size - 1] * len(blocks),
                "cut": [False] * len(blocks)}
    return {"pairs": pairs, "chat": chat, "text": packed}[fmt]


NO_CHAT_TEMPLATE = ("--format chat renders conversations with the tokenizer's chat template, and {model}'s tokenizer "
                    "has none: give a model whose tokenizer has one (an instruct or chat model), or set one in its "
                    "directory (chat_template.jinja, or chat_template in tokenizer_config.json)")


def cut_note(cuts, fmt, block_size):
    """The start line's words on the examples --block-size cut: nothing is cut silently."""
    if fmt == "text":
        return ""
    n, dropped = cuts["cut_examples"], cuts["dropped_examples"]
    said = (f"{n} of {cuts['tokenised_examples']} examples cut at --block-size {block_size} (their last response's end "
            f"lost)" if n else f"none of {cuts['tokenised_examples']} examples cut at --block-size {block_size}")
    return f"; {said}" + (f", {dropped} dropped with nothing to learn left" if dropped else "")


def model_shape(name):
    """(config, parameter count, tokenizer, error), before any weight is read. Called before the Accelerator
    exists: under ZeRO-3 transformers would partition even a model on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # here: --help stays quick
    try:
        config, tokenizer = AutoConfig.from_pretrained(name), AutoTokenizer.from_pretrained(name)
        if tokenizer.eos_token_id is None:
            raise ValueError("its tokenizer has no end-of-sequence token, which marks where a response ends")
        with torch.device("meta"):
            n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        return config, n_params, tokenizer, None
    except (OSError, ValueError) as exc:
        return None, 0, None, (f"cannot load model {name!r} ({str(exc).splitlines()[0]}). Offline, give a local "
                               f"directory written by save_pretrained, or download it first on a machine with "
                               f"internet (hf download)")


def load_examples(args, run, accelerator, tokenizer, block_size):
    """(train, validation, format, source, cuts): tokenised examples of input_ids and labels, block_size long;
    cuts counts the examples, those whose response block_size cut, and those dropped with nothing in the loss."""
    from datasets import load_dataset
    if args.dataset:
        source, load = args.dataset, lambda: load_dataset(args.dataset, args.dataset_config, split="train")  # noqa: E731
        records = True  # a hub dataset has columns
    else:
        files = sorted(f for pattern in (args.data_files or "").split(",") if pattern
                       for f in glob.glob(os.path.expanduser(pattern)))
        if not files:
            run.fail(f"--data-files {args.data_files!r} matches no file; give .txt or .jsonl paths or globs")
        source, records = args.data_files, all(f.endswith((".json", ".jsonl")) for f in files)
        load = lambda: load_dataset("json" if records else "text", data_files=files, split="train")  # noqa: E731
    problem, split, fmt, cuts = None, None, args.format, {}
    with accelerator.main_process_first():  # the main process tokenises and caches; the others reuse its cache
        try:  # a problem is reported after the block, by every rank: a rank leaving inside it strands the others
            raw = load()
            fmt = choose_format(args, records, raw.column_names)
            needed = {"pairs": [args.prompt_column, args.response_column], "chat": [args.messages_column],
                      "text": [args.text_column]}[fmt]
            if missing := [c for c in needed if c not in raw.column_names]:
                fix = {"pairs": "--prompt-column and --response-column, or give conversations with --format chat "
                                "--messages-column NAME, or text with --format text --text-column NAME",
                       "chat": "--messages-column (a column of {role, content} turns), or use --format pairs or text",
                       "text": "--text-column (a column of strings), or use --format pairs or chat"}[fmt]
                problem = f"{source!r} has the columns {raw.column_names}, not {missing}: name them with {fix}"
            elif fmt == "chat" and tokenizer.chat_template is None:
                problem = NO_CHAT_TEMPLATE.format(model=args.model)
        except Exception as exc:
            problem = f"could not load {source!r} ({type(exc).__name__}: {exc}). Offline, use --data-files"
        if not problem:
            try:
                data = raw.map(tokenise(fmt, args, tokenizer, block_size), batched=True,
                               remove_columns=raw.column_names, desc="tokenising")
            except DataProblem as exc:
                problem = f"{source!r} cannot be read as --format {fmt}: {exc}"
        if not problem:
            cuts = {"tokenised_examples": len(data), "cut_examples": sum(data["cut"]),
                    "dropped_examples": sum(n == 0 for n in data["in_loss"])}
            data = data.filter(lambda e: e["in_loss"] > 0, desc="dropping examples with nothing to learn")
            if len(data) >= 20:
                split = data.train_test_split(test_size=0.05, seed=args.seed)  # cached too: the same on every rank
            else:
                problem = f"{source!r} gives only {len(data)} examples of at most {block_size} tokens; give more data"
    if problem:
        run.fail(problem)
    return split["train"].with_format("torch"), split["test"].with_format("torch"), fmt, source, cuts


def token_losses(logits, labels):
    """Each sequence's summed next-token loss over the positions whose label is not IGNORE, and how many
    such positions it has (fp32, as Hugging Face computes it)."""
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), labels[:, 1:], ignore_index=IGNORE,
                             reduction="none")
    return losses.sum(dim=1), (labels[:, 1:] != IGNORE).sum(dim=1)


def with_step_tokens(batches, accelerator, grad_accum):
    """Each micro-batch with the number of loss tokens in its whole optimizer step: every micro-batch of the
    step on every rank. One small all-reduce per step, left on the device (no wait for the GPU)."""
    batches = iter(batches)
    while step := list(itertools.islice(batches, grad_accum)):
        tokens = sum((batch["labels"][:, 1:] != IGNORE).sum() for batch in step)
        tokens = accelerator.reduce(tokens, "sum").clamp(min=1)  # accelerate
        for batch in step:
            yield batch, tokens


def evaluate(model, loader, accelerator):
    """Mean next-token loss per loss token over the held-out examples in the loader: the training loss's
    definition."""
    model.eval()
    total = count = 0
    with torch.no_grad():
        for batch in loader:
            losses, tokens = token_losses(model(input_ids=batch["input_ids"]).logits, batch["labels"])
            # accelerate: drops the examples repeated to fill the last batch
            losses, tokens = accelerator.gather_for_metrics((losses, tokens))
            total, count = total + losses.sum(), count + tokens.sum()
    model.train()
    return {"val_loss": float(total / max(count, 1))}


def with_lora(model, args, run):
    """The model wrapped by PEFT: every base parameter frozen in the dtype it was loaded in, LoRA adapters on
    the --lora-targets linear layers, trainable and kept in fp32 by PEFT (autocast_adapter_dtype)."""
    from peft import LoraConfig, get_peft_model
    targets = args.lora_targets if args.lora_targets == "all-linear" else args.lora_targets.split(",")
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=targets, task_type="CAUSAL_LM")
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, torch.nn.Linear)} - {"lm_head"})
    try:
        model = get_peft_model(model, config)
    except ValueError as exc:
        run.fail(f"--lora-targets {args.lora_targets!r}: {str(exc).splitlines()[0]}. This model's linear layers "
                 f"are {','.join(linear)}")
    adapted = [name for name, module in model.named_modules() if hasattr(module, "lora_A")]
    if other := [name for name in adapted if not isinstance(model.get_submodule(name).base_layer, torch.nn.Linear)]:
        run.fail(f"--lora-targets adapts {other[0]}, which is not a linear layer; name linear layers only, "
                 f"from {','.join(linear)}")
    return model


def merged(weights, peft_model):
    """The base model's weights with each adapter folded in, W + alpha/r * B @ A, under the base's own names."""
    scaling = {name: module.scaling["default"] for name, module in peft_model.named_modules()
               if hasattr(module, "lora_A")}
    base = {}
    for key, value in weights.items():
        if ".lora_" in key:
            continue
        module = key.removesuffix(".base_layer.weight")
        if module in scaling:
            a, b = weights[f"{module}.lora_A.default.weight"], weights[f"{module}.lora_B.default.weight"]
            value = value + scaling[module] * (b @ a)
        base[key.removeprefix("base_model.model.").replace(".base_layer.", ".")] = value
    return base


def greedy(model, accelerator, ids, tokens, eos):
    """Greedy decoding on every rank (ZeRO-3 and FSDP gather weights collectively), rank 0's choices broadcast."""
    ids, new, logprobs = ids[None].to(accelerator.device), [], []
    model.eval()
    with torch.no_grad():
        for _ in range(tokens):
            logp = F.log_softmax(model(input_ids=ids).logits[0, -1].float(), dim=-1)
            nxt = broadcast(logp.argmax()[None])
            new.append(int(nxt))
            logprobs.append(float(logp[nxt]))
            ids = torch.cat([ids, nxt[None]], dim=1)
            if new[-1] == eos:
                break
    model.train()
    return new, logprobs


def refuse_whole_copies(run, accelerator, n_params):
    """ZeRO-3 with zero3_init_flag off loads the whole fp32 model on every process: stop if they cannot hold it."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3 or plugin.zero3_init_flag:
        return
    whole_gb, local = 4 * n_params / 1e9, int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    with open("/proc/meminfo") as f:
        free_gb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) * 1024 / 1e9
    gpu_gb = math.inf
    if torch.cuda.is_available():
        gpu_gb = torch.cuda.get_device_properties(accelerator.device).total_memory / 1e9
    if broadcast(torch.tensor([float(whole_gb * local > free_gb or whole_gb > gpu_gb)], device=accelerator.device)):
        run.fail(f"ZeRO-3 with zero3_init_flag off loads the whole model on every process first: {whole_gb:.1f} "
                 f"GB in fp32 x {local} processes here, with {free_gb:.1f} GB of host memory free and {gpu_gb:.0f} "
                 f"GB per GPU. Set zero3_init_flag: true in the config (deepspeed_zero3.yaml has it) or pass "
                 f"--zero3_init_flag true")


def main(argv=None):
    args = parse_args(argv)
    run = Run("finetune_lm", args, unit="tokens", may_change=AFTER_TRAINING)  # first: a stop may come during start-up
    config, n_params, tokenizer, error = model_shape(args.model)
    # Before from_pretrained: transformers reads ZeRO-3's settings from the Accelerator to load partitioned.
    accelerator = Accelerator(  # accelerate
        gradient_accumulation_steps=args.grad_accum,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.timeout))],
        # non_blocking with pinned batches: the copy to the GPU is queued, the host does not wait for the GPU
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True, non_blocking=True))
    run.setup(accelerator, batch_size=args.batch_size, max_grad_norm=args.max_grad_norm)
    set_seed(args.seed)
    if error:
        run.fail(error)
    context = getattr(config, "max_position_embeddings", None)
    if args.block_size is None:  # the default fits the model
        args.block_size = min(1024, context or 1024)
    if context and args.block_size > context:
        run.fail(f"--block-size {args.block_size} is longer than {args.model}'s context of {context} tokens; give less")
    refuse_whole_copies(run, accelerator, n_params)
    from transformers import AutoModelForCausalLM
    train_set, val_set, fmt, source, cuts = load_examples(args, run, accelerator, tokenizer, args.block_size)
    # A full fine-tune keeps fp32 master weights; LoRA's frozen base needs none, so it loads in the compute dtype.
    dtype = torch.float32
    if args.lora_r:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    try:
        with run.sharded_init(from_pretrained=True):  # ZeRO-3: partitioned while loaded; FSDP2: main's copy sharded
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    except (OSError, ValueError) as exc:
        run.fail(f"cannot load the weights of {args.model!r}: {str(exc).splitlines()[0]}")
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False  # no generation cache while training
    if args.lora_r:
        model = with_lora(model, args, run)
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    trained = sum(getattr(p, "ds_numel", p.numel()) for p in trainable)  # ZeRO-3: the whole parameter's size
    micro = args.batch_size // args.grad_accum
    pin = accelerator.device.type == "cuda"
    train_loader = DataLoader(train_set, batch_size=micro, shuffle=True, drop_last=True, pin_memory=pin)
    # Exactly the examples evaluated, read to the end: a loader left part-read stays accelerate's active one,
    # and its end-of-data flag would then decide when gradients sync (every micro-batch, with --grad-accum).
    evaluated = val_set.select(range(min(len(val_set), args.eval_batches * args.batch_size)))
    # accelerate fills a short last batch: shapes stay static
    val_loader = DataLoader(evaluated, batch_size=micro, pin_memory=pin)
    matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in trainable]  # ZeRO-3: the full shape
    decay, flat = ([p for p, m in zip(trainable, matrix) if m == want] for want in (True, False))
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": flat, "weight_decay": 0.0}]  # no decay on biases and norms
    # No empty group (LoRA's adapters are all matrices): DeepSpeed drops it, and the scheduler would then
    # hold one learning rate too many.
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr, betas=(0.9, 0.95), fused=True)
    steps_per_epoch = len(train_loader) // args.grad_accum
    if steps_per_epoch == 0:
        run.fail(f"{len(train_set)} training examples do not fill one global batch of {args.batch_size}")

    def schedule(step):  # linear warm-up, then cosine from lr to lr/10
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(args.max_steps - args.warmup_steps, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(  # accelerate
        model, optimizer, train_loader, val_loader, scheduler)
    # FLOPs per token: 6 per weight in a matmul (the input embedding is a lookup) plus attention's 12 L d T.
    # LoRA's frozen weights get no weight gradient: 4 each (forward, and the gradient of their input), 6 per adapter.
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    matmul = 6 * (n_params - embedding) if not args.lora_r else 4 * (n_params - embedding) + 6 * trained
    flops_per_token = matmul + 12 * config.num_hidden_layers * config.hidden_size * args.block_size
    positions = len(train_set) * (args.block_size - 1)  # positions with a target
    loss_share = sum(train_set.with_format(None)["in_loss"]) / positions
    run.start(model, optimizer, scheduler, steps_per_epoch=steps_per_epoch, total_steps=args.max_steps,
              units_per_sample=args.block_size,
              flops_per_unit=flops_per_token, peak_tflops=args.peak_tflops, eval_every=args.eval_every,
              evaluate=lambda: evaluate(model, val_loader, accelerator),
              describe=f"{args.model}: {n_params / 1e6:.3g} M parameters | {fmt}: {source}, {len(train_set)} "
                       f"examples of {args.block_size} tokens, {100 * loss_share:.0f}% of positions in the loss"
                       f"{cut_note(cuts, fmt, args.block_size)}",
              data_facts={"source": source, "data_format": fmt, "train_examples": len(train_set)})

    # The loss is the mean over every loss token of the optimizer step, whatever the micro-batch and the rank:
    # each micro-batch's summed loss over the step's token count, times what backward() then divides by
    # (the micro-batches per step, and the processes whose gradients are averaged).
    undo_means = accelerator.num_processes * args.grad_accum
    for batches in run.epochs(train_loader):  # resumes mid-epoch; checkpoints at each epoch's end
        for batch, step_tokens in with_step_tokens(batches, accelerator, args.grad_accum):
            with accelerator.accumulate(model):  # accelerate
                # No attention mask: padding comes after the last real token and attention is causal.
                losses, _ = token_losses(model(input_ids=batch["input_ids"]).logits, batch["labels"])
                loss = losses.sum() * undo_means / step_tokens
                accelerator.backward(loss)  # accelerate
                if accelerator.sync_gradients and args.max_grad_norm > 0:  # accelerate
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # accelerate
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if run.step(loss):  # a stop signal, or the last step
                break
    sample = {}
    if args.sample_tokens and not run.stopping:
        first = val_set[0]  # its prompt, or the start of its text
        prompt_length = int((first["labels"] != IGNORE).nonzero()[0]) if fmt != "text" else args.block_size // 4
        prompt = first["input_ids"][:prompt_length]
        plain = accelerator.unwrap_model(model, keep_torch_compile=False)  # accelerate
        new, logprobs = greedy(plain, accelerator, prompt, args.sample_tokens, tokenizer.eos_token_id)
        sample = {"sample_prompt": tokenizer.decode(prompt), "sample_prompt_ids": prompt.tolist(),
                  "sample": tokenizer.decode(new), "sample_token_ids": new, "sample_logprobs": logprobs}
        run.print(f"greedy answer to {sample['sample_prompt']!r}: {sample['sample']!r}")
    model_dir, adapter_dir = (os.path.join(run.output_dir, name) for name in ("model", "adapter"))

    def export(weights):  # main process: directories from_pretrained (and PEFT) load, with the tokenizer
        plain = accelerator.unwrap_model(model, keep_torch_compile=False)  # accelerate
        if args.lora_r:  # PEFT's own format, in fp32; PEFT picks the adapters' tensors out of the whole model's
            plain.save_pretrained(adapter_dir, state_dict=weights)
            tokenizer.save_pretrained(adapter_dir)
            if not args.merge_lora:
                return adapter_dir
            weights, plain = merged(weights, plain), plain.get_base_model()
        dtype = getattr(torch, args.save_dtype)
        plain.config.use_cache = True  # a config for generating
        plain.save_pretrained(model_dir, state_dict={k: v.to(dtype) for k, v in weights.items()})
        plain.config.dtype = dtype  # save_pretrained wrote the dtype of the model in memory, not of the file
        plain.config.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        return f"{adapter_dir}, {model_dir}" if args.lora_r else model_dir
    lora = {"lora_r": args.lora_r, "trainable_params": trained,
            "frozen_dtype": str(dtype).removeprefix("torch.") if args.lora_r else None}
    return run.finish(model, export=export, exported_dtype=args.save_dtype, base_model=args.model, data_format=fmt,
                      data_source=source, train_examples=len(train_set), loss_positions_share=loss_share,
                      block_size=args.block_size, gradient_checkpointing=args.gradient_checkpointing, **lora, **sample,
                      **cuts)


if __name__ == "__main__":
    sys.exit(main())
