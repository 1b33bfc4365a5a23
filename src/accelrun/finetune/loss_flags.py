"""--loss-chunks, in the standard library only: finetune_lm.py's --help answers before torch is imported."""

# 8, as torchtune's default: the peak logits are an eighth of the whole (and their gradient), while each chunk's
# matmul keeps thousands of rows at long context; at 32k tokens and Llama's 128k vocabulary one chunk is 2.1 GB
# in fp32 where the whole was 16.8 GB (42 GB with bf16 logits and the gradient).
DEFAULT_CHUNKS = 8


def add_loss_args(parser):
    parser.add_argument("--loss-chunks", type=int, default=DEFAULT_CHUNKS,
                        help="the loss through the output layer in N chunks, the positions outside the loss dropped "
                             "first: the [tokens x vocabulary] logits never exist whole (1: the plain loss, every "
                             "position's logits at once)")
