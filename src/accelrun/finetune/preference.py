"""Preference fine-tuning (DPO, recipes/dpo.py): the records, their sequences' log-probabilities, the reference and the
loss.

Owns:
  * the records (load_pairs): JSON Lines or a hub dataset with the columns prompt, chosen and rejected, each text or
    chat messages ({role, content} turns: the prompt's conversation, and the chosen and rejected assistant turns that
    follow it, rendered with the tokenizer's chat template). Read and checked through records.py: a record missing a
    field, or holding a value of the wrong kind, is named by its file and line; so is a prompt that leaves no room for
    a response in --block-size. A response longer than the room left is cut (counted, as finetune_lm's cuts);
  * each pair as two padded rows of --block-size tokens, the chosen and the rejected sequence, labels set by
    position: the prompt and the padding are IGNORE, the response (a chat's assistant turns after the prompt, with
    their end-of-turn tokens; a text response and its end-of-sequence token) is what the log-probability sums over;
    the pair's index in the data (the row of a precomputed reference) and the data's fingerprint (data_sha256: what a
    resumed run must share, checkpoint/rules.py);
  * the batches (collate): a micro-batch of B pairs is 2B rows, the B chosen first, so that a pair's two sequences are
    always in the same batch and on the same rank;
  * sequence_logps: each row's summed log-probability of its response tokens (chunked_loss.token_losses, negated);
  * the reference: the policy with its LoRA adapters disabled (peft's disable_adapter, no second model in memory),
    a full fine-tune's frozen copy of the model (frozen_copy_logps; dpo.py loads and shards it as the policy), or a
    table of every pair's reference log-probabilities computed once before training (precompute_reference);
  * the loss (dpo_losses): -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), per pair; rewards beta * (pi -
    ref); at the first step the policy is the reference and every loss is ln 2;
  * the step's reward figures (StepRewards), summed over the optimizer step's micro-batches and all ranks.

It makes collective calls only where named (precompute_reference, StepRewards.add, evaluate_pairs).
"""

import hashlib
import json
from typing import NamedTuple

from accelrun.exits import one_line

from .examples import MIN_EXAMPLES, assistant_positions, enough_characters
from .packing import IGNORE
from .records import DataProblem, data_reader, is_conversation, record_location, unreadable

FIELDS = ("prompt", "chosen", "rejected")


class Pairs(NamedTuple):
    """What load_pairs returns: training and held-out pairs (torch format, rows padded to the block), the format
    (text or chat), the source, the cut counts and the facts (train_pairs, data_sha256, response_tokens)."""
    train: object
    validation: object
    format: str
    source: str
    cuts: dict
    facts: dict


def add_preference_data_args(parser):
    parser.add_argument("--data-files", default=None,
                        help="local .jsonl/.json files or globs, comma-separated: records {prompt, chosen, rejected}, "
                             "each text, or chat messages ({role, content} turns)")
    parser.add_argument("--dataset", default=None, help="a hub dataset with those columns (needs internet)")
    parser.add_argument("--dataset-config", default=None, help="its configuration name")


def value_kind(column, value):
    """'text' or 'chat' for a record's value, or raise ValueError with what is wrong with it."""
    if isinstance(value, str) and value:
        return "text"
    if isinstance(value, list) and value and is_conversation(value):
        return "chat"
    if value is None:
        raise ValueError(f"it has no {column!r}; every record needs prompt, chosen and rejected")
    raise ValueError(f"its {column!r} holds {value!r:.60}, not text or a list of {{role, content}} turns")


def encode_record(tokenizer, record, block_size, enough):
    """(chosen (ids, labels), rejected (ids, labels), cut) of one record, each at most block_size long. Raises
    ValueError when the record cannot be a pair: a field missing or of another kind, a prompt leaving no room."""
    kinds = {value_kind(f, record[f]) for f in FIELDS}
    if len(kinds) > 1:
        raise ValueError("its prompt, chosen and rejected are not all text or all chat messages")
    if kinds == {"text"}:
        prompt = tokenizer(record["prompt"][:enough])["input_ids"]
        responses = [(prompt + tokenizer(record[f][:enough], add_special_tokens=False)["input_ids"]
                      + [tokenizer.eos_token_id], len(prompt)) for f in ("chosen", "rejected")]
        rows = [(ids, [True] * len(ids)) for ids, _ in responses]
        prompt_length = len(prompt)
    else:
        prompt_ids = tokenizer.apply_chat_template(record["prompt"], add_generation_prompt=True, tokenize=True)
        prompt_length = len(prompt_ids["input_ids"] if isinstance(prompt_ids, dict) else prompt_ids)
        rows = [assistant_positions(tokenizer, record["prompt"] + record[f]) for f in ("chosen", "rejected")]
    if prompt_length >= block_size:
        raise ValueError(f"its prompt is {prompt_length} tokens, which leaves no room for a response in --block-size "
                         f"{block_size}; give a larger --block-size or a shorter prompt")
    encoded = []
    for ids, learned in rows:
        labels = [t if keep and i >= prompt_length else IGNORE for i, (t, keep) in enumerate(zip(ids, learned))]
        encoded.append((ids[:block_size], labels[:block_size]))
    return encoded[0], encoded[1], any(len(ids) > block_size for ids, _ in rows)


def padded(ids, labels, block_size, pad):
    return ids + [pad] * (block_size - len(ids)), labels + [IGNORE] * (block_size - len(labels))


def load_pairs(args, tokenizer, block_size, eval_pairs):
    """The preference records the flags name, as padded pair rows, with eval_pairs held out. Raises DataProblem."""
    source, files, load = data_reader(args)
    try:
        raw = load()
    except Exception as exc:  # noqa: BLE001 - no network for the hub, a malformed file: one message
        raise DataProblem(unreadable(args, files, exc)) from None
    if missing := [f for f in FIELDS if f not in raw.column_names]:
        raise DataProblem(f"{source!r} has the columns {raw.column_names}, not {missing}: DPO reads records "
                          f"{{prompt, chosen, rejected}}")
    pad = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    enough = enough_characters(tokenizer, block_size)
    rows, kinds, cut = [], set(), 0
    for index, record in enumerate(raw):
        try:
            chosen, rejected, was_cut = encode_record(tokenizer, record, block_size, enough)
        except Exception as exc:  # noqa: BLE001 - a value of the wrong kind, a template that raises: its file and line
            said = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            raise DataProblem(f"{record_location(files, index)}: {one_line(said, limit=300)}") from None
        kinds.add("text" if isinstance(record["prompt"], str) else "chat")
        cut += was_cut
        (ci, cl), (ri, rl) = padded(*chosen, block_size, pad), padded(*rejected, block_size, pad)
        rows.append({"chosen_ids": ci, "chosen_labels": cl, "rejected_ids": ri, "rejected_labels": rl,
                     "index": index})
    if len(rows) < MIN_EXAMPLES:
        raise DataProblem(f"{source!r} gives only {len(rows)} preference pairs; give at least {MIN_EXAMPLES}")
    import datasets
    data = datasets.Dataset.from_list(rows)
    split = data.train_test_split(test_size=0.05, seed=args.seed)
    train, validation = split["train"], split["test"].select(range(min(len(split["test"]), eval_pairs)))
    digest = hashlib.sha256(json.dumps([r["chosen_ids"] + r["rejected_ids"] for r in rows]).encode()).hexdigest()
    response = sum(sum(t != IGNORE for t in r[k]) for r in rows for k in ("chosen_labels", "rejected_labels"))
    facts = {"train_pairs": len(train), "data_sha256": digest,
             "real_tokens_per_row": sum(sum(t != pad for t in r[k]) for r in rows for k in ("chosen_ids",
                                                                                          "rejected_ids"))
             / (2 * len(rows)), "response_tokens_per_row": response / (2 * len(rows))}
    return Pairs(train.with_format("torch"), validation.with_format("torch"), "/".join(sorted(kinds)), source,
                 {"pairs": len(rows), "cut_pairs": cut}, facts)


def collate(items):
    """A DataLoader's collate_fn: B pairs as 2B rows, the chosen first; with the pairs' indices and the batch's
    response positions counted on the CPU (chunked_loss's loss_count)."""
    import torch

    from .chunked_loss import LOSS_COUNT
    ids = torch.stack([i["chosen_ids"] for i in items] + [i["rejected_ids"] for i in items])
    labels = torch.stack([i["chosen_labels"] for i in items] + [i["rejected_labels"] for i in items])
    return {"input_ids": ids, "labels": labels, "index": torch.stack([i["index"] for i in items]),
            LOSS_COUNT: int((labels[:, 1:] != IGNORE).sum())}


def sequence_logps(model, batch, head):
    """Each row's summed log-probability of its response tokens, in fp32 (the negated summed next-token loss)."""
    from .chunked_loss import LOSS_COUNT, next_token_targets, token_losses
    losses, _ = token_losses(model, {"input_ids": batch["input_ids"]}, next_token_targets(batch["labels"]), head,
                             batch.get(LOSS_COUNT))
    return -losses


def disabled_adapter_logps(model, plain, batch, head):
    """The reference's log-probabilities: the policy's forward with its LoRA adapters disabled (plain: the unwrapped
    PEFT model, whose disable_adapter() the wrapped forward then follows), without gradient."""
    import torch
    with torch.no_grad(), plain.disable_adapter():
        return sequence_logps(model, batch, head)


def frozen_copy_logps(model, batch, head, autocast):
    """The reference's log-probabilities from a frozen copy of the model (a full fine-tune's), without gradient, its
    forward under `autocast()` (the mixed precision the policy's forward runs in, or a null context)."""
    import torch
    with torch.no_grad(), autocast():
        return sequence_logps(model, batch, head)


def dpo_losses(policy, reference, beta):
    """(each pair's loss, chosen rewards, rejected rewards) from the rows' log-probabilities (the B chosen first)."""
    import torch.nn.functional as F
    half = policy.shape[0] // 2
    chosen, rejected = beta * (policy[:half] - reference[:half]), beta * (policy[half:] - reference[half:])
    return -F.logsigmoid(chosen - rejected), chosen.detach(), rejected.detach()


def precompute_reference(reference, loaders, accelerator, size):
    """Collective: a table of every pair's reference log-probabilities (size rows of [chosen, rejected]), on every
    rank: each loader read once, reference(batch) giving its rows' values, gathered over the ranks."""
    import torch
    table = torch.full((size, 2), float("nan"), device=accelerator.device)
    with torch.no_grad():
        for loader in loaders:
            for batch in loader:
                values = reference(batch)
                half = values.shape[0] // 2
                index, rows = accelerator.gather_for_metrics((batch["index"], torch.stack(  # accelerate
                    [values[:half], values[half:]], dim=1)))
                table[index] = rows.float()
    return table


class StepRewards:
    """The rewards of an optimizer step: each micro-batch's pairs added (add), and at the step's last one the sums
    over all ranks (one small all-reduce per optimizer step) returned as the step's figures."""

    def __init__(self, accelerator):
        import torch
        self.accelerator, self.sums = accelerator, torch.zeros(4, device=accelerator.device)

    def add(self, chosen, rejected):
        """Collective at the step's last micro-batch: {} inside an accumulation, else the step's figures."""
        import torch
        self.sums += torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(),
                                  chosen.new_tensor(float(chosen.numel()))]).float()
        if not self.accelerator.sync_gradients:
            return {}
        c, r, right, n = self.accelerator.reduce(self.sums, "sum").tolist()
        self.sums.zero_()
        return figures(c, r, right, n)


def figures(chosen, rejected, right, n, prefix=""):
    n = max(n, 1)
    return {f"{prefix}reward_chosen": chosen / n, f"{prefix}reward_rejected": rejected / n,
            f"{prefix}reward_margin": (chosen - rejected) / n, f"{prefix}reward_accuracy": right / n}


def evaluate_pairs(model, loader, accelerator, reference, beta, head):
    """Collective: val_loss (the mean pair loss) and the rewards of the held-out pairs, gathered exactly over the
    ranks (gather_for_metrics drops the pairs repeated to fill the last batch)."""
    import torch
    model.eval()
    losses, chosen, rejected = [], [], []
    with torch.no_grad():
        for batch in loader:
            loss, c, r = dpo_losses(sequence_logps(model, batch, head), reference(batch), beta)
            loss, c, r = accelerator.gather_for_metrics((loss, c, r))  # accelerate
            for kept, value in zip((losses, chosen, rejected), (loss, c, r)):
                kept.append(value)
    model.train()
    loss, c, r = (torch.cat(x).double() for x in (losses, chosen, rejected))
    return {"val_loss": float(loss.mean()), **figures(float(c.sum()), float(r.sum()), float((c > r).sum()),
                                                      c.numel(), "val_")}


def write_toy_pairs(path, n=400, seed=0):
    """A learnable preference set for the CPU commands and the tests: whether a number is even, chosen the right
    answer and rejected the wrong one ('Question: is 37 even?' -> ' No.' over ' Yes.')."""
    import random
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            number = rng.randrange(1000)
            right, wrong = (" Yes.", " No.") if number % 2 == 0 else (" No.", " Yes.")
            f.write(json.dumps({"prompt": f"Question: is {number} even?\nAnswer:", "chosen": right,
                                "rejected": wrong}) + "\n")
    return path
