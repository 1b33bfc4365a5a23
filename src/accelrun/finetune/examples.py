"""Fine-tuning examples: records read through `datasets`, tokenised into input_ids and labels a causal model learns.

Owns finetune_lm.py's data layer, behind one call, load_examples(), which returns the training blocks, the
evaluated validation blocks, one held-out example for the greedy answer, the format, the source, the cut counts
and the blocks' facts, and raises DataProblem, with one message for the user, for every problem with the data
(no file, an unreadable source or JSON line, a missing column, a value of the wrong kind, a chat without a
template, a template that raises or runs past TEMPLATE_SECONDS, chats without an assistant turn, too few examples,
--no-packing on plain text); a problem of one record names its file and line:

  * the formats and how the columns choose one: chat (conversations of {role, content} turns, rendered with the
    tokenizer's chat template), pairs (prompt/response records) and text (plain text packed into blocks);
  * the labels, set by position and not by token id: a chat learns its assistant turns and their end-of-turn
    tokens (from the template's {% generation %} markers, or else from rendering each conversation's prefixes),
    a pair its response and the end-of-sequence token; prompts and padding are IGNORE;
  * the examples --block-size cuts (their last response's end lost) and drops (nothing left to learn), counted;
    a text is cut to the characters that can hold --block-size tokens before it is tokenised (enough_characters);
  * the held-out split, made on examples (the same on every rank, and the same examples evaluated whether they
    are then packed or padded), and the examples evaluated (eval_examples of them);
  * the blocks: pairs and chat packed several to a block, or padded one to a block (--no-packing), by packing.py.

The caller runs load_examples() inside accelerator.main_process_first(), so that the main process tokenises and
caches and the others reuse its cache, and catches DataProblem there: every rank then leaves together.
It makes no distributed call itself.
"""

import argparse
import contextlib
import re
import signal
import threading
from typing import NamedTuple

from accelrun.exits import one_line

from .packing import BLOCK_COLUMNS, IGNORE, block_facts, into_blocks
from .records import (  # noqa: F401  (DataProblem: what the recipe catches, imported from here)
    DataProblem,
    data_reader,
    is_conversation,
    missing_assistant,
    record_location,
    unreadable,
    value_problem,
)

# What --format auto needs in the columns for each format, and what to name when they are missing.
COLUMN_FLAGS = {"pairs": ("prompt_column", "response_column"), "chat": ("messages_column",),
                "text": ("text_column",)}
MISSING_COLUMN_FIX = {
    "pairs": "--prompt-column and --response-column, or give conversations with --format chat --messages-column "
             "NAME, or text with --format text --text-column NAME",
    "chat": "--messages-column (a column of {role, content} turns), or use --format pairs or text",
    "text": "--text-column (a column of strings), or use --format pairs or chat"}
NO_CHAT_TEMPLATE = ("--format chat renders conversations with the tokenizer's chat template, and {model}'s tokenizer "
                    "has none: give a model whose tokenizer has one (an instruct or chat model), or set one in its "
                    "directory (chat_template.jinja, or chat_template in tokenizer_config.json)")
MIN_EXAMPLES = 20  # fewer leave no held-out example to evaluate on
TEMPLATE_SECONDS = 5  # one conversation's rendering through the chat template (milliseconds, for a real template)


class RecordProblem(DataProblem):
    """A problem with one record: load_examples names its file and line."""

    def __init__(self, index, message):
        super().__init__(message)
        self.index = index


class TemplateTooSlow(Exception):
    """The chat template ran past TEMPLATE_SECONDS on one conversation."""


class Examples(NamedTuple):
    """What load_examples() returns: the training blocks and the evaluated validation blocks (torch format), one
    held-out example (input_ids and labels, unpadded) for the greedy answer, the format read, where the data came
    from, the cut counts (tokenised_examples, cut_examples, dropped_examples) and the training blocks' facts
    (packing.block_facts, with train_examples and packing)."""
    train: object
    validation: object
    sample: dict
    format: str
    source: str
    cuts: dict
    facts: dict


def add_data_args(parser):
    """The flags load_examples() reads: where the data is, its format and its columns."""
    parser.add_argument("--data-files", default=None,
                        help="local .txt or .jsonl/.json files or globs, comma-separated")
    parser.add_argument("--dataset", default=None, help="a Hugging Face hub dataset (needs internet)")
    parser.add_argument("--dataset-config", default=None, help="its configuration name")
    parser.add_argument("--format", choices=("auto", "chat", "pairs", "text"), default="auto",
                        help="chat: conversations in the tokenizer's chat template, the assistant turns learned; "
                             "pairs: prompt/response records; text: packed plain text; auto: chat when the records "
                             "have --messages-column, pairs when they have the prompt and response columns, else text")
    parser.add_argument("--messages-column", default="messages",
                        help="chat: the column with each conversation, a list of {role, content} turns")
    parser.add_argument("--prompt-column", default="prompt", help="pairs: the column with the prompt")
    parser.add_argument("--response-column", default="response", help="pairs: the column with the response to learn")
    parser.add_argument("--text-column", default="text", help="text: the column with the text")
    parser.add_argument("--packing", action=argparse.BooleanOptionalAction, default=True,
                        help="pairs and chat: several examples in each block of --block-size tokens, each attending "
                             "only to itself, positions restarting at 0 (--no-packing: one example per block, padded "
                             "to it); plain text is always one stream cut into blocks")


def load_examples(args, tokenizer, block_size, eval_examples):
    """The data the flags name (args: --data-files or --dataset and --dataset-config, --format, the column flags,
    --packing, --seed, --model for messages) as blocks of block_size tokens, with eval_examples held-out examples
    evaluated. Raises DataProblem."""
    source, files, load = data_reader(args)
    try:
        raw = load()
    except Exception as exc:  # noqa: BLE001 - no network for the hub, a malformed file, a proxy...: one message
        raise DataProblem(unreadable(args, files, exc)) from None
    fmt = choose_format(args, files is None or all(f.endswith((".json", ".jsonl")) for f in files), raw.column_names)
    check_columns(args, fmt, source, raw.column_names, tokenizer)
    try:
        data = raw.map(tokenise(fmt, args, tokenizer, block_size), batched=True, with_indices=True,
                       remove_columns=raw.column_names, desc="tokenising")
    except RecordProblem as exc:
        raise DataProblem(f"{record_location(files, exc.index)}: {exc}") from None
    except DataProblem as exc:
        raise DataProblem(f"{source!r} cannot be read as --format {fmt}: {exc}") from None
    cuts = {"tokenised_examples": len(data), "cut_examples": sum(data["cut"]),
            "dropped_examples": sum(n == 0 for n in data["in_loss"])}
    data = data.filter(lambda e: e["in_loss"] > 0, desc="dropping examples with nothing to learn")
    if len(data) < MIN_EXAMPLES:
        roles = missing_assistant(source, raw[args.messages_column]) if fmt == "chat" else None
        raise DataProblem(roles or f"{source!r} gives only {len(data)} examples of at most {block_size} tokens; give "
                                   f"more data")
    split = data.train_test_split(test_size=0.05, seed=args.seed)  # cached too: the same on every rank
    train, validation = split["train"], split["test"].select(range(min(len(split["test"]), eval_examples)))
    sample = {k: v for k, v in split["test"].with_format("torch")[0].items() if k in ("input_ids", "labels")}
    facts = {"train_examples": len(train), "packing": fmt != "text" and args.packing}
    if fmt == "text":
        facts.update(block_facts(train, [block_size] * len(train), block_size), examples_per_block=None)
    else:
        lengths = train["length"]
        train, validation = (into_blocks(part, block_size, pad_id(tokenizer), args.packing)
                             for part in (train, validation))
        facts.update(block_facts(train, lengths, block_size))
    train, validation = (part.select_columns([c for c in BLOCK_COLUMNS if c in part.column_names])
                         .with_format("torch") for part in (train, validation))
    return Examples(train, validation, sample, fmt, source, cuts, facts)


def pad_id(tokenizer):
    return tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id


def choose_format(args, records, columns):
    """--format, or for auto the format the columns say: records (JSON, or a hub dataset) or plain text files."""
    if args.format != "auto":
        return args.format
    if not records:
        return "text"
    if args.messages_column in columns:
        return "chat"
    if args.prompt_column in columns and args.response_column in columns:
        return "pairs"
    return "text" if args.text_column in columns else "pairs"  # pairs' missing-column message names every format


def check_columns(args, fmt, source, columns, tokenizer):
    """Raise DataProblem when the data lacks the format's columns, or a chat's tokenizer has no template."""
    if missing := [c for c in (getattr(args, flag) for flag in COLUMN_FLAGS[fmt]) if c not in columns]:
        raise DataProblem(f"{source!r} has the columns {columns}, not {missing}: name them with "
                          f"{MISSING_COLUMN_FIX[fmt]}")
    if fmt == "chat" and tokenizer.chat_template is None:
        raise DataProblem(NO_CHAT_TEMPLATE.format(model=args.model))
    if fmt == "text" and not args.packing:
        raise DataProblem("--no-packing pads each example to --block-size, and plain text has no examples: it is one "
                          "stream cut into blocks. Drop --no-packing, or give prompt/response or chat records")


def tokenise(fmt, args, tokenizer, block_size):
    """The batched map (with the records' indices) from records to examples: input_ids and labels (at most
    block_size long, not padded), length, in_loss (positions in the loss after the first) and cut (the end of the
    last response lost to block_size); plain text straight to blocks of block_size (with real and examples, as
    packing.py's). A prompt, response or turn is cut to `enough` characters first: only the first block_size tokens
    are kept, and a 40 MB turn took minutes to tokenise whole. Raises RecordProblem."""
    eos = tokenizer.eos_token_id
    enough = enough_characters(tokenizer, block_size)

    def checked(batch, indices, column, conversation=False):
        for index, value in zip(indices, batch[column]):
            if problem := value_problem(column, value, conversation):
                raise RecordProblem(index, problem)
        return batch[column]

    def examples(encoded, cut):
        return {"input_ids": [x for x, _ in encoded], "labels": [y for _, y in encoded],
                "length": [len(x) for x, _ in encoded],
                "in_loss": [sum(t != IGNORE for t in y[1:]) for _, y in encoded], "cut": cut}

    def pairs(batch, indices):
        prompts = tokenizer([p[:enough] for p in checked(batch, indices, args.prompt_column)])["input_ids"]
        responses = tokenizer([r[:enough] for r in checked(batch, indices, args.response_column)],
                              add_special_tokens=False)["input_ids"]
        return examples([encode_pair(p, r, eos, block_size) for p, r in zip(prompts, responses)],
                        [len(p) + len(r) + 1 > block_size for p, r in zip(prompts, responses)])

    def chat(batch, indices):
        rendered = [rendered_chat(tokenizer, [{**m, "content": m["content"][:enough]} for m in messages], index,
                                  args.model)
                    for index, messages in zip(indices, checked(batch, indices, args.messages_column, True))]
        return examples([encode_chat(ids, learned, block_size) for ids, learned in rendered],
                        [any(learned[block_size:]) for _, learned in rendered])

    def packed(batch, indices):  # documents joined by end-of-sequence tokens, cut into whole blocks
        stream = [t for ids in tokenizer(checked(batch, indices, args.text_column))["input_ids"] for t in ids + [eos]]
        blocks = [stream[i:i + block_size] for i in range(0, len(stream) // block_size * block_size, block_size)]
        return {"input_ids": blocks, "labels": blocks, "in_loss": [block_size - 1] * len(blocks),
                "cut": [False] * len(blocks), "real": [block_size] * len(blocks), "examples": [1] * len(blocks)}
    return {"pairs": pairs, "chat": chat, "text": packed}[fmt]


def enough_characters(tokenizer, block_size):
    """Characters that always hold more than block_size tokens: no token spans more characters than the longest
    in the vocabulary (a byte-level token's string has one character per byte), so the first block_size tokens of
    a text are those of its first `enough` characters; the cut is past them."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return (block_size + 1) * max(longest, 1) + 1


def rendered_chat(tokenizer, messages, index, model):
    """assistant_positions() of one record, within TEMPLATE_SECONDS; a template that raises or runs on is the
    record's problem (RecordProblem: its file and line), in one line."""
    try:
        with time_limit(TEMPLATE_SECONDS):
            return assistant_positions(tokenizer, messages)
    except DataProblem as exc:
        raise RecordProblem(index, str(exc)) from None
    except TemplateTooSlow:
        raise RecordProblem(index, f"the chat template of {model} ran for more than {TEMPLATE_SECONDS} s on this "
                                   f"conversation, where a template takes milliseconds; fix the template "
                                   f"(chat_template.jinja, or chat_template in tokenizer_config.json)") from None
    except Exception as exc:  # noqa: BLE001 - the template is the model directory's code: whatever it raises
        raise RecordProblem(index, f"the chat template of {model} fails on this conversation "
                                   f"({one_line(f'{type(exc).__name__}: {exc}', limit=300)}); fix the template or the "
                                   f"record") from None


@contextlib.contextmanager
def time_limit(seconds):
    """Raise TemplateTooSlow in the body after `seconds` (a timer signal: jinja's loops are Python code, which the
    signal interrupts). Only in the main thread, the one signals reach; elsewhere no limit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        raise TemplateTooSlow()
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def encode_pair(prompt, response, eos, block_size):
    """(input_ids, labels) of a prompt/response pair, at most block_size long. Labels by position: the prompt is
    IGNORE whatever its ids, the response and its end-of-sequence token are learned."""
    return encode_chat(prompt + response + [eos], [False] * len(prompt) + [True] * (len(response) + 1), block_size)


def encode_chat(ids, learned, block_size):
    """(input_ids, labels) of a rendered conversation, cut at block_size: learned[i] says whether position i is in
    the loss (an assistant turn's token, or the end of its turn); labels by position, as encode_pair's. The
    padding (packing.py) is IGNORE too, so a pad token that is also the end-of-sequence token is learned only
    as an end."""
    return ids[:block_size], [t if keep else IGNORE for t, keep in zip(ids, learned)][:block_size]


def assistant_positions(tokenizer, messages):
    """(ids, learned) of a conversation in the tokenizer's chat template; learned marks the assistant turns and
    their end-of-turn tokens. The template's {% generation %} markers say where they are when it has them;
    otherwise each assistant turn is what it adds to the conversation before it rendered with the generation
    prompt (character spans, so a token merged across a boundary cannot shift the labels)."""
    if re.search(r"\{%-?\s*generation\s*-?%\}", tokenizer.get_chat_template()):
        rendered = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        return rendered["input_ids"], [bool(m) for m in rendered["assistant_masks"]]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not (through.startswith(before) and text.startswith(through)):  # a template that rewrites history
            raise DataProblem("the chat template renders a conversation's start differently once it goes on, so "
                              "its assistant turns cannot be found; add {% generation %} ... {% endgeneration %} "
                              "around the assistant content and its end-of-turn token in the template")
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return encoded["input_ids"], [any(a <= start < b for a, b in spans) for start, _ in encoded["offset_mapping"]]


def cut_note(cuts, fmt, block_size):
    """The start line's words on the examples --block-size cut: nothing is cut silently."""
    if fmt == "text":
        return ""
    n, dropped = cuts["cut_examples"], cuts["dropped_examples"]
    said = (f"{n} of {cuts['tokenised_examples']} examples cut at --block-size {block_size} (their last response's end "
            f"lost)" if n else f"none of {cuts['tokenised_examples']} examples cut at --block-size {block_size}")
    return f"; {said}" + (f", {dropped} dropped with nothing to learn left" if dropped else "")
