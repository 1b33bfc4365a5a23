"""accelrun.finetune.chunked_loss in this process (milliseconds): the loss computed in chunks through the output layer
against the plain loss, on a small random Llama whose vocabulary is larger than its width (as a real model's is).

The chunked loss must give the same per-sequence losses and the same gradient of every parameter as the plain one
(to float rounding: the losses to 1e-6 relative, each gradient to 1e-5 of its largest element; a position dropped
or taken twice, or a chunk's targets out of step with its rows, differ by far more), and never compute more than one
chunk's logits at a time.
"""

import copy

import pytest
import torch

from accelrun.finetune import chunked_loss as chunked
from accelrun.finetune.chunked_loss import IGNORE, install, token_losses, with_loss_count

VOCAB, WIDTH, LENGTH, BATCH = 1000, 32, 24, 3


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).float()


def batch(seed=1):
    """Token ids, and labels with a prompt of another length in each row (IGNORE) and one row ending in padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
    labels = ids.clone()
    for row, prompt in enumerate((5, 11, 2)):
        labels[row, :prompt] = IGNORE
    labels[2, LENGTH - 6:] = IGNORE
    return with_loss_count([{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)])


def targets_of(b):
    return chunked.next_token_targets(b["labels"])


def losses_and_grads(model, b, head, count):
    model.zero_grad()
    losses, tokens = token_losses(model, {"input_ids": b["input_ids"]}, targets_of(b), head, count)
    losses.sum().backward()
    return losses.detach(), tokens, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunks", [2, 3, 8, 1000])
@pytest.mark.parametrize("host_count", [True, False])
def test_chunked_loss_equals_the_plain_loss_and_its_gradients(model, chunks, host_count):
    b = batch()
    assert b["loss_count"] == int((b["labels"][:, 1:] != IGNORE).sum()) == sum((19, 13, 16))
    plain, plain_tokens, plain_grads = losses_and_grads(model, b, None, None)
    copied = copy.deepcopy(model)
    head = install(copied, chunks)
    assert head is copied.lm_head
    ours, tokens, grads = losses_and_grads(copied, b, head, b["loss_count"] if host_count else None)
    assert torch.equal(tokens, plain_tokens) and tokens.tolist() == [19, 13, 16]
    assert torch.allclose(ours, plain, rtol=1e-6, atol=0), (ours, plain)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():  # float rounding: sums in another order, 1e-7 to 1.5e-6 here
        worst = (grad - plain_grads[name]).abs().max() / plain_grads[name].abs().max()
        assert worst < 1e-5, (name, float(worst))
    assert grads["lm_head.weight"].abs().sum() > 0


def test_the_output_layer_sees_only_the_loss_positions_one_chunk_at_a_time(model, monkeypatch):
    """48 of 72 positions are in the loss: the output layer computes logits for those only, in chunks of at most
    ceil(48 / 5) = 10 rows, and the model's output is one loss per kept position, never [tokens x vocabulary]."""
    b, rows = batch(), []
    real = chunked._chunk_losses

    def watched(hidden, targets, weight, bias):
        rows.append(hidden.shape[0])
        return real(hidden, targets, weight, bias)
    monkeypatch.setattr(chunked, "_chunk_losses", watched)
    copied = copy.deepcopy(model)
    head = install(copied, 5)
    losses, _ = token_losses(copied, {"input_ids": b["input_ids"]}, targets_of(b), head, b["loss_count"])
    assert rows == [10, 10, 10, 10, 8]
    losses.sum().backward()  # each chunk's logits computed again in backward
    assert rows[:5] == [10, 10, 10, 10, 8] and sorted(rows[5:]) == [8, 10, 10, 10, 10]
    with torch.no_grad():  # without a job the layer computes logits as before (generation, the greedy answer)
        assert copied(input_ids=b["input_ids"]).logits.shape == (BATCH, LENGTH, VOCAB)


def test_the_plain_loss_stays_where_the_model_changes_its_logits(model):
    """--loss-chunks 1, and a model whose forward changes the logits after the output layer (Gemma 2's
    soft-capping): the plain loss, the layer untouched."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    assert install(copy.deepcopy(model), 1) is None
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                           final_logit_softcapping=30.0))
    assert install(gemma, 8) is None and not chunked.plain_head(gemma)
    assert chunked.plain_head(model)


# Issue 55, item 6: chunk sizes that do not divide the batch's 48 loss positions, so that rows and targets cut at
# other places than each other (tensor_split for chunk or split) change what each chunk holds and are seen here.
@pytest.mark.parametrize("chunk_tokens", [1, 7, 13, 47, 48, 8192])
def test_token_chunks_equal_the_plain_loss_and_its_gradients(model, chunk_tokens):
    """--loss-chunk-tokens N: chunks of at most N loss positions, the last one what is left; the losses and the
    gradients of the plain loss, as for the count form."""
    b = batch()
    plain, plain_tokens, plain_grads = losses_and_grads(model, b, None, None)
    copied = copy.deepcopy(model)
    head = install(copied, 1, chunk_tokens=chunk_tokens)
    assert head is copied.lm_head  # the token form installs even where one chunk holds the whole batch
    ours, tokens, grads = losses_and_grads(copied, b, head, b["loss_count"])
    assert torch.equal(tokens, plain_tokens)
    assert torch.allclose(ours, plain, rtol=1e-6, atol=0), (ours, plain)
    for name, grad in grads.items():
        worst = (grad - plain_grads[name]).abs().max() / plain_grads[name].abs().max()
        assert worst < 1e-5, (name, float(worst))


@pytest.mark.parametrize(("form", "sizes"), [((5, None), [10, 10, 10, 10, 8]), ((7, None), [7, 7, 7, 7, 7, 7, 6]),
                                             ((1, 7), [7, 7, 7, 7, 7, 7, 6]), ((1, 10), [10, 10, 10, 10, 8]),
                                             ((1, 13), [13, 13, 13, 9]), ((1, 48), [48]), ((1, 100), [48])])
def test_each_chunk_holds_what_its_form_says(model, monkeypatch, form, sizes):
    """The rows each chunk takes, 48 loss positions cut unevenly: the count form's N chunks are torch's chunk()
    (ceil(48 / N) each, the last what is left: tensor_split's [10, 10, 10, 9, 9] for 5 is another cut), the token
    form's are at most N positions each, in order."""
    b, rows = batch(), []
    real = chunked._chunk_losses

    def watched(hidden, targets, weight, bias):
        assert hidden.shape[0] == targets.shape[0]  # a chunk's rows and its targets cut at the same places
        rows.append(hidden.shape[0])
        return real(hidden, targets, weight, bias)
    monkeypatch.setattr(chunked, "_chunk_losses", watched)
    copied = copy.deepcopy(model)
    head = install(copied, form[0], chunk_tokens=form[1])
    with torch.no_grad():
        token_losses(copied, {"input_ids": b["input_ids"]}, targets_of(b), head, b["loss_count"])
    assert rows == sizes


def test_the_loss_position_count_leaves_out_each_rows_first_label():
    """with_loss_count: a row's first label is never a loss position (no token before it to predict it), so the
    count is that of labels[:, 1:]; rows whose first label is in the loss (plain text) show the difference."""
    ids = torch.arange(2 * 10).reshape(2, 10)
    labels = ids.clone()
    labels[1, 6:] = IGNORE  # one row ends in padding
    b = with_loss_count([{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)])
    assert b["loss_count"] == 9 + 5 == int((chunked.next_token_targets(b["labels"]) != IGNORE).sum())
