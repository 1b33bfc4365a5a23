"""bench/lm_memory.py's long-context planner (in this process, a second): its figures against the issue's and
docs/recipes.md's table against what it prints."""

import sys

import pytest

from launching import REPO

sys.path.insert(0, str(REPO / "bench"))
import lm_memory  # noqa: E402

sys.path.insert(0, str(REPO / "recipes"))


def test_the_parts_of_an_8b_full_fine_tune_at_32k_tokens():
    """The issue's figures: 8B model states 64.2 GB per GPU under FSDP2 on 2 GPUs, logits 42.0 GB at 32k tokens
    (10 bytes x 128k vocabulary per token) without chunks; 8 chunks hold an eighth; the default token form
    (--loss-chunk-tokens 8192, issue 55) one chunk of 8,192 positions; two GPUs on one sequence halve every
    activation."""
    whole = lm_memory.job_parts("Llama-3.1-8B", "full", 32768, chunks=1)
    assert whole["model states"] == pytest.approx(64.2, abs=0.05) and whole["logits"] == pytest.approx(42.0, abs=0.05)
    chunked = lm_memory.job_parts("Llama-3.1-8B", "full", 32768, chunks=8)
    assert chunked["logits"] == pytest.approx(whole["logits"] / 8)
    assert lm_memory.job_parts("Llama-3.1-8B", "full", 32768)["logits"] == pytest.approx(whole["logits"] / 4)
    assert lm_memory.job_parts("Llama-3.1-8B", "full", 4096)["logits"] == pytest.approx(whole["logits"] / 8)
    split = lm_memory.job_parts("Llama-3.1-8B", "full", 32768, sp=2)
    assert split["activations"] == pytest.approx(chunked["activations"] / 2)
    assert split["model states"] == chunked["model states"]
    qlora = lm_memory.job_parts("Llama-3.1-70B", "QLoRA", 2048)
    assert 15 < qlora["model states"] < 25  # 70B at 4 bits is about 35 GB, over two GPUs


def test_the_docs_table_is_the_planners():
    assert lm_memory.jobs_table() in (REPO / "docs" / "recipes.md").read_text()


def test_each_cell_copied_as_printed_runs_what_was_planned():
    """Issue 53, item 13: a cell read `fsdp.yaml --block-size 2048 --batch-size 2` while the plan assumed
    --gradient-checkpointing, --lora-r 16 and --load-in-4bit: copied as printed, the 8B full cell ran without
    gradient checkpointing. Each cell that fits, completed as the line above the table says, parses (finetune_lm.py's
    own parser) into the run the planner planned: its config, block, batch, checkpointing, LoRA rank, 4-bit base and
    loss chunks."""
    import re
    import shlex

    from finetune_lm import parse_args

    table = lm_memory.jobs_table()
    command = re.search(r"completes `([^`]+)`", table).group(1)
    assert command == ("accelerate launch --config_file accelerate_configs/CONFIG recipes/finetune_lm.py --model MODEL "
                       "--data-files DATA")
    cells = 0
    for size, model in lm_memory.JOB_MODELS.items():
        assert f"{size} `{model}`" in table.split("\n")[0]
        for job in lm_memory.JOBS:
            row = next(line for line in table.splitlines() if line.startswith(f"| {size} {job} |"))
            for length, cell in zip(lm_memory.LENGTHS, row.strip("| ").split(" | ")[1:]):
                key, parts, chunk_tokens = lm_memory.job_plan(size, job, length)
                if key is None:
                    assert cell.startswith("**no**"), cell
                    continue
                config, *flags = shlex.split(re.search(r"`([^`]+)`", cell).group(1))
                assert f"accelerate_configs/{config}" == lm_memory.SHARDED[key]
                assert (REPO / lm_memory.SHARDED[key]).is_file()
                assert (config == "fsdp_fp8.yaml") == (job in lm_memory.FP8_JOBS), cell  # FP8: its config, only
                args = parse_args(["--model", model, "--data-files", "DATA", *flags])
                assert args.block_size == length and args.gradient_checkpointing, cell
                base = lm_memory.base_job(job)
                assert args.lora_r == (0 if base in lm_memory.OPTIM_STATES else lm_memory.LORA_R), cell
                assert args.optim_states == lm_memory.OPTIM_STATES.get(base, "fp32"), cell
                assert args.load_in_4bit == (job == "QLoRA"), cell
                assert args.loss_chunks is None, cell  # the token form: the default, or the smaller chunks planned
                assert args.loss_chunk_tokens == (None if chunk_tokens == lm_memory.DEFAULT_CHUNK_TOKENS
                                                  else chunk_tokens), cell
                assert args.packing == (key != "sp2"), cell
                cells += 1
    # 8B 20 (FP8 at 32k: no, it has no sequence parallelism), 14B 8 (8-bit states at 2k, in bf16 and FP8), 32B 6,
    # 70B 4
    assert cells == 38


def test_fp8_gathers_the_layers_float8_py_converts_in_one_byte_and_changes_nothing_else():
    """Issue 50, item 4: an FP8 job is its bf16 job but for the two layers FSDP2 gathers, whose float8 linears take 1
    byte per parameter instead of 2. float8.py decides which: at 14B (hidden 5120) every decoder linear, so the
    gathered part is half; at 8B (hidden 4096, k and v 4096 -> 1024: too small to gain) k and v stay bf16."""
    from accelrun import float8
    for size, base in (("14B", "full"), ("8B", "full 8-bit states")):
        job = next(j for j, b in lm_memory.FP8_JOBS.items() if b == base)
        bf16, fp8 = (lm_memory.job_parts(lm_memory.JOB_MODELS[size], j, 8192) for j in (base, job))
        assert {k: v for k, v in fp8.items() if k != "gathered layers"} == \
            {k: v for k, v in bf16.items() if k != "gathered layers"}
        if size == "14B":
            assert fp8["gathered layers"] == pytest.approx(bf16["gathered layers"] / 2)
    _, shape = lm_memory.parameters("Llama-3.1-8B")
    kv = 4096 // 32 * 8
    assert kv <= float8.SMALL_OUTPUT and 4096 <= float8.SMALL_INPUT  # float8.py's own rule keeps them in bf16
    assert [lm_memory.in_float8(*w) for w in lm_memory.decoder_linears(shape)] == [True, False, False, True, True,
                                                                                     True, True]
    # bf16 gathered minus FP8's: the five float8 linears' one byte saved, twice (the computing and the prefetched)
    saved = 2 * sum(a * b for (a, b), f8 in zip(lm_memory.decoder_linears(shape), [1, 0, 0, 1, 1, 1, 1]) if f8)
    assert bf16["gathered layers"] - fp8["gathered layers"] == pytest.approx(saved / 1e9)
    assert not lm_memory.in_float8(4096, 1000) and lm_memory.in_float8(5120, 1024)  # not a multiple of 16; wide K


def test_dpo_rows_hold_what_each_reference_costs():
    """Issue 56: DPO's rows. A pair's two sequences are on one GPU (a fine-tune's parts at twice the tokens); LoRA,
    QLoRA and a precomputed reference hold no reference; a full fine-tune's frozen reference holds a bf16 copy sharded
    like the policy (2 bytes per parameter over the GPUs: 8.0 GB per GPU for the 8B on 2)."""
    for job, base in (("LoRA", "LoRA"), ("QLoRA", "QLoRA"), ("full, precomputed reference", "full")):
        parts = lm_memory.dpo_parts("Llama-3.1-8B", job, 2048)
        assert parts.pop("reference") == 0
        assert parts == lm_memory.job_parts("Llama-3.1-8B", base, 4096)
    frozen = lm_memory.dpo_parts("Llama-3.1-8B", "full, frozen reference", 2048)
    n, _ = lm_memory.parameters("Llama-3.1-8B")
    assert frozen["reference"] == pytest.approx(2 * n / 2 / 1e9) == pytest.approx(8.03, abs=0.01)
    assert sum(frozen.values()) > 80 > sum(lm_memory.dpo_parts("Llama-3.1-8B", "full, precomputed reference",
                                                                2048).values())


def test_the_dpo_table_is_in_the_docs_and_its_cells_parse_as_planned():
    """docs/recipes.md prints `python bench/lm_memory.py --dpo`; each row's flags with a cell's --block-size parse
    (recipes/dpo.py's own parser) into the job planned: LoRA rank, 4-bit base, precomputed reference, checkpointing."""
    import re
    import shlex

    from dpo import parse_args

    table = lm_memory.dpo_table()
    assert table in (REPO / "docs" / "recipes.md").read_text()
    command = shlex.split(re.search(r"completes `([^`]+)`", table).group(1))
    assert command[:6] == ["accelerate", "launch", "--config_file", "accelerate_configs/fsdp.yaml", "recipes/dpo.py",
                           "--model"]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| DPO job")]
    assert {row.split(" | ")[0].split(" ", 2)[2] for row in rows} == set(lm_memory.DPO_JOBS)
    for row in rows:
        flags, *cells = (cell.strip() for cell in row.strip("| ").split(" | ")[1:])
        job = next(j for j in lm_memory.DPO_JOBS if row.startswith(f"| {row.split()[1]} {j} |"))
        for cell in cells:
            if cell.startswith("**no**"):
                continue
            args = parse_args(["--model", "MODEL", "--data-files", "PAIRS", "--batch-size", "2",
                               *shlex.split(flags.strip("`")), *shlex.split(re.search(r"`([^`]+)`", cell).group(1))])
            assert args.gradient_checkpointing and args.lora_r == (0 if job.startswith("full") else lm_memory.LORA_R)
            assert args.load_in_4bit == (job == "QLoRA") and args.precompute_ref == ("precomputed" in job)
