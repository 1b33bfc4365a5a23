"""accelrun.finetune.attention on a CPU, in this process (issue 55, items 1 and 2): the BlockMask of packed blocks
against packing.py's dense block-diagonal mask, the tiny Llama's forward through FlexAttention (no gradient: torch has
no flex backward on a CPU) against the SDPA path, a contamination test that sees one example attend to another, and
the refusals of --attention flex where it cannot train or cannot keep examples apart.

The flex path's training step (compiled, with its backward) runs on a GPU only: tests/test_gpu.py.
"""

import sys
import time

import pytest
import torch
import torch.nn.functional as F

from accelrun.finetune import attention
from accelrun.finetune.attention import FLEX, block_mask, choose, device_problem, model_problem
from accelrun.finetune.packing import GIVEN_MASK, attention_implementation, block_causal_mask, pack_blocks
from launching import REPO

sys.path.insert(0, str(REPO / "recipes"))

# FlexAttention's uncompiled CPU forward says, each time, that it is not the fused kernel: these tests want exactly it
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def positions(*segments):
    """A block's position_ids from its segments: a segment (start, length) runs start, start + 1, ..."""
    return [p for start, length in segments for p in range(start, start + length)]


# (name, rows of segments): one example filling the block (cut by it), several with the padding a segment of its own,
# one cut at the block's start (its positions do not begin at 0) and one cut at its end, and 1-token examples.
BLOCKS = {"one example, cut": [[(0, 64)]],
          "several, padded": [[(0, 20), (0, 17), (0, 14), (0, 13)]],
          "cut at both ends": [[(5, 30), (0, 21), (0, 13)]],
          "single tokens": [[(0, 1), (0, 1), (0, 30), (0, 1), (0, 31)]],
          "a batch of all": [[(0, 64)], [(0, 20), (0, 17), (0, 14), (0, 13)], [(5, 30), (0, 21), (0, 13)]]}


def token_mask(mask, length):
    """A BlockMask made dense token by token: (q, k) allowed where its tile is whole, or partial and mask_mod says
    so."""
    from torch.nn.attention.flex_attention import _ordered_to_dense
    tile = mask.BLOCK_SIZE[0]
    tiles = -(-length // tile)
    partial = _ordered_to_dense(mask.kv_num_blocks, mask.kv_indices, tiles).bool()
    whole = _ordered_to_dense(mask.full_kv_num_blocks, mask.full_kv_indices, tiles).bool()
    assert not (partial & whole).any()  # a tile is one or the other

    def tokens(tiled):
        return tiled.repeat_interleave(tile, -2).repeat_interleave(tile, -1)[..., :length, :length]
    batch = mask.kv_num_blocks.shape[0]
    q, k = torch.arange(length)[None, None, :, None], torch.arange(length)[None, None, None, :]
    by_mod = mask.mask_mod(torch.arange(batch)[:, None, None, None], torch.zeros(1, 1, 1, 1, dtype=torch.long), q, k)
    return tokens(whole) | (tokens(partial) & by_mod)


@pytest.mark.parametrize("tile", [8, 16, 128])
@pytest.mark.parametrize("name", BLOCKS)
def test_the_block_mask_made_dense_is_the_dense_mask(name, tile):
    """Every (q, k) of every block: the BlockMask allows exactly what packing.block_causal_mask allows, at tiles
    smaller than the block (whole tiles, partial tiles and skipped ones) and at FlexAttention's 128 (one partial
    tile); 50-token blocks end inside a tile."""
    for length in (64, 50):
        rows = torch.tensor([positions(*segments)[:length] for segments in BLOCKS[name]])
        mask = block_mask(rows, tile)
        assert torch.equal(token_mask(mask, length), block_causal_mask(rows)), (name, tile, length)


def test_the_block_mask_skips_the_tiles_where_examples_do_not_meet():
    """Tiles of 8 over four examples of 16: the 4 x 8 diagonal tiles' neighbours inside an example run without a
    mask, the tiles between two examples are skipped, only the diagonal is partial: what makes flex faster."""
    rows = torch.tensor([positions((0, 16), (0, 16), (0, 16), (0, 16))])
    mask = block_mask(rows, 8)
    assert mask.kv_num_blocks.tolist() == [[[1] * 8]]  # the diagonal tiles only
    assert mask.full_kv_num_blocks.tolist() == [[[0, 1] * 4]]  # the tile before, in the same example
    assert int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()) == 12 < 8 * 9 // 2  # of 36 causal tiles


def per_example_logits(model, rows, mask):
    with torch.no_grad():
        return model(input_ids=rows["input_ids"], position_ids=rows["position_ids"],
                     attention_mask=mask(rows["position_ids"])).logits


@pytest.fixture(scope="module")
def models(hf):
    """The tiny Llama loaded twice from the same weights: SDPA given the dense mask, and FLEX given the BlockMask."""
    from transformers import AutoModelForCausalLM
    config = AutoModelForCausalLM.from_pretrained(hf / "model").config
    assert attention_implementation(config, 64) == GIVEN_MASK and model_problem(config, 64) is None
    loaded = {}
    for name in (GIVEN_MASK, attention.register()):
        loaded[name] = AutoModelForCausalLM.from_pretrained(hf / "model", attn_implementation=name).eval()
        loaded[name].config.use_cache = False  # as the recipe trains
    return loaded


def packed(seed=0, lengths=((14, 20, 17), (30, 9, 11, 6))):
    """Two packed blocks of 64 tokens from random examples: ids, positions, and each example's (row, start, end)."""
    generator = torch.Generator().manual_seed(seed)
    pack = pack_blocks(block_size=64, pad_id=2)
    rows, spans = {"input_ids": [], "position_ids": []}, []
    for row, sizes in enumerate(lengths):
        examples = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in sizes]
        block = pack({"input_ids": examples, "labels": examples})
        assert len(block["input_ids"]) == 1
        for key in rows:
            rows[key].append(block[key][0])
        starts = [i for i, p in enumerate(block["position_ids"][0]) if p == 0]
        ends = starts[1:] + [64]
        spans += [(row, s, e) for s, e in zip(starts, ends)][:len(sizes)]  # the padding is no example
    return {k: torch.tensor(v) for k, v in rows.items()}, spans


def test_the_flex_forward_gives_the_dense_paths_logits(models, monkeypatch):
    """The same weights, the same packed blocks: FlexAttention with the BlockMask gives the logits of SDPA with the
    dense block-diagonal mask to 1e-5, and it is FlexAttention that ran (once per layer)."""
    calls = []
    real = attention.flex_attention_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    from transformers import AttentionInterface
    monkeypatch.setitem(AttentionInterface._global_mapping, FLEX, counted)
    rows, _ = packed()
    dense = per_example_logits(models[GIVEN_MASK], rows, block_causal_mask)
    flex = per_example_logits(models[FLEX], rows, block_mask)
    assert len(calls) == models[FLEX].config.num_hidden_layers
    assert (flex - dense).abs().max() < 1e-5, float((flex - dense).abs().max())


def contamination(models, rows, spans, mask):
    """The largest difference between an example's logits packed with others (FLEX, given `mask`) and its logits
    alone: the example by itself, positions from 0, plain causal attention (SDPA, no mask)."""
    together = per_example_logits(models[FLEX], rows, mask)
    worst = 0.0
    for row, start, end in spans:
        with torch.no_grad():
            own = models[GIVEN_MASK](input_ids=rows["input_ids"][row:row + 1, start:end]).logits[0]
        worst = max(worst, float((together[row, start:end] - own).abs().max()))
    return worst


def test_a_packed_example_attends_only_to_itself_under_flex(models):
    """Each example's logits packed with others are its logits alone (positions restarting at 0), to 1e-5. The test
    sees contamination: a BlockMask that keeps causality but lets examples see each other (no example ids) moves
    the same logits by far more."""
    rows, spans = packed(seed=1)
    assert len(spans) == 7
    assert contamination(models, rows, spans, block_mask) < 1e-5

    def causal_only(position_ids):  # the isolation removed: every example one, positions unchanged
        mask = block_mask(position_ids)
        first = torch.zeros_like(position_ids)
        mask.mask_mod = lambda b, h, q, k: (first[b, q] == first[b, k]) & (k <= q)
        return mask
    assert contamination(models, rows, spans, causal_only) > 1e-2


def args_of(*flags):
    from finetune_lm import parse_args
    return parse_args(["--model", "m", "--data-files", "d", "--block-size", "64", *flags])


def test_auto_takes_flex_for_packed_blocks_on_cuda_only(hf):
    """auto: flex for packed blocks on CUDA; sdpa on a CPU (today's path, exactly), for padded blocks and text,
    under sequence parallelism, and for a model flex cannot keep apart (a sliding window shorter than the block)."""
    from transformers import AutoConfig, MistralConfig
    llama = AutoConfig.from_pretrained(hf / "model")
    auto, flex, sdpa = args_of(), args_of("--attention", "flex"), args_of("--attention", "sdpa")
    assert auto.attention == "auto"
    assert choose(auto, llama, "cuda", True, False) == ("flex", None)
    for device, packed_blocks, sp in (("cpu", True, False), ("cuda", False, False), ("cuda", True, True)):
        assert choose(auto, llama, device, packed_blocks, sp) == ("sdpa", None)
    assert choose(sdpa, llama, "cuda", True, False) == ("sdpa", None)
    assert choose(flex, llama, "cuda", True, False) == ("flex", None)
    windowed = MistralConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, sliding_window=16)
    assert choose(auto, windowed, "cuda", True, False) == ("sdpa", None)


def test_flex_is_refused_in_one_line_where_it_cannot_train_or_keep_examples_apart(hf, capsys):
    from transformers import AutoConfig, LlamaConfig, MistralConfig
    llama = AutoConfig.from_pretrained(hf / "model")
    flex = args_of("--attention", "flex")
    assert device_problem(flex, "cpu").startswith("--attention flex needs a CUDA GPU: torch has no FlexAttention "
                                                  "backward on cpu")
    assert device_problem(args_of(), "cpu") is None and device_problem(flex, "cuda") is None
    assert choose(flex, llama, "cuda", False, False)[1].startswith("--attention flex keeps packed examples apart, "
                                                                   "and plain text packs none")
    assert choose(flex, llama, "cuda", True, True)[1].startswith("--attention flex cannot run under sequence "
                                                                 "parallelism")
    windowed = MistralConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, sliding_window=16)
    assert choose(flex, windowed, "cuda", True, False) == (None, (
        "--attention flex cannot keep packed examples apart: Mistral's attention builds its own masks (a sliding "
        "window or chunks shorter than the block); give --attention sdpa or auto"))
    dropping = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, attention_dropout=0.1)
    assert "soft-caps its scores or drops some out" in choose(flex, dropping, "cuda", True, False)[1]
    assert choose(args_of(), dropping, "cuda", True, False) == ("sdpa", None)  # auto: the dense mask, dropout and all
    with pytest.raises(SystemExit) as refused:
        args_of("--attention", "flex", "--no-packing")
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1 and "--attention flex keeps packed examples apart, and " \
        "--no-packing packs none" in lines[0], lines


def test_flex_on_a_cpu_is_refused_in_one_line_before_the_model_loads(hf, tmp_path, monkeypatch):
    """Issue 55's done-when: `--attention flex` on a CPU ends in one line, exit 2, in under 10 s, nothing loaded."""
    from transformers import AutoModelForCausalLM

    from in_process import run_main
    loads = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(a))
    started = time.monotonic()
    code, output = run_main("finetune_lm", ["--model", hf / "model", "--data-files", hf / "uneven.jsonl",
                                            "--attention", "flex", "--output-dir", tmp_path / "out"], timeout=60)
    lines = [line for line in output.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, output
    assert "error: --attention flex needs a CUDA GPU: torch has no FlexAttention backward on cpu" in lines[0], output
    assert time.monotonic() - started < 10 and not loads
    assert not (tmp_path / "out").exists()


def test_the_loss_is_unchanged_by_where_the_examples_sit(models):
    """What the recipe trains on: the next-token losses of each packed example under flex are those of SDPA's dense
    mask (the padding and each example's first target aside), so packed flex and packed sdpa train alike."""
    rows, spans = packed(seed=2)
    losses = {}
    for name, mask in ((GIVEN_MASK, block_causal_mask), (FLEX, block_mask)):
        logits = per_example_logits(models[name], rows, mask)
        losses[name] = F.cross_entropy(logits[:, :-1].transpose(1, 2), rows["input_ids"][:, 1:], reduction="none")
    assert torch.allclose(losses[FLEX], losses[GIVEN_MASK], atol=1e-5, rtol=0)
