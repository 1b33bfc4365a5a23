"""The GPU table: the project's comparisons on a GPU, measured in one device call.

    python bench/benchmark.py --gpu-table                  # or: bash bench/gpu_pack.sh table (README, "On a GPU")
    python bench/benchmark.py --gpu-table --parts finetune-full finetune-lora --budget-s 300

Owns the table's parts (PARTS: one bench/benchmark.py run each, into OUT/<date>-<gpu>/<part>/), the inputs they
need made on the machine (striped images, the 1B Llama shape with the tests' tokenizer, uneven chat data: nothing
is downloaded), the compile warm-up, the time budget, and OUT/<date>-<gpu>/README.md, which puts the parts side by
side with the goals of the issues that asked for them.

Where the time goes, and how it fits one call (issue "What the H100 showed": the first table spent 440 s on 3 of
its 5 parts, mostly in process start-up and compilation):
  1. inputs: seconds;
  2. warm-up: every compiled run of every part for WARM_STEPS steps, several at once on the one GPU (each part
     says how much GPU memory one of its runs may take, and together they stay under WARM_MEMORY_SHARE of it),
     so that inductor's caches (FX graph, AOTAutograd, Triton kernels and autotuning, all on by default, in
     /tmp/torchinductor_<user>) hold each graph before it is measured. Nothing is measured here; a warm-up
     that fails (out of memory, say) only leaves its graphs to be compiled in the measured run;
  3. the parts, one run at a time: measurements never share the GPU. A compiled run now traces its model and
     loads the compiled graphs instead of compiling them;
  4. the budget (--budget-s, from the table's start): a part still running then is sent SIGTERM, the benchmark
     writes the report of the runs it finished, and the parts after it are listed as not run. README.md is
     rewritten after every part, so a call cut short still leaves what was measured.
With one GPU the two engine variants (ZeRO-2 without overlap_comm, FSDP as one unit) are left out: one process
has no gradient reduction to overlap and nothing to shard, so only the shipped configs' overhead is shown.
"""

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

import benchmark
from benchmark import REPO

# The fine-tune parts' recipe arguments: the 1B shape and the chats written here, blocks of 1024, global batch 8
# (issue "Fine-tune at H100 speed"). --packing / --no-packing: recipes/finetune_lm.py's flag (that issue, item 1).
FINETUNE = "--model {llama} --data-files {chats} --block-size 1024 --eval-batches 2"


@dataclass(frozen=True)
class Part:
    folder: str
    args: tuple  # bench/benchmark.py's arguments; {images}, {llama}, {chats}: the inputs written here
    what: str
    # GPU memory one compile warm-up run of this part may take (GB; the fine-tunes' from the peaks measured on an
    # H100 in issue "Fine-tune at H100 speed", 29.7 and 20.0 GB, plus the allocator's slack; GPT-124M's from its
    # activations at 32 x 1024 tokens, about 9 GB, plus its states); 0: nothing compiles.
    warm_gb: float = 0.0


# In the order they run: a budget cut leaves out the last ones (resnet and the engines were measured on the
# first contact; the fine-tunes never were).
PARTS = [
    Part("mnist", ("--recipe", "mnist", "--configs", "1gpu.yaml", "1gpu_compile.yaml", "--no-baselines",
                   "--steps", "200", "--batch-size", "512"),
         "MNIST: throughput, recipe / lean loop (goal at global batch 512), compile speed-up", 1),
    Part("gpt", ("--recipe", "gpt", "--preset", "124M", "--configs", "1gpu.yaml", "1gpu_compile.yaml",
                 "--steps", "60"),
         "GPT-124M: throughput, MFU, recipe / lean loop (goal compiled), compile speed-up", 12),
    Part("finetune-full", ("--recipe", "finetune_lm", "--configs", "1gpu.yaml", "1gpu_compile.yaml", "--steps", "20",
                           "--recipe-args", f"{FINETUNE} --packing"),
         "1B Llama shape, full fine-tune on packed uneven chats: real tokens/s, MFU, peak memory, compile speed-up",
         32),
    Part("finetune-lora", ("--recipe", "finetune_lm", "--configs", "1gpu.yaml", "1gpu_compile.yaml", "--steps", "20",
                           "--recipe-args", f"{FINETUNE} --lora-r 16 --packing"),
         "the same with LoRA r 16: LoRA / full, eager and compiled", 22),
    Part("finetune-padded", ("--recipe", "finetune_lm", "--configs", "1gpu.yaml", "--steps", "20",
                             "--recipe-args", f"{FINETUNE} --no-packing"),
         "the full fine-tune on the same chats, each padded to the block: packed / padded real tokens/s"),
    Part("resnet", ("--recipe", "resnet", "--configs", "1gpu.yaml", "1gpu_compile.yaml", "--steps", "60",
                    "--recipe-args", "--data-dir {images} --image-size 32 --num-workers 4"),
         "ResNet-18 at 32 px: throughput, compile speed-up", 2),
    Part("zero2-overlap", ("--recipe", "gpt", "--preset", "124M", "--configs", "deepspeed_zero2.yaml",
                           "deepspeed_zero2.yaml+no-overlap", "--no-lean", "--steps", "40"),
         "GPT-124M under ZeRO-2, gradient reduction overlapping backward or after it"),
    Part("fsdp-units", ("--recipe", "gpt", "--preset", "124M", "--configs", "fsdp.yaml", "fsdp.yaml+one-unit",
                        "--no-lean", "--steps", "40"),
         "GPT-124M under FSDP2, one unit per block or the whole model as one unit"),
]
# Dense bf16 peak TFLOPS by device name (first match), the MFU denominator: the SXM figure would understate the
# MFU of a PCIe card by up to a quarter.
PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0)]
# Issue "Fine-tune at H100 speed": the 1B Llama shape, built here with random weights (no download).
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "max_position_embeddings": 2048, "tie_word_embeddings": True}
CHATS = 2000  # conversations in chats.jsonl: a few hundred thousand tokens, more than 23 steps of 8 x 1024 use
WARM_STEPS = 3  # optimizer steps of a warm-up run: the first compiles the training graph, the end evaluates
WARM_MEMORY_SHARE = 0.9
WARM_LIMIT_S = 240  # a warm-up still running then is stopped: its graphs compile in the measured run instead
STOP_GRACE_S = 30  # after SIGTERM, a part's benchmark has this long to write its report (the call ends at 600 s)


def peak_tflops_for(name):
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def selected(names):
    """The parts of PARTS named (all by default), in PARTS' order; raises ValueError naming the unknown."""
    folders = [part.folder for part in PARTS]
    unknown = [n for n in names or [] if n not in folders]
    if unknown:
        raise ValueError(f"no such part: {', '.join(unknown)} (there are {', '.join(folders)})")
    return [part for part in PARTS if not names or part.folder in names]


def part_argv(part, peak_tflops, inputs, gpus):
    """bench/benchmark.py's arguments for one part on this machine: the inputs filled in, MFU's peak for the
    recipes that report MFU, and with one GPU no CONFIG+VARIANT (see the module docstring)."""
    argv = []
    for arg in part.args:
        for key, path in inputs.items():
            arg = arg.replace("{" + key + "}", str(path))
        if gpus >= 2 or arg not in benchmark.VARIANTS:
            argv.append(arg)
    recipe = argv[argv.index("--recipe") + 1]
    if recipe in ("gpt", "finetune_lm"):  # the lean loop takes the same flag
        extra = f"--peak-tflops {peak_tflops:g}"
        if "--recipe-args" in argv:
            at = argv.index("--recipe-args") + 1
            argv[at] = f"{argv[at]} {extra}"
        else:
            argv += ["--recipe-args", extra]
    return argv + ["--mixed-precision", "bf16"]


def part_commands(out, peak_tflops, inputs, gpus, parts=PARTS):
    """[(folder, command)]: one benchmark run per part, in bf16, into out/<folder>."""
    return [(part.folder, [sys.executable, str(REPO / "bench" / "benchmark.py"),
                           *part_argv(part, peak_tflops, inputs, gpus), "--out", str(out / part.folder)])
            for part in parts]


@dataclass
class Warm:
    part: str
    name: str
    cmd: list
    env: dict
    gb: float


def warm_plan(commands, parts, out, threads):
    """The compiled runs of every part, as the part will launch them but for WARM_STEPS steps (the same model,
    batch, precision and config, so the same graphs), each into out/warm/."""
    gb = {part.folder: part.warm_gb for part in parts}
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
                                  {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **env}, gb[folder]))
    return warms


def warm_up(warms, cap_gb, limit_s, log_dir):
    """Run the warm-ups, as many at once as fit in cap_gb by their estimates (always at least one), for at most
    limit_s; returns {part name: how it ended}."""
    log_dir.mkdir(parents=True, exist_ok=True)
    # The largest first: they compile the longest, and the small ones fill the memory left beside them.
    pending, running, ended = sorted(warms, key=lambda w: -w.gb), [], {}
    deadline = time.monotonic() + limit_s
    while pending or running:
        for warm in list(pending):
            if running and sum(r.gb for r, _ in running) + warm.gb > cap_gb:
                continue
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


def run_part(cmd, seconds_left):
    """One part's benchmark, its output on ours; stopped at the budget. Returns how it ended."""
    if seconds_left <= 0:
        return "not run: the table's budget was spent"
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    try:
        code = proc.wait(timeout=seconds_left)
    except subprocess.TimeoutExpired:
        stop_group(proc, STOP_GRACE_S)
        return "stopped at the table's budget (the runs it finished are in its report)"
    return "done" if code == 0 else f"failed (exit {code}): see its results.md and logs/"


def chat_conversations(n=CHATS, seed=0):
    """Conversations in the tests' style (tests/tiny_hf.py) with uneven lengths, as chat data has: one to three
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


def write_finetune_inputs(root, shape=LLAMA_1B, device="cuda"):
    """root/llama (the tests' tokenizer and a Llama of `shape` with random weights, saved in bf16) and
    root/chats.jsonl (chat_conversations); returns their paths and the chats' token counts."""
    import json

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_hf import corpus, write_tokenizer  # the tests' byte-level BPE and chat template
    llama, chats = root / "llama", root / "chats.jsonl"
    tokenizer = write_tokenizer(llama, [p + r for p, r in corpus()])
    if not (llama / "model.safetensors").exists():
        config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **shape)
        torch.manual_seed(0)
        with torch.device(device):  # random weights drawn on the GPU: seconds, where the CPU takes minutes
            model = LlamaForCausalLM(config)
        model.to(torch.bfloat16).save_pretrained(llama)
        del model
        if device == "cuda":  # give the GPU back to the runs: this process stays up for the whole table
            import gc
            gc.collect()
            torch.cuda.empty_cache()
    conversations = chat_conversations()
    chats.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    lengths = sorted(len(tokenizer.apply_chat_template(c["messages"], return_dict=True)["input_ids"])
                     for c in conversations)
    return {"llama": llama, "chats": chats}, {
        "conversations": len(lengths), "median_tokens": statistics.median(lengths),
        "mean_tokens": statistics.fmean(lengths), "longest": lengths[-1],
        "over_1024": sum(n > 1024 for n in lengths) / len(lengths)}


def write_inputs(out, parts):
    """The inputs the selected parts need, in out/inputs/: {name: path}, and what they hold."""
    root = out / "inputs"
    root.mkdir(parents=True, exist_ok=True)
    inputs, facts = {}, {}
    needs = " ".join(arg for part in parts for arg in part.args)
    if "{images}" in needs:
        sys.path.insert(0, str(REPO / "tests"))
        from image_folder import write_image_folder  # the tests' striped-image classes
        inputs["images"] = root / "images"
        if not (inputs["images"] / "train").exists():
            write_image_folder(inputs["images"], train_per_class=1024, val_per_class=128, size=32)
    if "{llama}" in needs:
        paths, facts["chats"] = write_finetune_inputs(root)
        inputs.update(paths)
    return inputs, facts


def ratio(by, a, b, key="throughput"):
    """by[a][key] / by[b][key], a and b (part, run) keys of measured rows; "-" where either is missing."""
    ra, rb = by.get(a), by.get(b)
    if not ra or not rb or "failed" in ra or "failed" in rb or not ra.get(key) or not rb.get(key):
        return "-"
    return f"{ra[key] / rb[key]:.3f}"


def recipe_lines(by, reports):
    """The comparisons of the mnist, gpt, resnet and engine parts."""
    lines = []
    for folder in ("mnist", "gpt", "resnet"):
        if folder not in reports:
            continue
        lean = reports[folder]["ratios"].get("recipe_vs_lean", {})
        verdicts = [f"recipe / lean loop under {c}: {v['value']:.3f} (goal {v['goal']}, "
                    f"{'met' if v['met'] else 'NOT met' if v['goal_applies'] else 'not judged'})"
                    for c, v in lean.items()]
        lines.append(f"- {folder}: compile speed-up (1gpu_compile.yaml / 1gpu.yaml) "
                     f"{ratio(by, (folder, '1gpu_compile.yaml'), (folder, '1gpu.yaml'))}"
                     + "".join(f"; {v}" for v in verdicts))
    if ("zero2-overlap", "deepspeed_zero2.yaml+no-overlap") in by:
        lines.append("- ZeRO-2 overlap_comm on / off: " + ratio(by, ("zero2-overlap", "deepspeed_zero2.yaml"),
                                                                ("zero2-overlap", "deepspeed_zero2.yaml+no-overlap")))
    if ("fsdp-units", "fsdp.yaml+one-unit") in by:
        per_block, one = ("fsdp-units", "fsdp.yaml"), ("fsdp-units", "fsdp.yaml+one-unit")
        lines.append(f"- FSDP one unit per block / one unit: {ratio(by, per_block, one)} (peak memory per block / "
                     f"one unit: {ratio(by, per_block, one, 'peak_memory_mb')})")
    return lines


def finetune_lines(by):
    """The fine-tune comparisons, with the goals of issue "Fine-tune at H100 speed"."""
    if not any(part.startswith("finetune") for part, _ in by):
        return []
    eager, compiled = "1gpu.yaml", "1gpu_compile.yaml"
    full, lora, padded = "finetune-full", "finetune-lora", "finetune-padded"
    mfu = (by.get((full, compiled)) or {}).get("mfu")
    return [
        f"- fine-tune, LoRA / full (real tokens/s): eager {ratio(by, (lora, eager), (full, eager))}, compiled "
        f"{ratio(by, (lora, compiled), (full, compiled))} (goal >= 1.5 both)",
        f"- fine-tune, packed / padded (real tokens/s, full fine-tune, eager): "
        f"{ratio(by, (full, eager), (padded, eager))} (goal >= 2)",
        f"- fine-tune, compiled full fine-tune MFU: {'-' if mfu is None else f'{100 * mfu:.1f}%'} (goal >= 50%)",
        f"- fine-tune, compile speed-up (1gpu_compile.yaml / 1gpu.yaml): full "
        f"{ratio(by, (full, compiled), (full, eager))}, LoRA {ratio(by, (lora, compiled), (lora, eager))}"]


def table_rows(reports):
    """({(part, run): row}, the table's lines): one line per run of every part."""
    fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
    by, lines = {}, []
    for folder, report in reports.items():
        for row in report["table"]:
            by[(folder, row["name"])] = row
            if "failed" in row:
                lines.append(f"| {folder} | {row['name']} | FAILED: see {row['log']} | | | | | | |")
                continue
            unit = row["unit"].replace("_per_s", "/s")
            lines.append(f"| {folder} | {row['name']} | {row['processes']} | {row['throughput']:.0f} {unit} | "
                         f"{fmt(row.get('mfu') and 100 * row['mfu'], '{:.1f}%')} | {row['step_ms']:.1f} | "
                         f"{' / '.join(f'{m:.0f}' for m in row['peak_memory_mb_per_rank'])} | "
                         f"{fmt(row.get('padding_share') and 100 * row['padding_share'], '{:.0f}%')} | "
                         f"{fmt(row.get('fsdp_units'), '{}')} |")
    return by, lines


def markdown(reports, name, date, peak, progress):
    """README.md of the table: every run of every part, the comparisons, and where the time went.
    progress: {"statuses": {part: how it ended}, "timings": {phase or part: seconds}, "facts", "warm", "gpus"}."""
    hw = next(iter(reports.values()))["hardware"] if reports else {}
    by, rows = table_rows(reports)
    lines = [f"# GPU table: {name}", "",
             f"Measured {date} on {hw.get('label', name)} ({hw.get('host', '?')}); torch {hw.get('torch')}, "
             f"accelerate {hw.get('accelerate')}, DeepSpeed {hw.get('deepspeed')}. `python bench/benchmark.py "
             f"--gpu-table`: bf16, MFU against {peak:g} TFLOPS; each part's own report (results.md, logs) is in "
             "its folder. The fine-tune runs' tokens/s and MFU count real tokens (not padding); padding: the share "
             "of positions that are padding.", "",
             "| part | run | procs | throughput | MFU | step ms | peak MB per proc | padding | FSDP units |",
             "|---|---|---|---|---|---|---|---|---|", *rows,
             "", "Comparisons (throughput ratios of the runs above):", "",
             *recipe_lines(by, reports), *finetune_lines(by)]
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
    for part, status in progress["statuses"].items():
        if status != "done":
            lines.append(f"- {part}: {status}")
    return "\n".join(lines) + "\n"


def reports_in(table_dir, folders):
    import json
    return {folder: json.loads((table_dir / folder / "results.json").read_text())
            for folder in folders if (table_dir / folder / "results.json").exists()}


def gpu_table(args):
    """Inputs, warm-up, then the parts in turn within --budget-s; OUT/<date>-<gpu>/README.md after each part."""
    import torch
    started = time.monotonic()
    if not torch.cuda.is_available():
        print("error: --gpu-table measures GPUs and this machine has no CUDA device; run it where one is "
              "(README, 'On a GPU')", file=sys.stderr)
        return 2
    try:
        parts = selected(args.parts)
    except ValueError as exc:
        print(f"error: --parts: {exc}", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0)
    peak = args.peak_tflops or peak_tflops_for(name)
    if not peak:
        print(f"error: no dense bf16 peak known for {name!r}: pass --peak-tflops", file=sys.stderr)
        return 2
    date, gpus = time.strftime("%Y-%m-%d"), torch.cuda.device_count()
    out = Path(args.out).resolve() / f"{date}-{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-').lower()}"
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(REPO)  # the parts' relative paths (mnist's data/) are the repository's, wherever this was started
    progress = {"statuses": {}, "timings": {}, "facts": {}, "warm": {}, "gpus": gpus}
    inputs, progress["facts"] = write_inputs(out, parts)
    progress["timings"]["inputs"] = time.monotonic() - started
    commands = part_commands(out, peak, inputs, gpus, parts)
    if not args.no_warm:
        progress["warm"] = warm_phase(commands, parts, out, gpus, args.budget_s - (time.monotonic() - started))
        progress["timings"]["warm-up"] = time.monotonic() - started - progress["timings"]["inputs"]
    for folder, cmd in commands:
        print(f"gpu table: {folder}: {' '.join(cmd[1:])}", flush=True)
        begun = time.monotonic()
        status = progress["statuses"][folder] = run_part(cmd, args.budget_s - (begun - started))
        if not status.startswith("not run"):
            progress["timings"][folder] = time.monotonic() - begun
        print(f"gpu table: {folder}: {status} in {time.monotonic() - begun:.0f} s "
              f"({time.monotonic() - started:.0f} s since the table started)", flush=True)
        (out / "README.md").write_text(markdown(reports_in(out, [f for f, _ in commands]), name, date, peak, progress))
    print((out / "README.md").read_text())
    return 0 if all(status == "done" for status in progress["statuses"].values()) else 1


def warm_phase(commands, parts, out, gpus, seconds_left):
    """The compile warm-up (module docstring, 2): {run: how its warm-up ended}; the warm-up runs' output
    folders (exported models) are removed after it, their logs kept in out/warm/logs."""
    import shutil

    import torch
    threads = max(1, (os.cpu_count() or 2) // gpus)  # as bench/benchmark.py gives the measured runs
    cap_gb = WARM_MEMORY_SHARE * torch.cuda.get_device_properties(0).total_memory / 1e9
    warms = warm_plan(commands, parts, out, threads)
    print(f"gpu table: compile warm-up of {len(warms)} runs, several at once within {cap_gb:.0f} GB", flush=True)
    ended = warm_up(warms, cap_gb, min(WARM_LIMIT_S, seconds_left / 2), out / "warm" / "logs")
    for warm in warms:
        shutil.rmtree(warm.cmd[-1], ignore_errors=True)
    return ended
