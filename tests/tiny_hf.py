"""A tiny Hugging Face causal LM and its data, written in their real on-disk formats, for
recipes/finetune_lm.py on machines that cannot download a model.

    python tests/tiny_hf.py DIR     # DIR/model (Llama, save_pretrained + tokenizer), DIR/pairs.jsonl, DIR/text.txt

The model is a Llama of 2 layers and width 32 with random weights, saved with save_pretrained
(config.json, model.safetensors). Its tokenizer is a byte-level BPE trained here on the text,
saved as tokenizer.json with a Llama-like <s> ... </s> template. pairs.jsonl holds
prompt/response records (arithmetic questions and their answers); text.txt plain text.
"""

import json
import random
import sys
from pathlib import Path


def corpus(n=600, seed=0):
    """(prompt, response) pairs a small model can learn: 'What is 3 plus 4?' -> 'It is 7.'"""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        op, value = rng.choice((("plus", a + b), ("times", a * b)))
        pairs.append((f"Question: what is {a} {op} {b}?\nAnswer:", f" It is {value}."))
    return pairs


def write_tokenizer(directory, texts, with_pad=True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>"] + (["<pad>"] if with_pad else [])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    bos = ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[bos])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>" if with_pad else None)
    fast.save_pretrained(directory)
    return fast


def write_model(directory, tokenizer, layers=2, width=32, context=128, seed=0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=context, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(directory)


def write_all(root, with_pad=True):
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    pairs = corpus()
    with open(root / "pairs.jsonl", "w") as f:
        for prompt, response in pairs:
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    (root / "text.txt").write_text("\n".join(p + r for p, r in pairs) + "\n")
    tokenizer = write_tokenizer(root / "model", [p + r for p, r in pairs], with_pad)
    write_model(root / "model", tokenizer)
    return root


if __name__ == "__main__":
    print(write_all(sys.argv[1] if len(sys.argv) > 1 else "tiny_hf"))
