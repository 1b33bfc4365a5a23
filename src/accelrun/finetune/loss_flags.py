"""--loss-chunks, in the standard library only: finetune_lm.py's --help answers before torch is imported."""

import argparse

# 8, as torchtune's default: the peak logits are an eighth of the whole (and their gradient), while each chunk's
# matmul keeps thousands of rows at long context; at 32k tokens and Llama's 128k vocabulary one chunk is 2.1 GB
# in fp32 where the whole was 16.8 GB (42 GB with bf16 logits and the gradient).
DEFAULT_CHUNKS = 8


def chunk_count(text):
    """argparse type: a whole number of chunks, 1 or more (0 and negative counts were taken silently)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of chunks, 1 or more (1: the plain loss)")
    return value


def add_loss_args(parser):
    parser.add_argument("--loss-chunks", type=chunk_count, default=DEFAULT_CHUNKS,
                        help="the loss through the output layer in N chunks, the positions outside the loss dropped "
                             "first: the [tokens x vocabulary] logits never exist whole (1: the plain loss, every "
                             "position's logits at once)")
