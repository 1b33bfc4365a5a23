"""Figures that cannot flatter (issue 42, item 4): finetune_lm's tokens/s and MFU, which the GPU table reports for
every fine-tune part, rest on the real tokens of a packed block and on each example's attention span.

Both are read back from what a run reports, through identities of accelrun's own arithmetic: a rate times the time
it was measured over gives the units counted per micro-batch; MFU times the peak over the rate gives the FLOPs
counted per unit. The run is the tiny model on uneven pairs, packed (the default), one process: the same cached
launch as test_finetune_lm's cpu.yaml run, so the full suite launches nothing more for these tests.
"""

import pytest

from launching import FINETUNE_BATCH, FINETUNE_BLOCK

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def packed(finetune):
    run = finetune("cpu.yaml")
    s = run.summary
    assert s["args"]["packing"] and s["world_size"] == 1 and s["args"]["grad_accum"] == 1, s["args"]
    return run


def test_tokens_per_second_count_the_real_tokens_of_a_block(packed):
    """tokens/s x the measured time = tokens counted per micro-batch = micro-batch x real tokens per block (padding
    is no work); counted as --block-size per block, the rate would claim padding as throughput."""
    s = packed.summary
    real = s["real_tokens_per_block"]
    assert s["padding_share"] > 0.02 and real == pytest.approx((1 - s["padding_share"]) * FINETUNE_BLOCK)
    assert real < 0.98 * FINETUNE_BLOCK, real  # enough padding for the two counts to differ
    timing = s["timing"]
    step_s = sum(timing[f"{phase}_ms"] for phase in ("data", "forward_backward", "optimizer", "other")) / 1000
    assert timing["tokens_per_s"] * step_s / FINETUNE_BATCH == pytest.approx(real, rel=1e-9), timing
    progress = [m for m in packed.metrics if "tokens_per_s" in m]
    assert len(progress) >= 2
    for m in progress:  # each progress line's rate over its own window
        window_s = (m["data_ms"] + m["compute_ms"]) / 1000
        assert m["tokens_per_s"] * window_s / FINETUNE_BATCH == pytest.approx(real, rel=1e-9), m


def test_mfu_counts_each_examples_attention_span(packed, hf):
    """MFU x peak / tokens/s = FLOPs per token = 6 per weight in a matmul + 12 L d T, with T the token-weighted
    length of the examples a packed token attends over (its own), not the block: the block would inflate MFU."""
    from transformers import AutoConfig, AutoModelForCausalLM
    s = packed.summary
    config = AutoConfig.from_pretrained(hf / "model")
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size

    def flops(span):
        return 6 * (n_params - embedding) + 12 * config.num_hidden_layers * config.hidden_size * span
    span, peak = s["attention_span"], float(s["args"]["peak_tflops"])
    assert 1 < span < 0.8 * FINETUNE_BLOCK, span  # packed examples shorter than the block
    assert flops(FINETUNE_BLOCK) > 1.01 * flops(span)  # the two counts differ beyond any rounding
    counted = s["mfu"] * peak * 1e12 * s["world_size"] / s["tokens_per_s"]
    assert counted == pytest.approx(flops(span), rel=1e-9), (counted, flops(span), flops(FINETUNE_BLOCK))
    for m in (m for m in packed.metrics if "mfu" in m):
        assert m["mfu"] * peak * 1e12 / m["tokens_per_s"] == pytest.approx(flops(span), rel=1e-9), m
