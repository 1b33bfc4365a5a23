"""Blocks of --block-size tokens made from tokenised examples, and what the model needs to keep them apart.

Owns:
  * packing (pack_blocks): several examples in one block, placed longest first into the block with the least
    room that holds them (best-fit decreasing, per PACK_GROUP examples); each example's positions restart at 0,
    its first label is IGNORE (the token before it belongs to another example, so it must not predict it), and
    the rest of the block is padding, a segment of its own;
  * padding (pad_blocks): one example per block, padded to the block (--no-packing);
  * the blocks' facts for the first line, the summary and the throughput (block_facts): the share of positions
    that are padding, the examples per block, the real tokens per block (tokens/s and MFU count these) and the
    token-weighted example length (attention's FLOPs per token);
  * the attention the model runs (attention_implementation) and the mask a packed block needs (block_causal_mask).

Why the model is given its mask rather than building one: transformers' Llama-style models build their causal
mask from the positions. In an eager forward they first look for packed sequences in the positions
(masking_utils.find_packed_sequence_indices), whose `.all()` waits for the GPU in every step; under
torch.compile that check always answers "packed", so SDPA gets a materialised mask instead of is_causal even
where nothing is packed. GIVEN_MASK is PyTorch's SDPA through transformers' own function, registered under a
name that has no mask builder: the model then passes on exactly the mask it is given. None (padded examples,
plain text): SDPA's is_causal, the flash kernel on a GPU, compiled or not. A packed block: the (batch, 1, T, T)
boolean block-diagonal causal mask, built on the device from the positions (no host sync); SDPA runs its
memory-efficient kernel with it. At --block-size 1024 on a 1B Llama, attention is about 6% of a token's FLOPs,
so a kernel that skips the masked blocks (FlexAttention, flash-attention's varlen) could save a few percent of a
step; this one runs everywhere the recipe does (CPU, CUDA, torch.compile, DeepSpeed, FSDP2, PEFT) with no
package or compilation of its own.

It makes no distributed call.
"""

import bisect

IGNORE = -100  # label of a position that is not in the loss (cross_entropy's ignore_index)
GIVEN_MASK = "sdpa_given_mask"
PACK_GROUP = 10_000  # examples packed together (one `datasets` map batch): the blocks are as full as for all
BLOCK_COLUMNS = ("input_ids", "labels", "position_ids")  # what a batch holds (padded blocks: no position_ids)


def attention_implementation(config, block_size):
    """The attn_implementation to load the model with: GIVEN_MASK when every layer of the model attends causally
    over the whole block (no sliding window shorter than it, no chunked or linear attention) and the model has an
    SDPA path; otherwise None, transformers' default, which builds the model's own masks (a packed block's from
    its positions: right, with the host sync described above)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds - {"full_attention", "sliding_attention"} or not getattr(config, "is_causal", True):
        return None  # chunked or linear attention, or not a causal model
    if (window and window < block_size) or ("sliding_attention" in kinds and not window):
        return None  # a window that cuts into the block: the model's own sliding masks
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None or not getattr(model_class, "_supports_sdpa", False):
        return None
    AttentionInterface.register(GIVEN_MASK, sdpa_attention_forward)
    return GIVEN_MASK


def block_causal_mask(position_ids):
    """(batch, 1, T, T) booleans: position q attends to k when k <= q and both are in the same example (an example
    starts where its position is 0). Computed on the device from the positions: nothing waits for it."""
    example = (position_ids == 0).cumsum(-1)
    same = example[:, :, None] == example[:, None, :]
    causal = position_ids[:, None, :] <= position_ids[:, :, None]  # within an example, positions rise by 1 a token
    return (same & causal)[:, None]


def best_fit_decreasing(lengths, capacity):
    """Groups of indices into lengths, each summing to at most capacity: the longest first, each into the group
    with the least room left that holds it (within 11/9 of the fewest groups possible), a new group if none does."""
    groups, room, free = [], {}, []  # room: space left -> the groups with it; free: those spaces, sorted
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        at = bisect.bisect_left(free, lengths[i])
        if at < len(free):
            space = free[at]
            group = room[space].pop()
            if not room[space]:
                del room[space]
                free.pop(at)
        else:
            space, group = capacity, len(groups)
            groups.append([])
        groups[group].append(i)
        left = space - lengths[i]
        if left:
            if left not in room:
                bisect.insort(free, left)
                room[left] = []
            room[left].append(group)
    return groups


def pack_blocks(block_size, pad_id):
    """The batched `datasets` map from examples (input_ids, labels of at most block_size) to packed blocks: input_ids,
    labels, position_ids, and for the facts real (tokens that are not padding), examples and in_loss."""
    def pack(batch):
        lengths = [len(ids) for ids in batch["input_ids"]]
        blocks = {k: [] for k in (*BLOCK_COLUMNS, "real", "examples", "in_loss")}
        for group in best_fit_decreasing(lengths, block_size):
            ids, labels, positions = [], [], []
            for i in group:
                ids += batch["input_ids"][i]
                labels += [IGNORE] + batch["labels"][i][1:]  # the token before it is another example's
                positions += range(lengths[i])
            pad = block_size - len(ids)
            add(blocks, ids + [pad_id] * pad, labels + [IGNORE] * pad, len(ids), len(group))
            blocks["position_ids"].append(positions + list(range(pad)))  # the padding: a segment of its own
        return blocks
    return pack


def pad_blocks(block_size, pad_id):
    """The batched `datasets` map from examples to blocks of one example each, padded to block_size."""
    def pad(batch):
        blocks = {k: [] for k in ("input_ids", "labels", "real", "examples", "in_loss")}
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            n = block_size - len(ids)
            add(blocks, ids + [pad_id] * n, labels + [IGNORE] * n, len(ids), 1)
        return blocks
    return pad


def add(blocks, ids, labels, real, examples):
    blocks["input_ids"].append(ids)
    blocks["labels"].append(labels)
    blocks["real"].append(real)
    blocks["examples"].append(examples)
    blocks["in_loss"].append(sum(t != IGNORE for t in labels[1:]))


def into_blocks(examples, block_size, pad_id, packing):
    """The examples (a `datasets` split) as blocks, packed or padded (a map, cached like the tokenising)."""
    make = pack_blocks(block_size, pad_id) if packing else pad_blocks(block_size, pad_id)
    return examples.map(make, batched=True, batch_size=PACK_GROUP, remove_columns=examples.column_names,
                        desc="packing" if packing else "padding")


def block_facts(blocks, lengths, block_size):
    """What the first line, the summary and the throughput say about the training blocks: blocks, examples per
    block, padding share, real tokens per block, loss share (positions with a target that are in the loss) and
    the token-weighted example length (lengths: every training example's, before packing)."""
    real, examples = sum(blocks["real"]), sum(blocks["examples"])
    n = len(blocks)
    return {"train_blocks": n, "examples_per_block": examples / n, "padding_share": 1 - real / (n * block_size),
            "real_tokens_per_block": real / n, "loss_positions_share": sum(blocks["in_loss"]) / (n * (block_size - 1)),
            "attention_span": sum(x * x for x in lengths) / max(sum(lengths), 1)}


def blocks_note(facts, fmt, block_size):
    """The first line's words on the training blocks: how many, and for pairs and chat how full."""
    n, padding = facts["train_blocks"], f"padding {100 * facts['padding_share']:.0f}%"
    if fmt == "text":
        return f"{n} blocks of {block_size} tokens"
    if facts["packing"]:
        return (f"{facts['train_examples']} examples packed into {n} blocks of {block_size} tokens "
                f"({facts['examples_per_block']:.1f} per block, {padding})")
    return f"{facts['train_examples']} examples, each padded to a block of {block_size} tokens ({padding})"
