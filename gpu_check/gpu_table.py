"""The GPU table: the project's comparisons on a GPU, measured within a time budget, the fine-tunes first.

    bash gpu_check/run.sh --budget-s 540                    # the whole GPU check: install, pack, then this (README)
    python gpu_check/gpu_table.py --budget-s 300            # the table alone (python bench/benchmark.py --gpu-table)
    python gpu_check/gpu_table.py --parts finetune-full finetune-lora --budget-s 200
    python gpu_check/gpu_table.py --dry-run --budget-s 330  # the plan: the parts in order, what the budget reaches

Owns the table's parts (PARTS: one bench/benchmark.py run each), the inputs they need made on the machine (striped
images, the 1B Llama shape with accelrun.data.tiny_hf's tokenizer, uneven chat data and DPO pairs drawn from it, and
for issue 50's parts the shape of the largest full fine-tune bench/lm_memory.py fits on the GPU: nothing is
downloaded), the compile warm-ups, the budget, the planner's figures beside the measured peaks, and what it writes:
OUT/table.md (the parts side by side with the goals of the issues that asked for them), OUT/table.json (every row,
every part's status, issue 50's peaks and ratio) and OUT/failures.log (the end of each failed run's log), all three
rewritten the moment each part ends. OUT is --out (the GPU check gives its own folder), else
bench/results/<date>-<gpu>/; the parts' own reports, logs, runs and the inputs stay in .gpu/table/<date>-<gpu>/.

How it runs (issue 42: the first contact spent 440 s on 3 of 5 parts, mostly in process start-up and compilation;
six warm-ups at once, each with 16 inductor workers, left the 1B compile unfinished):
  1. inputs: seconds;
  2. two stages, the fine-tune parts first (never measured, the reason for the table), then the rest in what time
     is left (gpt, mnist, resnet, the engines: the first contact measured them). Each stage first warms the
     compiled runs of its parts that the budget may reach: each runs WARM_STEPS steps with the command its part
     measures, WARM_AT_ONCE at a time (within WARM_MEMORY_SHARE of the GPU's memory) with the cores shared among
     their inductor workers, so that inductor's caches (FX graph, AOTAutograd, Triton kernels) hold each graph.
     A warm-up runs to its end or to WARM_SHARE of the time left; a compiled run whose warm-up was stopped is left
     out of its part (it would compile inside its measured run) and listed as such;
  3. the parts, one run at a time: measurements never share the GPU. A part starts when at least START_SHARE of
     its expected time is left, else it is listed as not reached; a part still running STOP_GRACE_S before the
     budget ends gets SIGTERM and its benchmark reports the runs it finished.
With one GPU the two engine variants (ZeRO-2 without overlap_comm, FSDP as one unit) are left out: one process
has no gradient reduction to overlap and nothing to shard, so only the shipped configs' overhead is shown. The FP8
part runs on one GPU whatever the machine (fsdp_fp8.yaml with --num_processes 1, against its +bf16 variant).
"""

import argparse
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gpu_wheels import REPO, one_line_errors

sys.path.insert(1, str(REPO / "bench"))  # bench/benchmark.py runs each part: this module imports it, not back
import benchmark  # noqa: E402

# The fine-tune parts' recipe arguments: the 1B shape and the chats written here, blocks of 1024, global batch 8
# (issue "Fine-tune at H100 speed"). --packing / --no-packing: recipes/finetune_lm.py's flag (that issue, item 1).
FINETUNE = "--model {llama} --data-files {chats} --block-size 1024 --eval-batches 2"
LORA = "--lora-r 16"
# Issue 55 ("Packing at H100 speed"): the same chats at blocks of 4,096 and 8,192 tokens, 8,192 tokens a step, packed
# with FlexAttention's block mask (--attention flex), packed with SDPA's dense mask (--attention sdpa) and padded.
LONG = "--model {llama} --data-files {chats} --eval-batches 1 --eval-every 1000"
BLOCKS = {4096: "--block-size 4096 --batch-size 2", 8192: "--block-size 8192 --batch-size 1"}
# Issue 56 (DPO): LoRA r 16 on the 1B shape, pairs of answers to the chats' questions (pairs.jsonl, written here),
# each sequence in a block of 1024, 8 pairs (16 sequences) a step; the reference is the adapters disabled.
DPO = "--model {llama} --data-files {pairs} --block-size 1024 --eval-batches 1 --lora-r 16"
ATTENTION_FORMS = {"flex": "--packing --attention flex", "dense": "--packing --attention sdpa",
                   "padded": "--no-packing --attention sdpa"}


@dataclass(frozen=True)
class Part:
    folder: str
    args: tuple  # bench/benchmark.py's arguments; {images}, {llama}, {chats}: the inputs written here
    what: str
    # Expected seconds on one H100 with its compiled runs warmed (estimates from the first contact's part times,
    # docs/measuring.md; none measured yet): whether the budget reaches it, and its compile warm-up's own.
    expected_s: float = 60.0
    warm_s: float = 0.0
    # GPU memory one compile warm-up run of this part may take (GB; the fine-tunes' from the peaks measured on an
    # H100 in issue "Fine-tune at H100 speed", 29.7 and 20.0 GB, plus the allocator's slack; GPT-124M's from its
    # activations at 32 x 1024 tokens, about 9 GB, plus its states); 0: nothing compiles.
    warm_gb: float = 0.0
    first: bool = False  # the first stage: the fine-tune parts
    missing: str = ""  # a part the recipe cannot run yet: why. Listed in its place, never run
    goal: str = ""  # the goal its comparison is judged by, shown in the plan (--dry-run) under the part
    # (model input, --optim-states): its peak memory is set beside bench/lm_memory.py's figure for that run
    planned: tuple = ()


FULL, EAGER, COMPILED = ("1gpu.yaml", "1gpu_compile.yaml"), "1gpu.yaml", "1gpu_compile.yaml"
# Issue 55's goals: flex packed >= 1.8x padded and >= 1.3x dense packed (real tokens/s, compiled, at each block);
# its peak memory below dense packed's at 8,192 (dense / flex > 1); token chunks no slower than 8 chunks.
ATTENTION_GOALS = {"padded": 1.8, "dense": 1.3, "memory": 1.0, "chunks": 1.0}


def attention_parts():
    """Issue 55's parts: at each block, flex packed, dense packed and padded, compiled (10 steps each: tokens/s, MFU
    and peak memory; the sync check of a flex step is the pack's, tests/test_gpu.py); then the loss's chunk forms
    side by side at the largest block, eager (a compiled model keeps the plain loss): --loss-chunk-tokens 8192
    against --loss-chunks 8."""
    what = {"flex": "packed, FlexAttention's block mask", "dense": "packed, SDPA's dense block-diagonal mask",
            "padded": "one chat per block, padded"}
    goals = {block: f"flex / padded >= {ATTENTION_GOALS['padded']:g}x and flex / dense >= "
                    f"{ATTENTION_GOALS['dense']:g}x real tokens/s" + ("; flex's peak memory below dense's"
                                                                      if block == max(BLOCKS) else "")
             for block in BLOCKS}
    parts = [Part(f"finetune-{form}-{block}", ("--recipe", "finetune_lm", "--configs", COMPILED, "--steps", "10",
                                               "--recipe-args", f"{LONG} {BLOCKS[block]} {flags}"),
                  f"the full fine-tune at blocks of {block} tokens, {what[form]}, compiled: real tokens/s, MFU, "
                  f"peak memory", 45, 90, 36, first=True, goal=goals[block] if form == "flex" else "")
             for block in BLOCKS for form, flags in ATTENTION_FORMS.items()]
    largest = max(BLOCKS)
    for name, flags in (("chunk-tokens", "--loss-chunk-tokens 8192"), ("chunks-8", "--loss-chunks 8")):
        parts.append(Part(f"finetune-{name}-{largest}", (
            "--recipe", "finetune_lm", "--configs", EAGER, "--steps", "10", "--recipe-args",
            f"{LONG} {BLOCKS[largest]} {ATTENTION_FORMS['flex']} {flags}"),
            f"flex packed at {largest}, eager, the loss in chunks {flags}: real tokens/s and peak memory", 40,
            first=True, goal="" if name == "chunks-8" else "token chunks / 8 chunks >= 1 real tokens/s (no slower)"))
    return parts


# Issue 50, item 4: AdamW's moments in fp32, bf16 and 8 bits (--optim-states) on one GPU, for the 1B shape ({llama})
# and for the largest full fine-tune bench/lm_memory.py fits on this GPU ({large}: that model's shape, built here as
# the 1B is), each run's peak memory beside the planner's figure for it; then that fine-tune (its states
# {large_states}: the most precise that fit) in float8 against bf16, both compiled. Every run as the planner plans
# it: --gradient-checkpointing, the default chunks of the loss, STEP_TOKENS on the one GPU (FINETUNE's global batch 8
# of blocks of 1024, packed: every position a token).
STEP_TOKENS = benchmark.DEFAULT_BATCH["finetune_lm"] * 1024
OPTIM_STATES = ("fp32", "bf16", "8bit")  # recipes/finetune_lm.py's --optim-states
MEMORY_GOAL = 0.15  # measured peak / the planner's figure within 1 +- this
FP8_GOAL = 1.15  # FP8 / bf16 real tokens/s (torchtune +15%, accelerate's example 1.25x, torchtitan 1.28x at 8B)
SHAPES = {"llama": ("1b", "the 1B Llama shape", 40), "large": ("largest", "the largest full fine-tune the planner "
                                                                         "fits on this GPU (its shape)", 60)}
FP8_CONFIGS = ("fsdp_fp8.yaml", "fsdp_fp8.yaml+bf16")  # the float8 run, and the same config in bf16


def optim_states_parts():
    """Issue 50's parts: --optim-states fp32, bf16, 8bit for each shape of SHAPES on one GPU (1gpu.yaml, eager: peak
    memory beside the planner's), then FP8 against bf16 on the largest (fsdp_fp8.yaml on one process: real
    tokens/s)."""
    parts = []
    for key, (label, what, expected) in SHAPES.items():
        for states in OPTIM_STATES:
            parts.append(Part(f"optim-states-{label}-{states}", (
                "--recipe", "finetune_lm", "--configs", EAGER, "--steps", "10", "--num-processes", "1",
                "--recipe-args", f"{FINETUNE.replace('{llama}', '{' + key + '}')} --packing --gradient-checkpointing "
                                 f"--optim-states {states}"),
                f"{what}, full fine-tune with --optim-states {states}, --gradient-checkpointing, one GPU: peak memory "
                f"beside bench/lm_memory.py's figure", expected, first=True, planned=(key, states),
                goal=f"peak memory within {100 * MEMORY_GOAL:.0f}% of the planner's figure for this run"))
    parts.append(Part("finetune-fp8", (
        "--recipe", "finetune_lm", "--configs", *FP8_CONFIGS, "--steps", "10", "--num-processes", "1",
        "--mixed-precision", "fp8", "--recipe-args",
        f"{FINETUNE.replace('{llama}', '{large}')} --packing --gradient-checkpointing --optim-states {{large_states}}"),
        f"{SHAPES['large'][1]}: fsdp_fp8.yaml on one process, float8 against the same config with "
        "--mixed_precision bf16, both compiled (its regional compilation): real tokens/s", 150, 150, 60, first=True,
        goal=f"FP8 / bf16 >= {FP8_GOAL:g}x real tokens/s"))
    return parts


# In the order they run: the fine-tunes first, then the rest; a budget cut leaves out the last ones.
PARTS = [
    Part("finetune-full", ("--recipe", "finetune_lm", "--configs", *FULL, "--steps", "20",
                           "--recipe-args", f"{FINETUNE} --packing"),
         "1B Llama shape, full fine-tune on packed uneven chats: real tokens/s, MFU, peak memory, compile speed-up",
         90, 100, 32, first=True),
    Part("finetune-lora", ("--recipe", "finetune_lm", "--configs", *FULL, "--steps", "20",
                           "--recipe-args", f"{FINETUNE} {LORA} --packing"),
         "the same with LoRA r 16: LoRA / full, eager and compiled", 80, 90, 22, first=True),
    Part("finetune-padded", ("--recipe", "finetune_lm", "--configs", EAGER, "--steps", "20",
                             "--recipe-args", f"{FINETUNE} --no-packing"),
         "the full fine-tune on the same chats, each padded to the block: packed / padded real tokens/s", 35,
         first=True),
    Part("finetune-lora-zero3", ("--recipe", "finetune_lm", "--configs", "deepspeed_zero3.yaml", "--steps", "20",
                                 "--recipe-args", f"{FINETUNE} {LORA} --packing"),
         "LoRA r 16 under ZeRO-3 on one process: ZeRO-3 LoRA / LoRA without an engine (1gpu.yaml)", 60, first=True),
    Part("finetune-chunked-loss", ("--recipe", "finetune_lm", "--configs", EAGER, "--steps", "20",
                                   "--recipe-args", f"{FINETUNE} --packing --loss-chunks 1"),
         "the full fine-tune with the plain loss (--loss-chunks 1): peak memory and tokens/s against finetune-full's "
         "default, the loss in chunks of 8,192 positions", 35, first=True),
    Part("finetune-qlora", ("--recipe", "finetune_lm", "--configs", EAGER, "--steps", "20",
                            "--recipe-args", f"{FINETUNE} {LORA} --load-in-4bit --packing"),
         "LoRA r 16 on the 4-bit (NF4) base (bitsandbytes, from .gpu/w): peak memory and tokens/s against "
         "finetune-lora's eager run", 45, first=True),
    *attention_parts(),
    Part("dpo-lora", ("--recipe", "dpo", "--configs", EAGER, "--steps", "10", "--batch-size", "8",
                      "--recipe-args", DPO),
         "1B Llama shape, LoRA r 16 DPO (recipes/dpo.py) on pairs of the chats' answers, the reference the adapters "
         "disabled: real tokens/s and peak memory", 40, first=True),
    *optim_states_parts(),
    Part("gpt", ("--recipe", "gpt", "--preset", "124M", "--configs", *FULL, "--steps", "60"),
         "GPT-124M: throughput, MFU, recipe / lean loop (goal compiled), compile speed-up", 70, 70, 12),
    Part("mnist", ("--recipe", "mnist", "--configs", *FULL, "--no-baselines", "--steps", "200", "--batch-size", "512"),
         "MNIST: throughput, recipe / lean loop (goal at global batch 512), compile speed-up", 45, 40, 1),
    Part("resnet", ("--recipe", "resnet", "--configs", *FULL, "--steps", "60",
                    "--recipe-args", "--data-dir {images} --image-size 32 --num-workers 4"),
         "ResNet-18 at 32 px: throughput, compile speed-up", 50, 40, 2),
    Part("zero2-overlap", ("--recipe", "gpt", "--preset", "124M", "--configs", "deepspeed_zero2.yaml",
                           "deepspeed_zero2.yaml+no-overlap", "--no-lean", "--steps", "40"),
         "GPT-124M under ZeRO-2, gradient reduction overlapping backward or after it", 25),
    Part("fsdp-units", ("--recipe", "gpt", "--preset", "124M", "--configs", "fsdp.yaml", "fsdp.yaml+one-unit",
                        "--no-lean", "--steps", "40"),
         "GPT-124M under FSDP2, one unit per block or the whole model as one unit", 20),
]
# Dense bf16 peak TFLOPS by device name (first match), the MFU denominator: the SXM figure would understate the
# MFU of a PCIe card by up to a quarter.
PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0)]
# Issue "Fine-tune at H100 speed": the 1B Llama shape, built here with random weights (no download).
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "max_position_embeddings": 8192, "tie_word_embeddings": True}  # issue 55: 8k
CHATS = 2000  # conversations in chats.jsonl: a few hundred thousand tokens, more than 23 steps of 8 x 1024 use
WARM_STEPS = 3  # optimizer steps of a warm-up run: the first compiles the training graph, the end evaluates
WARM_AT_ONCE = 2  # warm-ups at a time: dynamo's tracing is one Python thread each; inductor's workers share cores
WARM_MEMORY_SHARE = 0.9
WARM_SHARE = 0.45  # of a stage's time left, at most, for its warm-ups
START_SHARE = 0.5  # a part starts with at least this share of its expected time left: its first runs can end
INPUTS_S = 15  # expected: the images, the 1B model drawn on the GPU and saved, the chats
STOP_GRACE_S = 30  # after SIGTERM, a part's benchmark has this long to write its report
WORK = REPO / ".gpu" / "table"  # the parts' reports, logs, runs and inputs (ignored by git)


def peak_tflops_for(name):
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def selected(names):
    """The parts of PARTS named (all by default), in PARTS' order; raises ValueError naming the unknown."""
    folders = [part.folder for part in PARTS]
    unknown = [n for n in names or [] if n not in folders]
    if unknown:
        raise ValueError(f"no such part: {', '.join(unknown)} (there are {', '.join(folders)})")
    return [part for part in PARTS if not names or part.folder in names]


def stages(parts):
    """[(stage name, its parts)]: the fine-tune parts, then the rest, each in PARTS' order."""
    return [(name, [p for p in parts if p.first == first])
            for name, first in (("fine-tune", True), ("the rest", False)) if any(p.first == first for p in parts)]


def reachable(parts, left_s):
    """The parts of a stage whose warm-up is worth its time: in order, those the estimates say can start with
    START_SHARE of their time left after the ones before them."""
    out, at = [], 0.0
    for part in parts:
        if not part.missing and left_s - at >= START_SHARE * part.expected_s:
            out.append(part)
            at += part.expected_s
    return out


# The variants that compare what one process lacks (a reduction to overlap, parameters to shard): left out on one GPU.
ENGINE_VARIANTS = ("deepspeed_zero2.yaml+no-overlap", "fsdp.yaml+one-unit")


def part_argv(part, peak_tflops, inputs, gpus, leave_out=()):
    """bench/benchmark.py's arguments for one part on this machine: the inputs filled in, MFU's peak for the
    recipes that report MFU, with one GPU no ENGINE_VARIANTS (see the module docstring), without the configs of
    leave_out (compiled runs whose warm-up did not end), in bf16 unless the part names its precision."""
    argv = []
    for arg in part.args:
        for key, path in inputs.items():
            arg = arg.replace("{" + key + "}", str(path))
        if (gpus >= 2 or arg not in ENGINE_VARIANTS) and arg not in leave_out:
            argv.append(arg)
    recipe = argv[argv.index("--recipe") + 1]
    if recipe in ("gpt", "finetune_lm"):  # the lean loop takes the same flag
        extra = f"--peak-tflops {peak_tflops:g}"
        if "--recipe-args" in argv:
            at = argv.index("--recipe-args") + 1
            argv[at] = f"{argv[at]} {extra}"
        else:
            argv += ["--recipe-args", extra]
    return argv if "--mixed-precision" in argv else argv + ["--mixed-precision", "bf16"]  # the FP8 part's: its own


def part_command(part, out, peak_tflops, inputs, gpus, leave_out=()):
    """One part's benchmark run, in bf16, into out/<folder>."""
    return [sys.executable, str(REPO / "bench" / "benchmark.py"),
            *part_argv(part, peak_tflops, inputs, gpus, leave_out), "--out", str(out / part.folder)]


def part_commands(out, peak_tflops, inputs, gpus, parts=PARTS):
    """[(folder, command)]: one benchmark run per part that can run, into out/<folder>."""
    return [(part.folder, part_command(part, out, peak_tflops, inputs, gpus)) for part in parts if not part.missing]


@dataclass
class Warm:
    part: str
    name: str
    cmd: list
    env: dict
    gb: float


def warm_plan(commands, parts, out, threads, cores=None):
    """The compiled runs of every part, as the part will launch them but for WARM_STEPS steps (the same model,
    batch, precision and config, so the same graphs), each into out/warm/; inductor's compile workers: the cores
    shared among the WARM_AT_ONCE warm-ups that run together."""
    gb = {part.folder: part.warm_gb for part in parts}
    compile_threads = max(1, (cores or os.cpu_count() or 2) // WARM_AT_ONCE)
    warms = []
    for folder, cmd in commands:
        if not gb[folder]:
            continue
        args = benchmark.parse_args(cmd[2:])
        args.steps = WARM_STEPS
        benchmark.add_single_process_run(args, True)
        data_root = benchmark.mnist_data_root(args) if args.recipe == "mnist" else None
        for name, repeat, run_cmd, env in benchmark.plan_runs(args, 1, True, data_root):
            is_compiled = (benchmark.compiled(name) if name in args.configs
                           else name == benchmark.lean_name((True, "cuda"), True))
            if repeat == 0 and is_compiled:
                slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{folder} {name}").strip("-")
                warms.append(Warm(folder, name, [*run_cmd, "--output-dir", str(out / "warm" / slug)],
                                  {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
                                   "TORCHINDUCTOR_COMPILE_THREADS": str(compile_threads), **env}, gb[folder]))
    return warms


def warm_up(warms, cap_gb, limit_s, log_dir, at_once=WARM_AT_ONCE):
    """Run the warm-ups in their order, at most at_once together and as many as fit in cap_gb by their estimates
    (always at least one), for at most limit_s; returns {part: run: how it ended}."""
    log_dir.mkdir(parents=True, exist_ok=True)
    pending, running, ended = list(warms), [], {}
    deadline = time.monotonic() + limit_s
    while pending or running:
        for warm in list(pending):
            if running and (len(running) >= at_once or sum(r.gb for r, _ in running) + warm.gb > cap_gb):
                break  # in order: the next one waits for room rather than a smaller one going first
            pending.remove(warm)
            with open(log_dir / f"{Path(warm.cmd[-1]).name}.log", "w") as log:
                running.append((warm, subprocess.Popen(warm.cmd, cwd=REPO, env=dict(os.environ, **warm.env),
                                                       stdout=log, stderr=subprocess.STDOUT,
                                                       start_new_session=True)))
        for warm, proc in [(w, p) for w, p in running if p.poll() is not None]:
            running.remove((warm, proc))
            ended[f"{warm.part}: {warm.name}"] = "warmed" if proc.returncode == 0 else f"failed ({proc.returncode})"
        if time.monotonic() > deadline:
            for warm, proc in running:
                stop_group(proc, grace_s=10)
                ended[f"{warm.part}: {warm.name}"] = f"stopped after {limit_s:.0f} s"
            ended.update({f"{w.part}: {w.name}": "not started" for w in pending})
            break
        time.sleep(0.5)
    return ended


def stop_group(proc, grace_s):
    """SIGTERM to the process group of proc (a run started in its own session), SIGKILL after grace_s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def run_part(cmd, seconds_left, log_path, grace_s=None):
    """One part's benchmark, its output into log_path; sent SIGTERM grace_s (STOP_GRACE_S) before its time is up.
    Returns how it ended."""
    grace_s = STOP_GRACE_S if grace_s is None else grace_s
    if seconds_left - grace_s <= 0:
        return "not run: the table's budget was spent"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=seconds_left - grace_s)
    except subprocess.TimeoutExpired:
        stop_group(proc, grace_s)
        return "stopped at the table's budget (the runs it finished are in its report)"
    return "done" if code == 0 else f"failed (exit {code}): see failures.log"


def chat_conversations(n=CHATS, seed=0):
    """Conversations in accelrun.data.tiny_hf's style with uneven lengths, as chat data has: one to three
    exchanges, each answer counting on from a number for 1 to 300 words drawn log-uniformly, so most are short
    and a few fill a 1024-token block (the longest are cut)."""
    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        messages = [{"role": "system", "content": "You count."}] if rng.random() < 1 / 3 else []
        for _ in range(rng.randint(1, 3)):
            words, start = int(math.exp(rng.uniform(0, math.log(300)))), rng.randrange(100)
            messages += [{"role": "user", "content": f"Count {words} from {start}."},
                         {"role": "assistant", "content": " ".join(str(start + k) for k in range(words))}]
        chats.append({"messages": messages})
    return chats


def write_model(folder, shape=LLAMA_1B, device="cuda", kind="LlamaConfig"):
    """folder: the tests' tokenizer and a causal LM of `shape` (transformers' config class `kind`) with random
    weights, saved in bf16 (kept when there already); returns the tokenizer."""
    import torch
    import transformers

    from accelrun.data.tiny_hf import corpus, write_tokenizer  # the byte-level BPE and chat template the tests use
    tokenizer = write_tokenizer(folder, [p + r for p, r in corpus()])
    if not (folder / "model.safetensors").exists():
        config = getattr(transformers, kind)(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                             **shape)
        torch.manual_seed(0)
        with torch.device(device):  # random weights drawn on the GPU: seconds, where the CPU takes minutes
            model = transformers.AutoModelForCausalLM.from_config(config)
        model.to(torch.bfloat16).save_pretrained(folder)
        del model
        if device == "cuda":  # give the GPU back to the runs: this process stays up for the whole table
            import gc
            gc.collect()
            torch.cuda.empty_cache()
    return tokenizer


def write_finetune_inputs(root, shape=LLAMA_1B, device="cuda"):
    """root/llama (the tests' tokenizer and a Llama of `shape` with random weights, saved in bf16) and
    root/chats.jsonl (chat_conversations); returns their paths and the chats' token counts."""
    import json
    llama, chats = root / "llama", root / "chats.jsonl"
    tokenizer = write_model(llama, shape, device)
    conversations = chat_conversations()
    chats.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    lengths = sorted(len(tokenizer.apply_chat_template(c["messages"], return_dict=True)["input_ids"])
                     for c in conversations)
    return {"llama": llama, "chats": chats}, {
        "conversations": len(lengths), "median_tokens": statistics.median(lengths),
        "mean_tokens": statistics.fmean(lengths), "longest": lengths[-1],
        "over_1024": sum(n > 1024 for n in lengths) / len(lengths)}


def write_preference_pairs(path, n=CHATS // 4, seed=0):
    """path: DPO's records from chat_conversations (recipes/dpo.py, chat messages): the prompt a conversation's
    first question (a short prompt: never longer than the block), chosen its answer, rejected the next
    conversation's first answer."""
    import json
    chats = [c["messages"] for c in chat_conversations(n, seed)]
    first = [next(k for k, m in enumerate(messages) if m["role"] == "assistant") for messages in chats]
    with open(path, "w") as f:
        for k, messages in enumerate(chats):
            j = (k + 1) % len(chats)
            f.write(json.dumps({"prompt": messages[:first[k]], "chosen": [messages[first[k]]],
                                "rejected": [chats[j][first[j]]]}) + "\n")
    return path


def planner():
    """bench/lm_memory.py, imported when a part needs it: it imports torch and transformers, which the plan of the
    other parts does without."""
    import lm_memory
    return lm_memory


def large_shape(gpu_gb):
    """(model, its config class, its published shape but the vocabulary, the states that fit): the largest full
    fine-tune bench/lm_memory.py fits on one GPU of gpu_gb at STEP_TOKENS tokens (SHAPES' "large"), its plan within
    the GPU less MEMORY_GOAL's margin: a plan the goal allows to be that far off must not run out of memory."""
    lm_memory = planner()
    name, fits = lm_memory.largest_full(gpus=1, gpu_gb=gpu_gb / (1 + MEMORY_GOAL), tokens=STEP_TOKENS)
    if name is None:
        raise ValueError(f"bench/lm_memory.py fits no full fine-tune on one GPU of {gpu_gb:.0f} GB")
    kind, shape = lm_memory.MODELS[name]
    shape = {k: v for k, v in shape.items() if k != "vocab_size"}  # the tests' tokenizer's, as the 1B's
    return name, kind, {**shape, "max_position_embeddings": LLAMA_1B["max_position_embeddings"]}, \
        [lm_memory.OPTIM_STATES[job] for job in fits]


def model_facts(folder):
    """{parameters, shape} of the model saved in folder (its config.json; counted on the meta device, nothing
    loaded): what the planner's figure for a run of it needs."""
    import torch
    import transformers
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size")
    return {"parameters": sum(p.numel() for p in model.parameters()), "shape": {k: getattr(config, k) for k in keys}}


def planned_gb(part, facts):
    """GB the planner puts a part's run at (bench/lm_memory.py's shape_parts for the model it ran, one GPU,
    STEP_TOKENS), or None for a part without `planned` or a model not written."""
    model = facts.get("models", {}).get(part.planned[0]) if part.planned else None
    if not model:
        return None
    lm_memory = planner()
    job = next(job for job, states in lm_memory.OPTIM_STATES.items() if states == part.planned[1])
    return sum(lm_memory.shape_parts(model["parameters"], model["shape"], job, STEP_TOKENS, gpus=1).values())


def gpu_memory_gb():
    """This GPU's memory (GB), for the planner's largest full fine-tune; 80 without one."""
    import torch
    return torch.cuda.get_device_properties(0).total_memory / 1e9 if torch.cuda.is_available() else 80.0


def write_inputs(out, parts, gpu_gb=None):
    """The inputs the selected parts need, in out/inputs/: {name: path}, and what they hold (the models' facts for
    the planner's figures; the largest full fine-tune on one GPU of gpu_gb, this GPU's memory by default, when a part
    runs it)."""
    root = out / "inputs"
    root.mkdir(parents=True, exist_ok=True)
    inputs, facts = {}, {}
    needs = " ".join(arg for part in parts for arg in part.args)
    if "{images}" in needs:
        from accelrun.data.image_folder import write_image_folder  # the striped-image classes
        inputs["images"] = root / "images"
        if not (inputs["images"] / "train").exists():
            write_image_folder(inputs["images"], train_per_class=1024, val_per_class=128, size=32)
    if "{llama}" in needs or "{large}" in needs:
        paths, facts["chats"] = write_finetune_inputs(root)
        inputs.update(paths)
        facts["models"] = {"llama": model_facts(paths["llama"])}
    if "{large}" in needs:  # only when a part runs it: seconds on the GPU, and 6 GB on disk at 3B
        gpu_gb = gpu_gb or gpu_memory_gb()
        name, kind, shape, fits = large_shape(gpu_gb)
        inputs["large"], inputs["large_states"] = root / name, fits[0]  # the states: the most precise that fit
        write_model(inputs["large"], shape, kind=kind)
        facts["models"]["large"] = model_facts(inputs["large"])
        facts["largest"] = {"model": name, "gpu_gb": gpu_gb, "states_that_fit": fits}
    if "{pairs}" in needs:
        inputs["pairs"] = write_preference_pairs(root / "pairs.jsonl")
    return inputs, facts


def ratio(by, a, b, key="throughput"):
    """by[a][key] / by[b][key], a and b (part, run) keys of measured rows; None where either is missing."""
    ra, rb = by.get(a), by.get(b)
    if not ra or not rb or "failed" in ra or "failed" in rb:
        return None
    va, vb = (max(r["peak_memory_mb_per_rank"]) if key == "peak_memory_mb" else r.get(key) for r in (ra, rb))
    return va / vb if va and vb else None


def shown(value, goal=None):
    """A ratio as the table shows it, with its goal (a minimum) met or not: "1.600 (goal >= 1.5: met)"."""
    text = "-" if value is None else f"{value:.3f}"
    if goal is None:
        return text
    verdict = "not measured" if value is None else "met" if value >= goal else "NOT met"
    return f"{text} (goal >= {goal:g}: {verdict})"


def recipe_lines(by, reports):
    """The comparisons of the gpt, mnist, resnet and engine parts."""
    lines = []
    for folder in ("gpt", "mnist", "resnet"):
        if folder not in reports:
            continue
        lean = reports[folder]["ratios"].get("recipe_vs_lean", {})
        verdicts = [f"recipe / lean loop under {c}: {v['value']:.3f} (goal {v['goal']}: "
                    f"{'met' if v['met'] else 'NOT met' if v['goal_applies'] else 'not judged'})"
                    for c, v in lean.items()]
        lines.append(f"- {folder}: compile speed-up (1gpu_compile.yaml / 1gpu.yaml) "
                     f"{shown(ratio(by, (folder, COMPILED), (folder, EAGER)))}" + "".join(f"; {v}" for v in verdicts))
    if ("zero2-overlap", "deepspeed_zero2.yaml+no-overlap") in by:
        lines.append("- ZeRO-2 overlap_comm on / off: " + shown(ratio(
            by, ("zero2-overlap", "deepspeed_zero2.yaml"), ("zero2-overlap", "deepspeed_zero2.yaml+no-overlap"))))
    if ("fsdp-units", "fsdp.yaml+one-unit") in by:
        per_block, one = ("fsdp-units", "fsdp.yaml"), ("fsdp-units", "fsdp.yaml+one-unit")
        lines.append(f"- FSDP one unit per block / one unit: {shown(ratio(by, per_block, one))} (peak memory per "
                     f"block / one unit: {shown(ratio(by, per_block, one, 'peak_memory_mb'))})")
    return lines


def finetune_lines(by):
    """The fine-tune comparisons, each with its goal (issue "Fine-tune at H100 speed", issue 42 item 3)."""
    if not any(part.startswith("finetune") for part, _ in by):
        return []
    full, lora, padded, zero3 = "finetune-full", "finetune-lora", "finetune-padded", "finetune-lora-zero3"
    mfu = (by.get((full, COMPILED)) or {}).get("mfu")
    mfu_verdict = "not measured" if mfu is None else "met" if mfu >= 0.5 else "NOT met"
    return [
        f"- fine-tune, LoRA / full (real tokens/s): eager {shown(ratio(by, (lora, EAGER), (full, EAGER)), 1.5)}, "
        f"compiled {shown(ratio(by, (lora, COMPILED), (full, COMPILED)), 1.5)}",
        f"- fine-tune, packed / padded (real tokens/s, full fine-tune, eager): "
        f"{shown(ratio(by, (full, EAGER), (padded, EAGER)), 2)}",
        f"- fine-tune, compiled full fine-tune MFU: {'-' if mfu is None else f'{100 * mfu:.1f}%'} (goal >= 50%: "
        f"{mfu_verdict})",
        f"- fine-tune, ZeRO-3 LoRA / LoRA without an engine (one process, eager): "
        f"{shown(ratio(by, (zero3, 'deepspeed_zero3.yaml'), (lora, EAGER)), 0.8)}",
        f"- fine-tune, compile speed-up (1gpu_compile.yaml / 1gpu.yaml): full "
        f"{shown(ratio(by, (full, COMPILED), (full, EAGER)))}, "
        f"LoRA {shown(ratio(by, (lora, COMPILED), (lora, EAGER)))}", *attention_lines(by)]


def optim_states_rows(by, facts):
    """Issue 50's figures: [{part, model, states, peak_gb, planned_gb, ratio, met}] for each --optim-states run
    measured or planned (peak: the run's max_memory_allocated; met: within MEMORY_GOAL of the planner's), and
    {fp8, bf16, ratio, met} for FP8 against bf16 (real tokens/s); None where nothing of it was measured."""
    rows, planned = [], facts.get("planned_gb", {})
    for part in PARTS:
        row = by.get((part.folder, EAGER))
        if not part.planned or (row is None and part.folder not in planned):
            continue
        peak = None if not row or "failed" in row else max(row["peak_memory_mb_per_rank"]) * 2 ** 20 / 1e9
        plan = planned.get(part.folder)
        value = peak / plan if peak and plan else None
        model = (facts.get("largest") or {}).get("model", "the largest") if part.planned[0] == "large" else "1B"
        rows.append({"part": part.folder, "model": model, "states": part.planned[1], "peak_gb": peak,
                     "planned_gb": plan, "ratio": value,
                     "met": None if value is None else abs(value - 1) <= MEMORY_GOAL})
    fp8, bf16 = (("finetune-fp8", config) for config in FP8_CONFIGS)
    if fp8 not in by and bf16 not in by:
        return rows, None
    value = ratio(by, fp8, bf16)
    return rows, {"fp8": fp8[1], "bf16": bf16[1], "ratio": value,
                  "met": None if value is None else value >= FP8_GOAL}


def optim_states_lines(by, facts):
    """Issue 50's comparisons for table.md, each with its goal: every --optim-states run's peak memory beside the
    planner's figure, FP8 / bf16 real tokens/s."""
    rows, fp8 = optim_states_rows(by, facts)
    gb = lambda v: "-" if v is None else f"{v:.1f} GB"  # noqa: E731
    lines = [f"- optimizer states, {r['model']} shape, --optim-states {r['states']}, one GPU: peak {gb(r['peak_gb'])}"
             f", the planner's {gb(r['planned_gb'])}: measured / planned {shown(r['ratio'])} (goal within "
             f"{100 * MEMORY_GOAL:.0f}%: {'not measured' if r['met'] is None else 'met' if r['met'] else 'NOT met'})"
             for r in rows]
    if fp8:
        model = (facts.get("largest") or {}).get("model", "the largest")
        lines.append(f"- FP8 / bf16, {model} shape, fsdp_fp8.yaml on one process, compiled (real tokens/s): "
                     f"{shown(fp8['ratio'], FP8_GOAL)}")
    return lines


def attention_lines(by):
    """Issue 55's comparisons, each with its goal: flex packed against padded and dense packed at each block."""
    lines = []
    for block in BLOCKS:
        flex, dense, padded = ((f"finetune-{form}-{block}", COMPILED) for form in ATTENTION_FORMS)
        if not any(key in by for key in (flex, dense, padded)):
            continue
        memory = "" if block != max(BLOCKS) else (
            f"; peak memory dense / flex {shown(ratio(by, dense, flex, 'peak_memory_mb'), ATTENTION_GOALS['memory'])}"
            " (flex below dense: above 1)")
        lines.append(f"- fine-tune at {block} tokens, compiled, real tokens/s: flex packed / padded "
                     f"{shown(ratio(by, flex, padded), ATTENTION_GOALS['padded'])}, flex / dense packed "
                     f"{shown(ratio(by, flex, dense), ATTENTION_GOALS['dense'])}{memory}")
    tokens, counted = ((f"finetune-{name}-{max(BLOCKS)}", EAGER) for name in ("chunk-tokens", "chunks-8"))
    if tokens in by or counted in by:
        lines.append(f"- fine-tune at {max(BLOCKS)} tokens, eager, loss chunks of 8192 tokens / 8 chunks (real "
                     f"tokens/s): {shown(ratio(by, tokens, counted), ATTENTION_GOALS['chunks'])}; peak memory "
                     f"8 chunks / token chunks {shown(ratio(by, counted, tokens, 'peak_memory_mb'))}")
    return lines


def table_rows(reports):
    """({(part, run): row}, the table's lines): one line per run of every part."""
    fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
    by, lines = {}, []
    for folder, report in reports.items():
        for row in report["table"]:
            by[(folder, row["name"])] = row
            if "failed" in row:
                lines.append(f"| {folder} | {row['name']} | FAILED: {row['failed'][:120]} | | | | | | |")
                continue
            unit = row["unit"].replace("_per_s", "/s")
            lines.append(f"| {folder} | {row['name']} | {row['processes']} | {row['throughput']:.0f} {unit} | "
                         f"{fmt(row.get('mfu') and 100 * row['mfu'], '{:.1f}%')} | {row['step_ms']:.1f} | "
                         f"{' / '.join(f'{m:.0f}' for m in row['peak_memory_mb_per_rank'])} | "
                         f"{fmt(row.get('padding_share') and 100 * row['padding_share'], '{:.0f}%')} | "
                         f"{fmt(row.get('fsdp_units'), '{}')} |")
    return by, lines


def markdown(reports, name, date, peak, progress):
    """table.md: every run of every part, the comparisons with their goals, where the time went, and how each part
    ended (not reached and not built yet included). progress: {"statuses": {part: how it ended}, "timings": {phase
    or part: seconds}, "facts", "warm", "gpus"}."""
    hw = next(iter(reports.values()))["hardware"] if reports else {}
    by, rows = table_rows(reports)
    lines = [f"# GPU table: {name}", "",
             f"Measured {date} on {hw.get('label', name)} ({hw.get('host', '?')}); torch {hw.get('torch')}, "
             f"accelerate {hw.get('accelerate')}, DeepSpeed {hw.get('deepspeed')}. `python gpu_check/gpu_table.py`: "
             f"bf16, MFU against {peak:g} TFLOPS; each part's own report (results.md, logs) is in .gpu/table/ on the "
             "machine. The fine-tune runs' tokens/s and MFU count real tokens (not padding) and each example's "
             "attention span; padding: the share of positions that are padding.", "",
             "| part | run | procs | throughput | MFU | step ms | peak MB per proc | padding | FSDP units |",
             "|---|---|---|---|---|---|---|---|---|", *rows,
             "", "Comparisons (throughput ratios of the runs above):", "",
             *finetune_lines(by), *optim_states_lines(by, progress["facts"]), *recipe_lines(by, reports)]
    if progress["gpus"] < 2 and any(p in reports for p in ("zero2-overlap", "fsdp-units")):
        lines.append("- With one GPU, ZeRO-2 and FSDP run one process: there is no reduction to overlap and nothing "
                     "to shard, so their variants (no-overlap, one-unit) are left out and the shipped configs show "
                     "the engines' overhead only; on 2 GPUs the two parts compare the real thing.")
    chats = progress["facts"].get("chats")
    if chats:
        lines.append(f"\nChats (inputs/chats.jsonl, the tests' tokenizer): {chats['conversations']} conversations, "
                     f"median {chats['median_tokens']:.0f} tokens, mean {chats['mean_tokens']:.0f}, longest "
                     f"{chats['longest']}, {100 * chats['over_1024']:.1f}% longer than the block (cut).")
    lines.append("\nTime (s): " + ", ".join(f"{k} {v:.0f}" for k, v in progress["timings"].items()) + ".")
    warmed = progress["warm"]
    if warmed:
        lines.append(f"Compile warm-up: {sum(v == 'warmed' for v in warmed.values())} of {len(warmed)} compiled runs "
                     "warmed the caches" + "".join(f"; {k}: {v}" for k, v in warmed.items() if v != "warmed") + ".")
    lines += ["", "Parts, in the order they run:", ""]
    lines += [f"- {part}: {status}" for part, status in progress["statuses"].items()]
    return "\n".join(lines) + "\n"


def reports_in(table_dir, folders):
    return {folder: json.loads((table_dir / folder / "results.json").read_text())
            for folder in folders if (table_dir / folder / "results.json").exists()}


def write_atomically(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def log_tail(path, lines=40):
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({exc})"


class Table:
    """What the table has measured so far, and its three files in OUT, rewritten after each part."""

    def __init__(self, out, work, name, date, peak, gpus, parts):
        self.out, self.work, self.name, self.date, self.peak = out, work, name, date, peak
        self.parts, self.inputs = parts, {}
        self.progress = {"statuses": {p.folder: "waiting" for p in parts}, "timings": {}, "facts": {}, "warm": {},
                         "gpus": gpus}
        for part in parts:
            if part.missing:
                self.progress["statuses"][part.folder] = f"not built yet: {part.missing}"
        self.failures = []
        out.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)

    def ended(self, folder, status, seconds):
        """A part's end: its status, its time, its failed runs' log tails; then the files. Its runs' folders go:
        the exported models (4 GB each for the 1B fine-tunes) would fill the disk, and nothing reads them."""
        import shutil
        shutil.rmtree(self.work / folder / "runs", ignore_errors=True)
        self.progress["statuses"][folder] = status
        if seconds is not None:
            self.progress["timings"][folder] = seconds
        report = reports_in(self.work, [folder]).get(folder)
        runs = [r for r in (report or {}).get("runs", []) if "failed" in r and r.get("exit_code") is not None]
        for r in runs:
            self.failures.append(f"== {folder}: {r['name']} (exit {r['exit_code']}), {r['log']}\n{log_tail(r['log'])}")
        if status.startswith("failed") and not runs:
            log = self.work / f"{folder}.log"
            self.failures.append(f"== {folder}: the benchmark itself ({status}), {log}\n{log_tail(log)}")
        self.write()

    def out_of_reach(self, part, parts, budget_s):
        """Before the inputs: a part on the largest full fine-tune that the estimates cannot reach even with no
        warm-up (reachable over the whole plan) is listed as not reached, so that its model (6 GB at 3B) is not
        written for nothing. Returns whether it was."""
        if not any("{large}" in arg for arg in part.args) or part in reachable(parts, budget_s - INPUTS_S):
            return False
        self.ended(part.folder, "not reached: the estimates put its start beyond the budget, so its model was not "
                                "written", None)
        return True

    def planned(self, part):
        """Before the runs: the planner's figure for a part that has one, into the facts (planned_gb); a state the
        planner does not fit on this GPU for the largest full fine-tune is left out, saying so. Returns why it is
        left out, or ""."""
        facts = self.progress["facts"]
        largest = facts.get("largest") or {}
        if part.planned[:1] == ("large",) and largest and part.planned[1] not in largest["states_that_fit"]:
            why = (f"left out: bench/lm_memory.py does not fit {largest['model']} with --optim-states "
                   f"{part.planned[1]} on one GPU of {largest['gpu_gb']:.0f} GB")
            self.ended(part.folder, why, None)
            return why
        figure = planned_gb(part, facts)
        if figure is not None:
            facts.setdefault("planned_gb", {})[part.folder] = figure
        return ""

    def warmed(self, ended, log_dir):
        self.progress["warm"].update(ended)
        for run, how in ended.items():
            if how.startswith("failed"):
                slug = re.sub(r"[^A-Za-z0-9]+", "-", run.replace(": ", " ")).strip("-")
                self.failures.append(f"== warm-up {run}: {how}\n{log_tail(log_dir / f'{slug}.log')}")
        self.write()

    def write(self):
        reports = reports_in(self.work, [p.folder for p in self.parts])
        text = markdown(reports, self.name, self.date, self.peak, self.progress)
        memory, fp8 = optim_states_rows(table_rows(reports)[0], self.progress["facts"])
        data = {"gpu": self.name, "date": self.date, "peak_tflops": self.peak, **self.progress,
                "parts": {folder: {"table": r["table"], "ratios": r["ratios"], "settings": r.get("settings")}
                          for folder, r in reports.items()}, "optim_states": memory, "fp8": fp8}
        write_atomically(self.out / "table.json", json.dumps(data, indent=1, default=str))
        write_atomically(self.out / "table.md", text)
        write_atomically(self.out / "failures.log", "\n\n".join(self.failures) + "\n" if self.failures else "")
        return text


def plan_lines(parts, budget_s):
    """The plan (--dry-run): the inputs, then each stage's warm-up and parts in the order they run, each with its
    expected time and where the estimates put its end; what they say the budget does not reach, and the parts not
    built yet, are marked."""
    lines = [f"table: {budget_s:.0f} s, the fine-tune parts first (expected seconds on one H100: estimates, none "
             "measured yet)", f"  {'inputs':<44} ~{INPUTS_S:>3.0f} s  (until {INPUTS_S:.0f} s)"]
    if any("{large}" in arg for part in parts for arg in part.args):
        name, _, _, fits = large_shape(80.0)
        lines.append(f"  {'':<44} the largest full fine-tune bench/lm_memory.py fits on one GPU of 80 GB less "
                     f"{100 * MEMORY_GOAL:.0f}% (on the machine: of its GPU's memory): {name}, --optim-states "
                     f"{', '.join(fits)} (FP8 with {fits[0]})")
    at, number = INPUTS_S, 0
    for stage, members in stages(parts):
        warm = [p for p in reachable(members, budget_s - at) if p.warm_gb]
        if warm:
            seconds = min(max(max(p.warm_s for p in warm), sum(p.warm_s for p in warm) / WARM_AT_ONCE),
                          WARM_SHARE * (budget_s - at))
            at += seconds
            lines.append(f"  {'warm-up: ' + ', '.join(p.folder for p in warm):<44} ~{seconds:>3.0f} s  "
                         f"(until {at:.0f} s; {WARM_AT_ONCE} at a time)")
        for part in members:
            number += 1
            label = f"{number}. {part.folder}"
            if part.missing:
                lines.append(f"  {label:<44} not built yet: {part.missing}")
                continue
            at += part.expected_s
            reach = "" if at <= budget_s else "; beyond the budget by the estimates: runs if those before end sooner"
            lines.append(f"  {label:<44} ~{part.expected_s:>3.0f} s  (until {at:.0f} s{reach})")
            if part.goal:
                lines.append(f"  {'':<44} goal: {part.goal}")
    return lines


def run_stage(stage, members, table, commands, deadline, no_warm):
    """One stage: the warm-ups of the parts the budget may reach, then each part in turn (module docstring)."""
    left = deadline - time.monotonic()
    warm = [(p, cmd) for p, cmd in commands if p in reachable(members, left) and p.warm_gb]
    warmed = {}
    if not no_warm and warm:
        begun = time.monotonic()
        warmed = warm_phase([(p.folder, cmd) for p, cmd in warm], [p for p, _ in warm], table.work,
                            table.progress["gpus"], WARM_SHARE * left)
        table.progress["timings"][f"warm-up ({stage})"] = time.monotonic() - begun
        table.warmed(warmed, table.work / "warm" / "logs")
    for part, cmd in commands:
        if part not in members:
            continue
        left = deadline - time.monotonic()
        if left < max(START_SHARE * part.expected_s, STOP_GRACE_S + 1):  # +1: a part needs a moment of its own
            table.ended(part.folder, f"not reached: {max(left, 0):.0f} s of the budget left, it needs about "
                                     f"{part.expected_s:.0f} s", None)
            continue
        unwarmed = [run.split(": ", 1)[1] for run, how in warmed.items()
                    if run.startswith(f"{part.folder}: ") and how.startswith(("stopped", "not started"))]
        if unwarmed:
            cmd = part_command(part, table.work, table.peak, table.inputs, table.progress["gpus"], unwarmed)
        print(f"gpu table: {part.folder}: {' '.join(cmd[1:])}", flush=True)
        begun = time.monotonic()
        status = run_part(cmd, left, table.work / f"{part.folder}.log")
        if unwarmed:
            status += (f"; not measured: {', '.join(unwarmed)} (its compile warm-up did not end, so it would "
                       "have compiled inside its measured run)")
        table.ended(part.folder, status, time.monotonic() - begun)
        print(f"gpu table: {part.folder}: {status} in {time.monotonic() - begun:.0f} s", flush=True)


def gpu_table(args):
    """Inputs, then each stage's warm-ups and parts within --budget-s; OUT's files after each part. Exit 1 when a
    part failed."""
    import torch
    started = time.monotonic()
    deadline = started + args.budget_s
    if not torch.cuda.is_available():
        print("error: the GPU table measures GPUs and this machine has no CUDA device; run it where one is "
              "(README, 'On a GPU'), or see its plan with --dry-run", file=sys.stderr)
        return 2
    parts = selected(args.parts)
    name = torch.cuda.get_device_name(0)
    peak = args.peak_tflops or peak_tflops_for(name)
    if not peak:
        print(f"error: no dense bf16 peak known for {name!r}: pass --peak-tflops", file=sys.stderr)
        return 2
    date, gpus = time.strftime("%Y-%m-%d"), torch.cuda.device_count()
    slug = f"{date}-{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-').lower()}"
    out = Path(args.out or REPO / "bench" / "results" / slug).resolve()
    table = Table(out, (Path(args.work) / slug).resolve(), name, date, peak, gpus, parts)
    os.chdir(REPO)  # the parts' relative paths (mnist's data/) are the repository's, wherever this was started
    table.write()
    parts = [p for p in parts if not table.out_of_reach(p, parts, args.budget_s)]
    table.inputs, table.progress["facts"] = write_inputs(table.work, [p for p in parts if not p.missing])
    table.progress["timings"]["inputs"] = time.monotonic() - started
    parts = [p for p in parts if not p.missing and not table.planned(p)]
    commands = [(p, part_command(p, table.work, peak, table.inputs, gpus)) for p in parts]
    for stage, members in stages(parts):
        run_stage(stage, members, table, commands, deadline, args.no_warm)
    text = table.write()
    print(text)
    # Not reached, stopped at the budget, not built yet: listed, not failures (a lower budget shortens the table).
    return 1 if any(s.startswith("failed") for s in table.progress["statuses"].values()) else 0


def warm_phase(commands, parts, work, gpus, limit_s):
    """A stage's compile warm-up (module docstring, 2): {part: run: how its warm-up ended}; the warm-up runs'
    output folders (exported models) are removed after it, their logs kept in work/warm/logs."""
    import shutil

    import torch
    threads = max(1, (os.cpu_count() or 2) // gpus)  # as bench/benchmark.py gives the measured runs
    cap_gb = WARM_MEMORY_SHARE * torch.cuda.get_device_properties(0).total_memory / 1e9
    warms = warm_plan(commands, parts, work, threads)
    print(f"gpu table: compile warm-up of {len(warms)} runs, {WARM_AT_ONCE} at a time within {cap_gb:.0f} GB, "
          f"for at most {limit_s:.0f} s", flush=True)
    ended = warm_up(warms, cap_gb, limit_s, work / "warm" / "logs")
    for warm in warms:
        shutil.rmtree(warm.cmd[-1], ignore_errors=True)
    return ended


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="seconds for the whole table; a part still running then is stopped (its finished runs are "
                        "kept) and the parts after it are listed as not reached")
    p.add_argument("--parts", nargs="+", default=None, help="only these parts (default: all), in PARTS' order")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="the GPU's dense bf16 peak for MFU (0: from the device's name, PEAK_TFLOPS)")
    p.add_argument("--no-warm", action="store_true",
                   help="no compile warm-up; every compiled run compiles in its own measured run")
    p.add_argument("--out", default=None,
                   help="where table.md, table.json and failures.log go (default: bench/results/<date>-<gpu>)")
    p.add_argument("--work", default=str(WORK), help="the parts' reports, logs, runs and inputs")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    return one_line_errors(p).parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        parts = selected(args.parts)
    except ValueError as exc:
        print(f"error: --parts: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print("\n".join(plan_lines(parts, args.budget_s)))
        return 0
    return gpu_table(args)


if __name__ == "__main__":
    sys.exit(main())
