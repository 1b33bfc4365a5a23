"""What finetune_lm.py and dpo.py build on beside the run services, one module per concern:

    examples.py      the data: records on disk or on the hub, read into the examples a causal model learns from
    records.py       reading the data files, and naming what is wrong with a record by its file and line
    packing.py       examples packed into blocks, each attending only to itself (or padded, one per block)
    attention.py     --attention: FlexAttention and a block mask for packed blocks on CUDA, or SDPA's dense mask
    pretrained.py    a pretrained Hugging Face model, loaded for a fine-tune under every engine
    weights.py       its weight files checked and fingerprinted without loading them
    lora.py          low-rank adapters through PEFT, on a frozen base, and their merge
    qlora.py         QLoRA: that base frozen in 4 bits (NF4, bitsandbytes), sharded, and dequantised for the merge
    chunked_loss.py  the next-token loss through the output layer in chunks: the logits never whole
    loss_flags.py    --loss-chunk-tokens, --loss-chunks (the standard library only: --help answers without torch)
    ulysses.py       Ulysses sequence parallelism: one sequence over several GPUs
    optim_states.py  --optim-states: AdamW's moments in fp32, bf16 or 8 bits (torchao), checked after the first step
    training.py      --block-size's check, AdamW and the warm-up then cosine schedule, as both recipes set them
    export.py        the exported model and adapter directories, with the merge
    preference.py    DPO: preference records, their sequences' log-probabilities, the reference and the loss
"""
