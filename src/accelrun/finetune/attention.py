"""--attention {auto,sdpa,flex}: which kernel keeps finetune_lm.py's packed examples apart, and the flex path itself.

Owns:
  * the flag (add_attention_args) and its refusals from the flags alone (flag_problem), in the standard library:
    finetune_lm.py's --help answers before torch is imported;
  * the choice (choose): `sdpa` is packing.py's path, SDPA given the dense (batch, 1, T, T) block-diagonal mask (or
    none and is_causal where nothing is packed); `flex` is FlexAttention given a BlockMask; `auto` takes flex for
    packed blocks on CUDA and sdpa everywhere else (on a CPU the run is exactly the sdpa one). Refused in one line
    each: flex on a CPU (torch has no FlexAttention backward there), flex where nothing is packed (padded blocks,
    plain text: flex pays only where the mask is sparse), flex under sequence parallelism (Ulysses wraps SDPA and
    drops the mask), and flex for a model whose attention would not keep the examples apart through it (its own
    sliding or chunked masks, soft-capped scores, attention dropout, or no flex path in transformers);
  * the BlockMask of a batch of packed blocks (block_mask), from its positions on the device: which 128 x 128 tiles
    of the (T, T) scores hold any allowed pair, which hold only allowed ones (those run without the mask at all), and
    the mask itself for the partial ones (the same rule as packing.block_causal_mask: same example, k <= q). Nothing
    waits for the GPU: comparisons, a cumulative sum and a sort, no .item() or nonzero();
  * the attention function the model calls (FLEX, registered in transformers' AttentionInterface under a name with
    no mask builder, as packing.GIVEN_MASK is: the model passes the BlockMask it is given straight on), running
    torch's flex_attention compiled on CUDA (uncompiled, it materialises the scores and is slower than SDPA).

Why: an SDPA call with an arbitrary mask cannot use the flash kernel, and the mask grows with the square of the block
(128 MiB of booleans per sequence at 8,192 tokens); the BlockMask is (T/128)^2 small integers, and the kernel skips
the tiles where two examples meet. torchtune measured compiled flex 2.4x compiled SDPA on packed Llama-3 8B at 8,192
tokens; on padded, unpacked batches flex runs at 65% of SDPA (fairseq2), hence packed blocks only.
It makes no distributed call.
"""

CHOICES = ("auto", "sdpa", "flex")
FLEX = "accelrun_flex_blocks"  # the name the model is loaded with: no mask builder of transformers' own
TILE = 128  # FlexAttention's default block: the BlockMask says which TILE x TILE tiles of the scores run


def add_attention_args(parser):
    parser.add_argument("--attention", choices=CHOICES, default="auto",
                        help="the kernel that keeps packed examples apart: flex (FlexAttention and a block mask: "
                             "compiled, it skips the tiles where two examples meet; CUDA only, packed blocks only), "
                             "sdpa (SDPA given the dense block-diagonal mask, everywhere); auto: flex for packed "
                             "blocks on CUDA, sdpa elsewhere")


def flag_problem(args):
    """The refusal decided from the flags alone, or None."""
    if args.attention == "flex" and not args.packing:
        return ("--attention flex keeps packed examples apart, and --no-packing packs none (on padded blocks flex is "
                "slower than SDPA's causal kernel): give --attention sdpa or auto, or drop --no-packing")
    return None


def device_problem(args, device_type):
    """--attention flex on a machine without CUDA: refused before the model loads, in one line."""
    if args.attention == "flex" and device_type != "cuda":
        return (f"--attention flex needs a CUDA GPU: torch has no FlexAttention backward on {device_type} (so it "
                f"cannot train there); give --attention sdpa or auto (the dense block mask, exact on any device)")
    return None


def model_problem(config, block_size):
    """Why FLEX cannot keep packed examples apart in this model (one line), or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from .packing import GIVEN_MASK, attention_implementation
    name = type(config).__name__.removesuffix("Config")
    if attention_implementation(config, block_size) != GIVEN_MASK:  # its own sliding, chunked or linear masks
        return f"{name}'s attention builds its own masks (a sliding window or chunks shorter than the block)"
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if not getattr(model_class, "_supports_flex_attn", False):
        return f"{name} has no FlexAttention path in transformers"
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "attention_dropout", 0.0):
        return f"{name}'s attention soft-caps its scores or drops some out, which the block mask does not carry"
    return None


def choose(args, config, device_type, packed, sequence_parallel):
    """("flex" or "sdpa", None) or (None, the one line that refuses the run). packed: the blocks hold several
    examples each (pairs and chat with --packing, not text)."""
    if args.attention == "sdpa" or (args.attention == "auto" and (device_type != "cuda" or not packed)):
        return "sdpa", None
    if args.attention == "flex" and not packed:
        return None, ("--attention flex keeps packed examples apart, and plain text packs none (one stream, causal "
                      "attention): give --attention sdpa or auto")
    if sequence_parallel:
        if args.attention == "auto":
            return "sdpa", None  # Ulysses refuses packed blocks itself (ulysses.packing_problem)
        return None, ("--attention flex cannot run under sequence parallelism: Ulysses wraps SDPA and drops the "
                      "mask; give --attention sdpa with --no-packing")
    problem = model_problem(config, args.block_size)
    if problem is None:
        return "flex", None
    if args.attention == "auto":
        return "sdpa", None
    return None, f"--attention flex cannot keep packed examples apart: {problem}; give --attention sdpa or auto"


def register():
    """Register FLEX in transformers' AttentionInterface; returns the name to load the model with."""
    from transformers import AttentionInterface
    AttentionInterface.register(FLEX, flex_attention_forward)
    return FLEX


def block_mask(position_ids, tile=TILE):
    """The BlockMask of packed blocks (batch, T): q attends to k when both are in the same example (an example
    starts where its position is 0) and k's position is not after q's, packing.block_causal_mask's rule. Built on
    the device from the positions alone: nothing waits for it."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask
    batch, length = position_ids.shape
    example = (position_ids == 0).cumsum(-1)  # non-decreasing along each block
    tiles = -(-length // tile)
    starts = torch.arange(tiles, device=position_ids.device) * tile
    first = example[:, starts]  # each tile's first and last example
    last = example[:, (starts + tile - 1).clamp(max=length - 1)]
    kv_tile = torch.arange(tiles, device=position_ids.device)
    q_tile = kv_tile[:, None]
    below = kv_tile[None, :] < q_tile  # strictly below the diagonal: every k there is before every q
    # A tile of keys meets a tile of queries at or below the diagonal when an example runs from one into the other
    # (examples only rise along a block, so the keys' last example reaching the queries' first is enough).
    meets = (kv_tile[None, :] <= q_tile) & (last[:, None, :] >= first[:, :, None])
    whole = below & (first[:, None, :] == last[:, :, None])  # one example fills both tiles: no mask needed
    partial = meets & ~whole

    def same_example(b, h, q, k):
        return (example[b, q] == example[b, k]) & (position_ids[b, k] <= position_ids[b, q])
    kv_blocks, kv_index = ordered(partial[:, None])
    full_blocks, full_index = ordered(whole[:, None])
    return BlockMask.from_kv_blocks(kv_blocks, kv_index, full_blocks, full_index, BLOCK_SIZE=tile,
                                    mask_mod=same_example, seq_lengths=(length, length))


def ordered(dense):
    """(count, indices) of a (..., rows, cols) boolean tile map, as BlockMask wants them: each row's tiles first, in
    order (a stable sort, on the device)."""
    import torch
    as_int = dense.to(torch.int32)
    return (as_int.sum(-1).to(torch.int32),
            torch.argsort(as_int, dim=-1, descending=True, stable=True).to(torch.int32).contiguous())


_compiled = {}


def flex_kernel(device_type):
    """torch's flex_attention, compiled once per process on CUDA (the fused kernel); uncompiled elsewhere (a CPU
    runs it only without gradients: the tests' forward)."""
    from torch.nn.attention.flex_attention import flex_attention
    if device_type != "cuda":
        return flex_attention
    if "flex" not in _compiled:
        import torch
        _compiled["flex"] = torch.compile(flex_attention, dynamic=False)
    return _compiled["flex"]


def flex_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: query (batch, heads, T, d), key and value (batch, kv heads, T,
    d), attention_mask the BlockMask the recipe gave the model; returns (batch, T, heads, d) and no weights."""
    from torch.nn.attention.flex_attention import BlockMask
    if not isinstance(attention_mask, BlockMask):
        raise TypeError(f"{FLEX} needs the BlockMask of packed blocks (finetune/attention.py), got "
                        f"{type(attention_mask).__name__}")
    out = flex_kernel(query.device.type)(query, key, value, block_mask=attention_mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None
