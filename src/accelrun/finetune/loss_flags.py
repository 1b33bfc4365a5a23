"""--loss-chunk-tokens and --loss-chunks, in the standard library only: finetune_lm.py's --help answers before torch
is imported. Owns the two forms of the chunked loss's size, their refusals (a bad value; both together) and which one a
run takes (loss_chunking: the token form, DEFAULT_CHUNK_TOKENS, unless --loss-chunks is given)."""

from ..flags import whole_number_type

# 8, as torchtune's default: the peak logits are an eighth of the whole (and their gradient), while each chunk's
# matmul keeps thousands of rows at long context; at 32k tokens and Llama's 128k vocabulary one chunk is 2.1 GB
# in fp32 where the whole was 16.8 GB (42 GB with bf16 logits and the gradient).
DEFAULT_CHUNKS = 8
# torchtitan's: chunks of at most 8,192 loss positions, whatever the batch. The count form makes each chunk as long as
# the batch is over N (Qwen3-14B on 8xH100: 38.4% MFU at 83.6 GiB with 8,192-token chunks, 32.3% at 90.8 GiB with 8).
DEFAULT_CHUNK_TOKENS = 8192


# argparse types: 0 and negative counts were taken silently.
chunk_count = whole_number_type(1, " of chunks", " (1: the plain loss)")
chunk_tokens = whole_number_type(1, " of loss positions per chunk")


def add_loss_args(parser):
    parser.add_argument("--loss-chunk-tokens", type=chunk_tokens, default=None,
                        help="the loss through the output layer in chunks of at most N loss positions, the positions "
                             "outside the loss dropped first: the [tokens x vocabulary] logits never exist whole, and "
                             f"a chunk's size does not grow with the batch (default {DEFAULT_CHUNK_TOKENS}, "
                             "torchtitan's, unless --loss-chunks is given)")
    parser.add_argument("--loss-chunks", type=chunk_count, default=None,
                        help="instead of --loss-chunk-tokens: the loss in N chunks of the batch's loss positions, "
                             "each as large as the batch over N (1: the plain loss, every position's logits at once)")


def loss_chunking_problem(args):
    """The refusal of both forms together (one line), or None."""
    if args.loss_chunks is not None and args.loss_chunk_tokens is not None:
        return (f"--loss-chunks {args.loss_chunks} and --loss-chunk-tokens {args.loss_chunk_tokens} both size the "
                f"loss's chunks: give one (--loss-chunks 1: the plain loss)")
    return None


def loss_chunking(args):
    """(chunks, chunk_tokens) for chunked_loss.install: (N, None) for --loss-chunks N, else (1, the token form's
    size, DEFAULT_CHUNK_TOKENS unless given)."""
    if args.loss_chunks is not None:
        return args.loss_chunks, None
    return 1, args.loss_chunk_tokens or DEFAULT_CHUNK_TOKENS
