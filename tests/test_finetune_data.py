"""src/accelrun/finetune/examples.py, finetune_lm.py's data: labels set by position (a pair's prompt and the padding
never in the loss), chat conversations learned on their assistant turns only, the format read from the columns,
values of the wrong type refused with one message (DataProblem), the examples --block-size cuts counted, and a
--block-size that fits the model by default.

Most of it runs in this process on accelrun.data.tiny_hf's tokenizer (its chat template has {% generation %} markers;
copies without markers and without a template); two runs of the recipe (python, one process) check what only a
run shows: a refusal without a traceback, and a chat fine-tune's summary.
"""

import json
import math
import sys

import pytest

from accelrun.data.tiny_hf import (
    PLAIN_CHAT_TEMPLATE,
    conversations,
    corpus,
    uneven_pairs,
    with_chat_template,
    write_all,
)
from launching import REPO, LaunchResult, run_command
from planted import planted_copy
from run_checks import assert_refused

sys.path.insert(0, str(REPO / "recipes"))
import accelrun.finetune.examples as examples_module  # noqa: E402
from accelrun.finetune.examples import (  # noqa: E402
    IGNORE,
    DataProblem,
    assistant_positions,
    cut_note,
    encode_chat,
    encode_pair,
    load_examples,
)
from accelrun.finetune.packing import best_fit_decreasing, pack_blocks, pad_blocks  # noqa: E402
from finetune_lm import parse_args  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model and its data, a copy whose chat template has no generation markers, one with no template."""
    root = write_all(tmp_path_factory.mktemp("tiny_chat"))
    with_chat_template(root / "model", root / "plain", PLAIN_CHAT_TEMPLATE)
    with_chat_template(root / "model", root / "bare", None)
    return root


def tokenizer(root, name):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(root / name)


def examples(root, data, *flags, model="model", block_size=64, eval_examples=1000):
    """load_examples on `data` with the recipe's own flags: (train, validation, sample, format, source, cuts, facts)."""
    args = parse_args(["--model", str(root / model), "--data-files", str(root / data), *flags])
    return load_examples(args, tokenizer(root, model), block_size, eval_examples)


def refusal(root, data, *flags, model="model"):
    """The one message of the DataProblem that load_examples raises (the recipe ends the run with it)."""
    with pytest.raises(DataProblem) as refused:
        examples(root, data, *flags, model=model)
    return str(refused.value)


CHAT = [{"role": "system", "content": "You add and multiply."},
        {"role": "user", "content": "Question: what is 3 plus 4?"}, {"role": "assistant", "content": "It is 7."},
        {"role": "user", "content": "Question: what is 6 times 2?"}, {"role": "assistant", "content": "It is 12."}]


def test_labels_are_set_by_position():
    """The prompt is never in the loss, whatever its token ids; the response and its end-of-sequence token are,
    even when the response holds the end-of-sequence id; the padding is IGNORE (test_packing.py)."""
    eos = 2
    ids, labels = encode_pair([0, 5, 6], [7, 2, 8], eos, 10)  # a response that contains the eos id
    assert ids == [0, 5, 6, 7, 2, 8, eos]
    assert labels == [IGNORE] * 3 + [7, 2, 8, eos]
    ids, labels = encode_pair([0, 5, 6], [7, 8, 9], eos, 5)  # cut at the block size
    assert ids == [0, 5, 6, 7, 8] and labels == [IGNORE] * 3 + [7, 8]


def test_chat_labels_are_the_assistant_turns_by_position(tiny):
    """Exactly the assistant contents and the </s> closing each are learned, from the generation markers and from
    the prefix renders alike; the headers, the other turns and the padding never are, even with pad = </s>."""
    tok = tokenizer(tiny, "model")
    eos = tok.eos_token_id

    def piece(text):
        return tok(text, add_special_tokens=False)["input_ids"]
    # The rendering built piece by piece, each piece's tokens marked learned or not.
    pieces = [([tok.bos_token_id], False), (piece("<|system|>\nYou add and multiply.\n"), False),
              (piece("<|user|>\nQuestion: what is 3 plus 4?\n"), False), (piece("<|assistant|>\n"), False),
              (piece("It is 7.") + [eos], True), (piece("<|user|>\nQuestion: what is 6 times 2?\n"), False),
              (piece("<|assistant|>\n"), False), (piece("It is 12.") + [eos], True)]
    ids = [t for part, _ in pieces for t in part]
    learned = [keep for part, keep in pieces for _ in part]
    marked = assistant_positions(tok, CHAT)
    prefixes = assistant_positions(tokenizer(tiny, "plain"), CHAT)
    assert marked == prefixes == (ids, learned)
    assert tok.decode([t for t, keep in zip(ids, learned) if keep]) == "It is 7.</s>It is 12.</s>"

    input_ids, labels = encode_chat(ids, learned, len(ids) + 3)
    assert input_ids == ids and labels == [t if keep else IGNORE for t, keep in zip(ids, learned)]
    input_ids, labels = encode_chat(ids, learned, len(ids) - 2)  # the last answer's '.' and </s> cut
    assert input_ids == ids[:-2] and labels == [t if keep else IGNORE for t, keep in zip(ids, learned)][:-2]


def test_markers_and_prefix_renders_agree_on_every_conversation(tiny):
    marked, plain = tokenizer(tiny, "model"), tokenizer(tiny, "plain")
    for messages in conversations():
        ids, learned = assistant_positions(marked, messages)
        assert assistant_positions(plain, messages) == (ids, learned)
        answers = [m["content"] + "</s>" for m in messages if m["role"] == "assistant"]
        assert marked.decode([t for t, keep in zip(ids, learned) if keep]) == "".join(answers)


def test_the_format_comes_from_the_columns(tiny):
    (tiny / "notes.jsonl").write_text("".join(json.dumps({"text": p + r}) + "\n" for p, r in corpus(200)))
    assert examples(tiny, "chat.jsonl").format == "chat"
    assert examples(tiny, "pairs.jsonl").format == "pairs"
    assert examples(tiny, "text.txt").format == "text"
    assert examples(tiny, "notes.jsonl").format == "text"
    (tiny / "turns.jsonl").write_text(
        "".join(json.dumps({"dialogue": m, "id": i}) + "\n" for i, m in enumerate(conversations(40))))
    assert examples(tiny, "turns.jsonl", "--messages-column", "dialogue").format == "chat"


def test_a_chat_without_a_template_is_one_message(tiny):
    message = refusal(tiny, "chat.jsonl", model="bare")
    assert "tokenizer has none" in message and "chat_template.jinja" in message


def test_each_column_of_the_wrong_kind_is_one_message_that_leads_somewhere(tiny):
    # The missing column's advice, followed, ends at the type check, whose advice is a run that works.
    message = refusal(tiny, "chat.jsonl", "--format", "text")
    assert "not ['text']: name them with --text-column" in message and "--format pairs or chat" in message
    message = refusal(tiny, "chat.jsonl", "--format", "text", "--text-column", "messages")
    assert message.endswith("use --format chat --messages-column messages")
    assert examples(tiny, "chat.jsonl", "--format", "chat", "--messages-column", "messages").format == "chat"
    message = refusal(tiny, "chat.jsonl", "--format", "pairs", "--prompt-column", "messages",
                      "--response-column", "messages")
    assert "holds conversations" in message
    message = refusal(tiny, "pairs.jsonl", "--format", "chat", "--messages-column", "prompt")
    assert "holds text, not conversations" in message and "--format text --text-column prompt" in message
    (tiny / "numbers.jsonl").write_text("".join(json.dumps({"prompt": p, "response": 7}) + "\n" for p, _ in corpus(40)))
    assert "holds 7, not text" in refusal(tiny, "numbers.jsonl")
    (tiny / "qa.jsonl").write_text("".join(json.dumps({"question": p, "answer": r}) + "\n" for p, r in corpus(40)))
    message = refusal(tiny, "qa.jsonl")
    assert "--prompt-column and --response-column" in message and "--format chat --messages-column" in message


def write_jsonl(path, records, replace=None):
    """records as JSON Lines; replace: {line number (1-based): the raw text of that line instead}."""
    lines = [json.dumps(r) for r in records]
    for number, text in (replace or {}).items():
        lines[number - 1] = text
    path.write_text("".join(line + "\n" for line in lines))
    return path.name


def test_a_malformed_json_line_is_named_by_file_and_line(tiny):
    """Issue 41, item 7: a malformed line in --data-files gave "could not load ... Offline, use --data-files" (the
    data was local), with the row number only in a separate library line. Now one line: the file and the line."""
    pairs = [{"prompt": p, "response": r} for p, r in corpus(40)]
    name = write_jsonl(tiny / "broken.jsonl", pairs, {6: '{"prompt": "what is 2 plus 2?", "response": '})
    message = refusal(tiny, name)
    assert message.startswith(f"{tiny / name}, line 6: not a JSON record (Expecting value); fix or remove"), message
    assert "Offline" not in message
    name = write_jsonl(tiny / "changing.jsonl", pairs[:9] + [{"prompt": "x", "response": {"text": "y"}}] + pairs[9:])
    message = refusal(tiny, name)  # `datasets` reads it; the record is refused by its line
    assert message.startswith(f"{tiny / name}, line 10: the column 'response' holds {{'text': 'y'}}, not text"), message
    # A type that changes inside a column, after a blank line: `datasets` cannot read this one; the line is named
    # either way (a blank line is not a record, and does count as a line).
    chats, bad = [{"messages": c} for c in conversations(30)], {"messages": [{"role": "user", "content": 5}]}
    nested = write_jsonl(tiny / "nested.jsonl", chats[:3] + [{}] + chats[3:7] + [bad] + chats[7:], {4: ""})
    message = refusal(tiny, nested)
    assert message.startswith(f"{tiny / nested}, line 9: ") and "content" in message, message
    from accelrun.finetune.records import json_problem  # where `datasets` cannot read such a file, this names the line
    assert json_problem(str(tiny / name)) == (f"{tiny / name}, line 10: not a record like the others (its "
                                              f"'response' holds an object, the records before text); fix or "
                                              f"remove that line")


def test_chat_roles_of_another_convention_are_named(tiny):
    """Issue 41, item 7: ShareGPT's roles (human, gpt) gave "gives only 0 examples ... give more data"; its keys
    (from, value) a message that did not say what to rename."""
    renamed = [[{**m, "role": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"])} for m in chat]
               for chat in conversations(40)]
    message = refusal(tiny, write_jsonl(tiny / "roles.jsonl", [{"messages": c} for c in renamed]))
    assert ("no turn has the role 'assistant', the turns a chat fine-tune learns; the roles found are 'gpt', "
            "'human'") in message and "rename 'gpt' to 'assistant' and 'human' to 'user'" in message, message
    keys = [[{"from": m["role"], "value": m["content"]} for m in chat] for chat in renamed]
    message = refusal(tiny, write_jsonl(tiny / "keys.jsonl", [{"messages": c} for c in keys]), "--format", "chat")
    assert "holds turns of {from, value} (ShareGPT's), not {role, content}: rename the keys" in message, message


def test_a_bad_chat_record_is_named_by_its_line(tiny):
    """Issue 46, item 8: a bad chat record was reported without its line number."""
    records = [{"messages": c} for c in conversations(40)]
    name = write_jsonl(tiny / "one_bad.jsonl", records[:7] + [{"messages": [{"role": "user", "content": 5}]}]
                       + records[7:])
    message = refusal(tiny, name)
    assert message.startswith(f"{tiny / name}, line 8: the column 'messages' holds"), message


@pytest.mark.parametrize("problem", ["raising-template", "slow-template"])
def test_a_chat_template_that_fails_or_runs_on_is_one_message(tiny, problem, monkeypatch):
    """Issue 46, items 6 and 8: a chat template that raises gave a traceback; one with nested range(99999) loops
    ran on for as long as anyone waited. Each is one message naming the record; the time limit is lowered here so
    that the test takes a second, not the run's 5."""
    model = planted_copy(tiny / "model", tiny / problem, problem)
    monkeypatch.setattr(examples_module, "TEMPLATE_SECONDS", 0.5)
    message = refusal(tiny, "chat.jsonl", model=model.name)
    assert message.startswith(f"{tiny / 'chat.jsonl'}, line 1: the chat template of {model} "), message
    if problem == "raising-template":
        assert "fails on this conversation (TemplateError: this template refuses every conversation)" in message
    else:
        assert "ran for more than 0.5 s on this conversation" in message


def spy_on_tokenising(tok):
    """tok, changed so that every text it tokenises is recorded (as apply_chat_template's too): its lengths."""
    seen = []
    real = type(tok).__call__

    def call(self, text, *args, **kwargs):
        seen.extend(len(t) for t in ([text] if isinstance(text, str) else text))
        return real(self, text, *args, **kwargs)
    tok.__class__ = type("Spied", (type(tok),), {"__call__": call})
    return seen


@pytest.mark.parametrize("data", ["chat", "pairs"])
def test_a_record_far_longer_than_the_block_is_not_tokenised_whole(tiny, data):
    """Issue 46, item 6: one 40 MB assistant turn stalled the start for minutes, tokenised whole for a block of 64
    tokens. Now no text longer than enough_characters() reaches the tokenizer, and what is kept is exactly what
    the whole record gives (checked on a record of 20,000 characters, which is quick to tokenise whole)."""
    from accelrun.finetune.examples import enough_characters
    long_turn = "It is 7 because 3 plus 4 is 7. " * 650  # 20,150 characters
    if data == "chat":
        records = [{"messages": c} for c in conversations(40)]
        records[3] = {"messages": [{"role": "user", "content": "Question: why?"},
                                   {"role": "assistant", "content": long_turn * 2000}]}  # 40 MB
    else:
        records = [{"prompt": p, "response": r} for p, r in corpus(40)]
        records[3] = {"prompt": "Question: why?\nAnswer:", "response": long_turn * 2000}
    name = write_jsonl(tiny / f"huge_{data}.jsonl", records)
    args = parse_args(["--model", str(tiny / "model"), "--data-files", str(tiny / name), "--no-packing"])
    tok = tokenizer(tiny, "model")
    seen = spy_on_tokenising(tok)
    loaded = load_examples(args, tok, 64, 1000)
    assert loaded.cuts["tokenised_examples"] == 40 and loaded.cuts["cut_examples"] >= 1
    assert seen and max(seen) < 2 * enough_characters(tok, 64) < 10_000, max(seen)
    plain = tokenizer(tiny, "model")
    if data == "chat":
        whole = [{"role": "user", "content": "Question: why?"}, {"role": "assistant", "content": long_turn}]
        cut = [{**m, "content": m["content"][:enough_characters(plain, 64)]} for m in whole]
        assert encode_chat(*assistant_positions(plain, cut), 64) == encode_chat(*assistant_positions(plain, whole), 64)
    else:
        enough = enough_characters(plain, 64)
        whole = plain(long_turn, add_special_tokens=False)["input_ids"]
        assert plain(long_turn[:enough], add_special_tokens=False)["input_ids"][:64] == whole[:64]


def independent_pair_cuts(tok, pairs, block):
    """(cut, dropped): responses whose </s> is past the block; of them, those that start past it."""
    lengths = [(len(tok(p)["input_ids"]), len(tok(r, add_special_tokens=False)["input_ids"]) + 1) for p, r in pairs]
    return sum(p + r > block for p, r in lengths), sum(p >= block for p, _ in lengths)


def independent_chat_cuts(tok, chats, block):
    """(cut, dropped): every chat ends with an answer and its </s>, so it is cut when its rendering is longer than
    the block; dropped when the rendering up to the first answer's generation prompt fills the block already."""
    cut = sum(len(tok.apply_chat_template(m)["input_ids"]) > block for m in chats)
    dropped = sum(len(tok.apply_chat_template(m[:next(i for i, t in enumerate(m) if t["role"] == "assistant")],
                                              add_generation_prompt=True)["input_ids"]) >= block for m in chats)
    return cut, dropped


@pytest.mark.parametrize("data, block", [("uneven.jsonl", 36), ("uneven.jsonl", 20), ("chat.jsonl", 60)])
def test_the_examples_block_size_cuts_are_counted(tiny, data, block):
    tok = tokenizer(tiny, "model")
    if data == "chat.jsonl":
        cut, dropped = independent_chat_cuts(tok, conversations(), block)
    else:
        cut, dropped = independent_pair_cuts(tok, uneven_pairs(), block)
    assert cut > 0 and (dropped > 0 or block == 36)  # the cases cut something, and the short blocks drop some
    loaded = examples(tiny, data, "--no-packing", block_size=block)  # every validation example evaluated
    total = len(conversations()) if data == "chat.jsonl" else len(uneven_pairs())
    assert loaded.cuts == {"tokenised_examples": total, "cut_examples": cut, "dropped_examples": dropped}
    assert len(loaded.train) + len(loaded.validation) == total - dropped == loaded.facts["train_examples"] + len(
        loaded.validation)
    note = cut_note(loaded.cuts, "chat", block)
    assert f"{cut} of {total} examples cut at --block-size {block}" in note
    assert (f"{dropped} dropped" in note) == (dropped > 0)


def recipe(tiny, out, *flags):
    cmd = [sys.executable, "recipes/finetune_lm.py", "--model", str(tiny / "model"), "--output-dir", str(out),
           "--max-steps", "6", "--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "1", "--log-every", "1",
           "--eval-every", "3", "--eval-batches", "2", "--sample-tokens", "6", "--save-dtype", "float32", *flags]
    return LaunchResult(*run_command(cmd), out)


@pytest.mark.slow
def test_a_column_of_conversations_read_as_text_is_refused_in_one_line(tiny, tmp_path):
    run = recipe(tiny, tmp_path / "out", "--data-files", str(tiny / "chat.jsonl"), "--format", "text",
                 "--text-column", "messages")
    assert_refused(run, "the column 'messages' holds conversations")
    assert "Traceback" not in run.output


@pytest.mark.slow
def test_chat_fine_tune_with_the_default_block_size(tiny, tmp_path):
    """No --block-size: the tiny model's context, 128 (under 1024); chat detected; the cut conversations counted
    on the first line and in the summary; the loss on the assistant turns goes down."""
    from transformers import AutoConfig
    context = AutoConfig.from_pretrained(tiny / "model").max_position_embeddings
    assert context < 1024
    run = recipe(tiny, tmp_path / "out", "--data-files", str(tiny / "chat.jsonl"))
    assert run.returncode == 0, run.output[-3000:]
    s = run.summary
    cut, dropped = independent_chat_cuts(tokenizer(tiny, "model"), conversations(), context)
    assert s["data_format"] == "chat" and s["block_size"] == context
    assert s["cut_examples"] == cut > 0 and s["dropped_examples"] == dropped == 0
    assert f"{cut} of {len(conversations())} examples cut at --block-size {context}" in run.output
    losses = [m["loss"] for m in run.metrics]
    assert all(math.isfinite(x) for x in losses) and s["final_loss"] < s["first_loss"]
    assert s["sample_prompt"].endswith("<|assistant|>\n")  # the held-out chat up to its first answer


def test_best_fit_decreasing_by_hand():
    """The longest first, each into the block with the least room that holds it."""
    assert best_fit_decreasing([5, 3, 8, 2, 6], 8) == [[2], [4, 3], [0, 1]]  # 8 | 6+2 | 5+3: nothing left over
    assert best_fit_decreasing([7, 7, 7], 8) == [[0], [1], [2]]
    # 4, 4, 3 open three blocks (room 2, 2, 3); the 2 fills one of the blocks with room 2, the 1 goes to the other
    assert best_fit_decreasing([4, 1, 3, 2, 4], 6) == [[0, 1], [4, 3], [2]]


def test_a_packed_block_by_hand():
    """Each example's positions restart at 0 and its first label is IGNORE (the token before it is another
    example's); the padding after the last is IGNORE, a segment of its own; real tokens and examples counted."""
    pack = pack_blocks(block_size=8, pad_id=9)
    blocks = pack({"input_ids": [[1, 2, 3], [4, 5]], "labels": [[IGNORE, 2, 3], [4, 5]]})
    assert blocks["input_ids"] == [[1, 2, 3, 4, 5, 9, 9, 9]]
    assert blocks["labels"] == [[IGNORE, 2, 3, IGNORE, 5, IGNORE, IGNORE, IGNORE]]
    assert blocks["position_ids"] == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert (blocks["real"], blocks["examples"], blocks["in_loss"]) == ([5], [2], [3])
    padded = pad_blocks(block_size=4, pad_id=9)({"input_ids": [[1, 2, 3], [4, 5]], "labels": [[IGNORE, 2, 3], [4, 5]]})
    assert padded["input_ids"] == [[1, 2, 3, 9], [4, 5, 9, 9]] and "position_ids" not in padded
    assert padded["labels"] == [[IGNORE, 2, 3, IGNORE], [4, 5, IGNORE, IGNORE]]
    assert (padded["real"], padded["examples"], padded["in_loss"]) == ([3, 2], [1, 1], [2, 1])


@pytest.mark.parametrize("packing", ["--packing", "--no-packing"])
def test_padding_share_by_hand_count(tiny, packing):
    """Pairs of one length n (25 tokens), blocks of 64: packed two to a block, padding (64 - 50) / 64 of every
    full block (the last may hold one); padded, (64 - n) / 64. The train/validation split is made on examples,
    before packing: the same examples are evaluated either way."""
    tok, n, block = tokenizer(tiny, "model"), 25, 64
    same = [(p, r) for p, r in uneven_pairs(2000) if len(tok(p)["input_ids"] + tok(r)["input_ids"]) == n]
    (tiny / "same.jsonl").write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in same))
    loaded = examples(tiny, "same.jsonl", packing, block_size=block)
    facts, count = loaded.facts, loaded.facts["train_examples"]
    assert count + len(loaded.validation) * (2 if packing == "--packing" else 1) >= len(same) > 40
    if packing == "--packing":
        blocks = math.ceil(count / 2)
        assert facts["train_blocks"] == len(loaded.train) == blocks
        assert facts["examples_per_block"] == pytest.approx(count / blocks)
        assert facts["padding_share"] == pytest.approx(1 - count * n / (blocks * block))
    else:
        assert facts["train_blocks"] == count and facts["examples_per_block"] == 1
        assert facts["padding_share"] == pytest.approx((block - n) / block)
    assert facts["real_tokens_per_block"] == pytest.approx(block * (1 - facts["padding_share"]))
    assert facts["attention_span"] == pytest.approx(n)
    assert set(loaded.train.column_names) == ({"input_ids", "labels", "position_ids"} if packing == "--packing"
                                              else {"input_ids", "labels"})


def test_the_held_out_split_is_made_before_packing(tiny):
    packed, padded = (examples(tiny, "uneven.jsonl", flag, eval_examples=8) for flag in ("--packing", "--no-packing"))
    assert packed.facts["train_examples"] == padded.facts["train_examples"]
    assert len(padded.validation) == 8 and len(packed.validation) < 8  # the same 8 examples, in fewer blocks
    tokens = [sorted(t for t in part.validation[:]["input_ids"].flatten().tolist() if t != 2)  # 2: <pad>
              for part in (packed, padded)]
    assert tokens[0] == tokens[1]
    assert packed.sample["input_ids"].tolist() == padded.sample["input_ids"].tolist()


def test_no_packing_on_plain_text_is_one_message(tiny):
    assert "plain text has no examples" in refusal(tiny, "text.txt", "--no-packing")


@pytest.fixture
def library_log():
    """What `datasets` and huggingface_hub log while the test runs (their loggers print to the terminal)."""
    import logging
    said = []

    class Collect(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())
    handler = Collect()
    loggers = [logging.getLogger(name) for name in ("datasets", "huggingface_hub")]
    for logger in loggers:
        logger.addHandler(handler)
    yield said
    for logger in loggers:
        logger.removeHandler(handler)


def test_each_data_error_is_the_projects_one_line(tiny, library_log):
    """Issue 53, item 12: a malformed line 6 printed `datasets`' own "Failed to load JSON ... JSON parse error ... in
    row 5" before the project's "line 6"; an empty file said "line 1: not JSON". Issue 52: a chat record nested
    100,000 deep ended in a RecursionError (here pyarrow's reader crashed the process). Each is now one line, the
    project's, at once."""
    pairs = [{"prompt": p, "response": r} for p, r in corpus(40)]
    name = write_jsonl(tiny / "no_comma.jsonl", pairs, {6: '{"prompt": "what is 2 plus 2?" "response": "4"}'})
    message = refusal(tiny, name)
    assert message.startswith(f"{tiny / name}, line 6: not a JSON record (Expecting ',' delimiter)"), message
    assert not [line for line in library_log if "JSON" in line or "row 5" in line], library_log
    (tiny / "empty.jsonl").write_text("\n")
    assert refusal(tiny, "empty.jsonl") == (f"{tiny / 'empty.jsonl'} is empty: it holds no records; give a file with "
                                            f"one record a line, or leave it out")
    records = [{"messages": c} for c in conversations(30)]
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    name = write_jsonl(tiny / "deep.jsonl", records[:4] + [{}] + records[4:], {5: deep})
    assert refusal(tiny, name) == (f"{tiny / name}, line 5: a record nested more than 100 deep (lists and objects); "
                                   f"a fine-tune's records are a few levels deep: fix or remove that line")
    from accelrun.finetune.records import depth_problem, record_problem
    assert record_problem(deep) == "nested more than 100 deep"  # json's RecursionError, named
    assert depth_problem(str(tiny / "chat.jsonl")) is None
    name = write_jsonl(tiny / "brackets.jsonl", [{"text": "[" * 500 + "{" * 500}, {"list": [[1, [2]], {"a": [3]}]}])
    assert depth_problem(str(tiny / name)) is None  # brackets inside strings are text, not nesting


def test_an_unreachable_hub_is_one_line_without_retries(tiny, library_log, monkeypatch):
    """Issue 53, item 12: a hub id with the hub unreachable printed 10 retry lines over 37 s (five tries of each file,
    two lines each) before its one line. The hub is asked once (records.offline_unless_the_hub_answers); unanswered,
    the libraries go offline: --model and --dataset each end in one line, with no retry."""
    import socket

    import datasets
    from huggingface_hub import constants

    from accelrun.finetune.pretrained import load_config_and_tokenizer
    from accelrun.finetune.records import offline_unless_the_hub_answers
    with socket.socket() as probe:  # a port nothing listens on: refused at once
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    why = offline_unless_the_hub_answers()
    assert why.startswith(f"http://127.0.0.1:{port} did not answer within 5 s ("), why
    assert constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE and constants.is_offline_mode()
    assert offline_unless_the_hub_answers() == "HF_HUB_OFFLINE is set"  # asked once
    error = load_config_and_tokenizer("someorg/no-such-model")[3]
    assert error.startswith("cannot load model 'someorg/no-such-model' (") and "\n" not in error, error
    message = refusal(tiny, "chat.jsonl", "--dataset", "someorg/no-such-data")
    assert message.startswith("could not load --dataset 'someorg/no-such-data' (") and "\n" not in message, message
    assert not [line for line in library_log if "Retry" in line or "thrown while requesting" in line], library_log
