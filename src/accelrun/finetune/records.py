"""Reading a fine-tune's data files, and naming what is wrong with a record: its file and line, never a loader's
traceback.

Owns how records are read (data_reader: datasets' json or text loader over --data-files in order, or a hub
dataset; a JSON line nested deeper than MAX_DEPTH refused before the loader, whose parser crashes on such a line;
datasets' own log line for a file it cannot parse left out, the line below names it), the one-line messages for data
that does not load (unreadable: an empty file, the first line of a JSON Lines file that is not a record, or whose
value has another kind than the records before it), the hub asked once whether it answers (offline_unless_the_hub_
answers, for hub ids: its libraries would retry each file five times, ten lines over half a minute), where a record
of the loaded split is (record_location: FILE, line N), and whether a column's value is a conversation or text
(value_problem, with the fixes for ShareGPT's keys and roles, missing_assistant). examples.py builds the examples on
top of it.
"""

import contextlib
import glob
import json
import logging
import os
import re
import sys

from accelrun.exits import one_line

KINDS = {"str": "text", "list": "a list", "dict": "an object", "int": "a number", "float": "a number",
         "bool": "true or false"}  # what a JSON value is, as a message says it


class DataProblem(ValueError):
    """Any problem with the data: reported as one message, never as a tokenizer's or a loader's traceback."""


MAX_DEPTH = 100  # nesting of a record a fine-tune reads (a chat is 3 deep); pyarrow's parser crashed at 20,000
HUB_ANSWER_S = 5  # how long the hub may take to answer its one question


def data_reader(args):
    """(source, the files in the order they are read (None for a hub dataset), a function that loads it as one
    `datasets` split). Raises DataProblem for files that no loader should be given (none, or a line nested too deep)."""
    from datasets import load_dataset  # here: --help stays quick
    if args.dataset:
        if not os.path.isdir(os.path.expanduser(args.dataset)):
            offline_unless_the_hub_answers()
        return args.dataset, None, lambda: load_dataset(args.dataset, args.dataset_config, split="train")
    files = sorted(f for pattern in (args.data_files or "").split(",") if pattern
                   for f in glob.glob(os.path.expanduser(pattern)))
    if not files:
        raise DataProblem(f"--data-files {args.data_files!r} matches no file; give .txt or .jsonl paths or globs")
    records = all(f.endswith((".json", ".jsonl")) for f in files)
    for path in files if records else ():
        if problem := depth_problem(path):
            raise DataProblem(problem)

    def load():
        with _without_datasets_json_error():
            return load_dataset("json" if records else "text", data_files=files, split="train")
    return args.data_files, files, load


class _NotTheJsonError:
    """A logging filter: datasets' "Failed to load JSON from file ... JSON parse error ... in row 5" (pyarrow's row,
    counted from 0), printed before unreadable()'s line for the same problem, which names the file's line."""

    @staticmethod
    def filter(record):
        return not record.getMessage().startswith("Failed to load JSON from file")


@contextlib.contextmanager
def _without_datasets_json_error():
    logger = logging.getLogger("datasets.packaged_modules.json.json")
    logger.addFilter(_NotTheJsonError)
    try:
        yield
    finally:
        logger.removeFilter(_NotTheJsonError)


def offline_unless_the_hub_answers(timeout=HUB_ANSWER_S):
    """Before a hub id is read: one request to the hub (HF_ENDPOINT), answered within `timeout` seconds or not.
    Unanswered, huggingface_hub, transformers and datasets go offline for this process and those it starts
    (HF_HUB_OFFLINE=1): what the local cache holds loads at once, and what it does not fails at once, in one line,
    instead of five retries of each file with two lines each. Returns None, or why the hub is taken as offline."""
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    from huggingface_hub.utils import get_session
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
        return None
    except Exception as exc:  # noqa: BLE001 - no route, no name, a proxy that refuses, a timeout: all offline
        why = one_line(f"{constants.ENDPOINT} did not answer within {timeout} s ({type(exc).__name__}: {exc})")
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:  # datasets reads the variable once, at import
        sys.modules["datasets"].config.HF_HUB_OFFLINE = True
    return why


def depth_problem(path, limit=MAX_DEPTH):
    """None, or `FILE, line N: ...` for the first line nested deeper than `limit` (lists and objects): pyarrow's JSON
    reader, which `datasets` hands the file to, crashes the process on a line 20,000 deep, and Python's json raises
    RecursionError. Lines with fewer brackets than `limit` are passed over at the speed of bytes.count."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.count(b"[") + line.count(b"{") <= limit:
                continue
            depth, deepest = 0, 0
            for bracket in re.finditer(rb"[][{}]", re.sub(rb'"(?:[^"\\]|\\.)*"', b'""', line)):
                depth += 1 if bracket.group() in (b"[", b"{") else -1
                deepest = max(deepest, depth)
            if deepest > limit:
                return (f"{path}, line {number}: a record nested more than {limit} deep (lists and objects); a "
                        f"fine-tune's records are a few levels deep: fix or remove that line")
    return None


def unreadable(args, files, exc):
    """The message for data that `datasets` could not load: the hub's error, an empty file, or the first line of a
    JSON file that is not a record, named by file and line (the library names neither)."""
    said = one_line(f"{type(exc).__name__}: {exc}")
    if files is None:
        return f"could not load --dataset {args.dataset!r} ({said}). Offline, use --data-files"
    for path in files:
        if empty(path):
            return f"{path} is empty: it holds no records; give a file with one record a line, or leave it out"
    for path in (f for f in files if f.endswith((".json", ".jsonl"))):
        if problem := json_problem(path):
            return problem
    return f"could not read --data-files {args.data_files!r} ({said})"


def empty(path):
    """Whether the file holds nothing but white space (read a megabyte at a time)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return False
    return True


def json_problem(path):
    """None, or `FILE, line N: ...` for the first line of a JSON Lines file that is not one JSON record (an object),
    or where a file of one JSON document stops being JSON."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
    if lines and record_problem(lines[0][1]) is None:  # JSON Lines: one object a line
        kinds = {}  # each column's kind of value, as the first record that has it holds it
        for number, line in lines:
            if problem := record_problem(line):
                return f"{path}, line {number}: not a JSON record ({problem}); fix or remove that line"
            if problem := kind_problem(json.loads(line), kinds):
                return f"{path}, line {number}: not a record like the others ({problem}); fix or remove that line"
        return None
    try:
        json.loads("".join(line for _, line in lines))
    except RecursionError:
        return f"{path}: nested too deep to read as JSON; fix the file"
    except ValueError as exc:
        return f"{path}, line {getattr(exc, 'lineno', '?')}: not JSON ({getattr(exc, 'msg', exc)}); fix that line"
    return None


def record_problem(line):
    """None for a line that is one JSON object, else what is wrong with it."""
    try:
        value = json.loads(line)
    except RecursionError:
        return f"nested more than {MAX_DEPTH} deep"
    except ValueError as exc:
        return getattr(exc, "msg", str(exc))
    return None if isinstance(value, dict) else f"a JSON {type(value).__name__}, not an object"


def kind_problem(record, kinds):
    """None, or which value holds another kind (text, list, object, number) than at the same place in the records
    before: a column, or a key inside one (`messages[].content`), as Arrow needs one type per place."""
    for place, value in leaves(record):
        kind = KINDS.get(type(value).__name__, type(value).__name__)
        if value is not None and kinds.setdefault(place, kind) != kind:
            return f"its {place!r} holds {kind}, the records before {kinds[place]}"
    return None


def leaves(value, place=""):
    """(place, value) of every value in a JSON record, lists and objects included, their items as `place[]`."""
    if place:
        yield place, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, f"{place}.{key}" if place else key)
    elif isinstance(value, list):
        for item in value:
            yield from leaves(item, f"{place}[]")


def record_location(files, index):
    """Where the record at `index` of the loaded split is: `FILE, line N` for JSON Lines files (read in order,
    blank lines skipped, as `datasets` reads them), else `record N`."""
    seen = 0
    for path in files if files and all(f.endswith(".jsonl") for f in files) else ():
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                seen += bool(line.strip())
                if seen == index + 1:
                    return f"{path}, line {number}"
    return f"record {index + 1} of {files[0] if files and len(files) == 1 else 'the data'}"


def missing_assistant(source, conversations):
    """None, or the message for chats in which no turn has the role 'assistant', the turns a fine-tune learns."""
    roles = sorted({m.get("role") for c in conversations if isinstance(c, list) for m in c if isinstance(m, dict)}
                   - {None})
    if "assistant" in roles or not roles:
        return None
    fix = ("ShareGPT's names: rename 'gpt' to 'assistant' and 'human' to 'user'" if {"gpt", "human"} & set(roles)
           else "give the turns to learn the role 'assistant'")
    return (f"{source!r}: no turn has the role 'assistant', the turns a chat fine-tune learns; the roles found are "
            f"{', '.join(map(repr, roles))}: {fix}")


def is_conversation(value):
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def value_problem(column, value, conversation):
    """Why a record's `column` value cannot be used (a conversation when `conversation`, else text), or None."""
    if conversation:
        if is_conversation(value):
            return None
        if isinstance(value, str):
            return (f"the column {column!r} holds text, not conversations (lists of {{role, content}} turns): "
                    f"use --format text --text-column {column}, or --format pairs")
        if isinstance(value, list) and value and all(isinstance(m, dict) and {"from", "value"} <= m.keys()
                                                     for m in value):
            return (f"the column {column!r} holds turns of {{from, value}} (ShareGPT's), not {{role, content}}: rename "
                    f"the keys to role and content, and the roles 'human' and 'gpt' to 'user' and 'assistant'")
        return f"the column {column!r} holds {value!r:.60}, not a list of {{role, content}} turns with text content"
    if isinstance(value, str):
        return None
    if value and is_conversation(value):
        return (f"the column {column!r} holds conversations (lists of {{role, content}} turns), not text: use "
                f"--format chat --messages-column {column}")
    return f"the column {column!r} holds {value!r:.60}, not text: name a column of strings"
