"""A tiny Hugging Face causal LM and its data, written in their real on-disk formats, for
recipes/finetune_lm.py on machines that cannot download a model.

    python -m accelrun.data.tiny_hf DIR     # DIR/model (Llama, save_pretrained + tokenizer), DIR/*.jsonl, DIR/text.txt
    python -m accelrun.data.tiny_hf --help  # what it writes; DIR defaults to ./tiny_hf

It is a data generator, not a recipe: it makes no distributed calls. transformers and tokenizers (accelrun's
[finetune] extra, requirements.txt) are imported only when a model is written: --help needs neither.

The model is a Llama of 2 layers and width 32 with random weights, saved with save_pretrained
(config.json, model.safetensors). Its tokenizer is a byte-level BPE trained here on the text,
saved as tokenizer.json with a Llama-like <s> ... </s> template, and a chat template whose
assistant turns are marked with {% generation %} (chat_template.jinja). pairs.jsonl holds
prompt/response records (arithmetic questions and their answers); text.txt plain text; chat.jsonl
conversations of the same questions (a `messages` column); uneven.jsonl pairs whose responses run
from 1 to 30 words. with_chat_template() copies the model with another chat template, or none.
"""

import argparse
import itertools
import json
import random
import shutil
from pathlib import Path

# Role headers, then each assistant turn's content and its end-of-turn token (</s>) inside the generation
# markers: what the assistant says is exactly what a fine-tune learns.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ '<|assistant|>\\n' }}"
    "{% generation %}{{ m['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
# The same rendering without the markers, as most published templates are.
PLAIN_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


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
    fast.chat_template = CHAT_TEMPLATE  # save_pretrained writes it to chat_template.jinja
    fast.save_pretrained(directory)
    return fast


def write_model(directory, tokenizer, layers=2, width=32, context=128, seed=0, intermediate=None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=intermediate or 2 * width,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=context, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(directory)


def with_chat_template(model_dir, copy_dir, template):
    """A copy of the model directory whose tokenizer has `template` as its chat template (None: none)."""
    copy_dir = Path(copy_dir)
    shutil.copytree(model_dir, copy_dir)
    (copy_dir / "chat_template.jinja").unlink(missing_ok=True)
    config_path = copy_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    if template is not None:
        (copy_dir / "chat_template.jinja").write_text(template)
    return copy_dir


def conversations(n=200, seed=0):
    """Chats built from corpus(): a system turn in one of three, then one to three question/answer exchanges."""
    rng = random.Random(seed)
    pairs = iter(corpus(3 * n, seed=seed + 1))
    chats = []
    for _ in range(n):
        messages = [{"role": "system", "content": "You add and multiply."}] if rng.random() < 1 / 3 else []
        for prompt, response in itertools.islice(pairs, rng.randint(1, 3)):
            messages.append({"role": "user", "content": prompt.removesuffix("\nAnswer:")})
            messages.append({"role": "assistant", "content": response.strip()})
        chats.append(messages)
    return chats


def uneven_pairs(n=240, seed=0):
    """(prompt, response) pairs whose responses run from 1 to 30 words: 'count 4 from 7' -> ' 7 8 9 10'."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        start, words = rng.randrange(10), 1 + i % 30
        pairs.append((f"Question: count {words} from {start}\nAnswer:", "".join(f" {start + k}" for k in range(words))))
    rng.shuffle(pairs)
    return pairs


def write_all(root, with_pad=True):
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    pairs = corpus()
    with open(root / "pairs.jsonl", "w") as f:
        for prompt, response in pairs:
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    (root / "text.txt").write_text("\n".join(p + r for p, r in pairs) + "\n")
    with open(root / "chat.jsonl", "w") as f:
        for messages in conversations():
            f.write(json.dumps({"messages": messages}) + "\n")
    with open(root / "uneven.jsonl", "w") as f:
        for prompt, response in uneven_pairs():
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    tokenizer = write_tokenizer(root / "model", [p + r for p, r in pairs], with_pad)
    write_model(root / "model", tokenizer)
    return root


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m accelrun.data.tiny_hf",
        description="Write a tiny Hugging Face Llama (random weights, a byte-level BPE tokenizer with a chat template) "
        "and its data (pairs.jsonl, chat.jsonl, uneven.jsonl, text.txt) into DIR, for recipes/finetune_lm.py on a "
        "machine that cannot download a model.", allow_abbrev=False,
        epilog="Then: python recipes/finetune_lm.py --model DIR/model --data-files DIR/chat.jsonl")
    p.add_argument("dir", nargs="?", default="tiny_hf", metavar="DIR",
                   help="the directory to write (default: %(default)s)")
    return p.parse_args(argv)


def main(argv=None):
    print(write_all(parse_args(argv).dir))


if __name__ == "__main__":
    main()
