"""The next-token loss computed in chunks through the output layer: the [tokens x vocabulary] logits never exist whole.

Owns finetune_lm.py's loss (token_losses): each sequence's summed loss over the positions whose target is not
IGNORE, and how many such positions it has. With --loss-chunks 1 it is the plain loss: the model's logits for every
position, cast to fp32 and given to cross_entropy. Chunked (install): the positions whose target is IGNORE are
dropped before the output layer, and the rest go through it in chunks of at most --loss-chunk-tokens positions
(default 8,192; the last chunk holds what is left), or with --loss-chunks N in N chunks; each chunk's logits cast
to fp32, given to cross_entropy and freed; in backward each chunk's logits are computed again
(torch.utils.checkpoint), so forward and backward hold one chunk's logits (and their gradient) at a time. The same
operations on the same rows as the plain loss: the losses and the gradients agree with it to float rounding
(tests/test_lm_loss.py).

How the output layer gets the targets: the model's forward calls its output layer (lm_head) with the last hidden
states, and nothing else. install() gives that one module a forward of its own, which takes the targets the loss
left on it just before the model's call (a job, consumed by that call) and returns, instead of logits, the loss of
each kept position. Every engine then runs the output layer as it runs it for the plain loss: inside the model's
forward, where ZeRO-3 gathers its weight and FSDP2 unshards it, behind DDP's and PEFT's wrappers; compiled models
keep the plain loss (install: one graph cannot hold a count that changes from batch to batch). Without a job
(generation, the greedy answer) the layer computes logits as before. A model whose forward changes the logits
after the output layer (Gemma's soft-capping, Cohere's logit scale) keeps the plain loss (plain_head).

Which positions are kept is decided without the host waiting for the GPU where the count is known on the host:
the DataLoader's collate (with_loss_count) counts each batch's loss positions while the batch is still on the CPU,
and torch.nonzero_static takes that many. Where it is not known (sequence parallelism's slices) nonzero() waits.
It makes no distributed call.
"""

import inspect
import re
import types

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import default_collate

from .packing import IGNORE  # the label of a position that is not in the loss (cross_entropy's ignore_index)

LOSS_COUNT = "loss_count"  # the batch key with_loss_count adds: the batch's loss positions, a Python int
# The CausalLM forwards whose logits are the output layer's, unchanged: the loss is then computed in it.
PLAIN_HEAD = re.compile(r"logits = self\.lm_head\(hidden_states[^\n]*\)\s*\n\s*(loss = None|if labels is not None)")


def next_token_targets(labels):
    """Each position's target: the next position's label; the last position has none (IGNORE)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


def with_loss_count(examples):
    """A DataLoader's collate_fn: torch's default, plus the batch's loss positions (LOSS_COUNT), counted on the
    CPU before the batch goes to the device."""
    batch = default_collate(examples)
    batch[LOSS_COUNT] = int((batch["labels"][:, 1:] != IGNORE).sum())
    return batch


def plain_head(model):
    """Whether the model's forward returns its output layer's logits unchanged (PLAIN_HEAD), so that the loss can be
    computed inside that layer. False for soft-capped or scaled logits, or a forward this cannot read."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return False
    return bool(PLAIN_HEAD.search(source)) and isinstance(getattr(base, "lm_head", None), torch.nn.Linear)


def install(model, chunks, compiled=False, chunk_tokens=None):
    """Give the model's output layer the chunked loss (see the module's docstring): chunks of at most chunk_tokens
    loss positions, or (chunk_tokens None) `chunks` chunks. Returns that layer, or None where the plain loss stays:
    chunks 1 without chunk_tokens, not plain_head, or compiled (the *_compile.yaml configs compile the model as one
    graph, fullgraph, and the kept positions' count, different in each batch, would break it). Call before
    prepare()."""
    if (chunks <= 1 and not chunk_tokens) or compiled or not plain_head(model):
        return None
    head = model.get_output_embeddings()
    head.loss_chunks, head.loss_chunk_tokens = chunks, chunk_tokens
    head.forward = types.MethodType(_head_forward, head)
    return head


def token_losses(model, inputs, targets, head=None, count=None):
    """(each sequence's summed fp32 loss over its positions whose target is not IGNORE, their number) for the model
    run on `inputs`. head: install()'s, or None for the plain loss. count: the number of such positions in the
    batch when the host knows it (with_loss_count), else found on the device."""
    kept = targets != IGNORE
    if head is None:
        logits = model(**inputs).logits
        losses = F.cross_entropy(logits.transpose(1, 2).float(), targets, ignore_index=IGNORE, reduction="none")
        return losses.sum(dim=1), kept.sum(dim=1)
    flat = kept.flatten()
    index = (flat.nonzero() if count is None else torch.nonzero_static(flat, size=count)).squeeze(1)
    head._loss_job = (index, targets.flatten().index_select(0, index))  # consumed by the model's call below
    try:
        per_position = model(**inputs).logits
    finally:
        head.__dict__.pop("_loss_job", None)
    sequence = torch.div(index, targets.shape[1], rounding_mode="floor")
    losses = torch.zeros(targets.shape[0], dtype=per_position.dtype, device=per_position.device)
    return losses.index_add(0, sequence, per_position), kept.sum(dim=1)


def _head_forward(head, hidden):
    """The output layer's forward once installed: logits without a job; with one, each kept position's loss."""
    job = head.__dict__.pop("_loss_job", None)
    if job is None:
        return F.linear(hidden, head.weight, head.bias)
    index, targets = job
    rows = hidden.flatten(0, 1).index_select(0, index)  # the positions in the loss, before the output layer
    if head.loss_chunk_tokens:  # at most that many rows each (split's sizes come from the shape: no host wait)
        pieces = zip(rows.split(head.loss_chunk_tokens), targets.split(head.loss_chunk_tokens))
    else:
        pieces = zip(rows.chunk(head.loss_chunks), targets.chunk(head.loss_chunks))
    parts = [checkpoint(_chunk_losses, h, t, head.weight, head.bias, use_reentrant=False) for h, t in pieces]
    return torch.cat(parts) if parts else rows.new_zeros(0, dtype=torch.float32)


def _chunk_losses(hidden, targets, weight, bias):
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits.float(), targets, reduction="none")
