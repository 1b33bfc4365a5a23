"""bench/lm_memory.py's long-context planner (in this process, a second): its figures against the issue's and
docs/recipes.md's table against what it prints."""

import sys

import pytest

from launching import REPO

sys.path.insert(0, str(REPO / "bench"))
import lm_memory  # noqa: E402


def test_the_parts_of_an_8b_full_fine_tune_at_32k_tokens():
    """The issue's figures: 8B model states 64.2 GB per GPU under FSDP2 on 2 GPUs, logits 42.0 GB at 32k tokens
    (10 bytes x 128k vocabulary per token) without chunks; 8 chunks hold an eighth; two GPUs on one sequence halve
    every activation."""
    whole = lm_memory.job_parts("Llama-3.1-8B", "full", 32768, chunks=1)
    assert whole["model states"] == pytest.approx(64.2, abs=0.05) and whole["logits"] == pytest.approx(42.0, abs=0.05)
    chunked = lm_memory.job_parts("Llama-3.1-8B", "full", 32768)
    assert chunked["logits"] == pytest.approx(whole["logits"] / 8)
    split = lm_memory.job_parts("Llama-3.1-8B", "full", 32768, sp=2)
    assert split["activations"] == pytest.approx(chunked["activations"] / 2)
    assert split["model states"] == chunked["model states"]
    qlora = lm_memory.job_parts("Llama-3.1-70B", "QLoRA", 2048)
    assert 15 < qlora["model states"] < 25  # 70B at 4 bits is about 35 GB, over two GPUs


def test_the_docs_table_is_the_planners():
    assert lm_memory.jobs_table() in (REPO / "docs" / "recipes.md").read_text()
