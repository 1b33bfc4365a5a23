"""A --model directory is untrusted (shared storage): loading it never runs its code, and each problem it can hold
ends in one line before transformers allocates or loads anything (src/accelrun/finetune/). Issue 46, item 4.

Quick: each problem planted into a copy of accelrun.data.tiny_hf's model (helpers/planted.py) and read by the functions
finetune_lm.py calls, in this process; custom code with a terminal that answers "y" to any question.
The run that shows the line as the recipe prints it: test_finetune_lm.py's test_each_input_error_is_one_clear_message.
Also LoRA's base: the fingerprint that tells one model's weights from another's (issue 41, item 2), and the resume
rule that refuses a LoRA checkpoint on another base when nothing else differs (issue 52, item 7). Issue 52, item 6: a
shard index that is not one and a shard that is a FIFO, each one line within seconds.
"""

import json
import os
import shutil
import signal
import sys

import pytest

from accelrun.data.tiny_hf import write_all, write_model, write_tokenizer
from accelrun.finetune.pretrained import load_config_and_tokenizer
from accelrun.finetune.weights import WeightsProblem, check_base, fingerprint, record_base
from launching import REPO
from planted import planted_copy

HANG_S = 20  # opening a FIFO blocks until a writer comes: a check that opens one would never end


class Hung(Exception):
    pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_all(tmp_path_factory.mktemp("tiny_model_dir"))


@pytest.mark.parametrize("problem, words", [
    ("pickle", "pytorch_model.bin holds a pickle that would run code, refused by weights-only loading (Unsupported "
               "global: GLOBAL print); use a model saved as safetensors"),
    ("header", "model.safetensors is not a safetensors file this code reads: its header claims 4611686018427387904 "
               "bytes in a file of"),
    ("vocab", "its config.json describes a model of 64,000,018,592 parameters (vocab_size 1000000000, hidden_size 32, "
              "num_hidden_layers 2) and its weight files hold 39,072 values: they do not belong together"),
])
def test_each_weight_file_problem_is_one_line_before_anything_loads(tiny, tmp_path, problem, words, capsys):
    """A .bin weight file whose pickle would run code (weights-only refused it, then a traceback), a safetensors
    header of 2**62 bytes (a traceback), vocab_size 10**9 in config.json (128 GB allocated before any check): each
    is the one line load_config_and_tokenizer returns, before the Accelerator, the data or the weights."""
    model = planted_copy(tiny / "model", tmp_path / problem, problem)
    config, n_params, tokenizer, error = load_config_and_tokenizer(str(model))
    assert error is not None and error.startswith(f"--model {model}: ") and words in error, error
    assert "\n" not in error and "PLANTED" not in capsys.readouterr().out
    assert load_config_and_tokenizer(str(tiny / "model"))[3] is None  # the untouched model passes


def test_a_model_directory_never_runs_its_code_even_after_a_yes(tiny, tmp_path, monkeypatch):
    """Issue 46, item 5: tokenizer_config.json's auto_map naming the directory's own evil.py made transformers ask
    "Do you wish to run the custom code? [y/N]" on the terminal, and a "y" ran it. trust_remote_code=False is given
    to every transformers call: here a terminal that answers "y" to any question is never asked, the code never ran
    (it would have written the marker file), and the refusal is one line."""
    import builtins
    marker = tmp_path / "ran"
    model = planted_copy(tiny / "model", tmp_path / "remote-code", "remote-code", marker=marker)
    asked = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": asked.append(prompt) or "y")
    error = load_config_and_tokenizer(str(model))[3]
    assert asked == [] and not marker.exists(), asked
    assert error.startswith(f"--model {model}: it asks to run its own code (auto_map in config.json or "
                            f"tokenizer_config.json), which this recipe never does"), error


def test_the_fingerprint_tells_two_models_apart_and_an_adapter_checks_its_base(tiny, tmp_path):
    """Issue 41, item 2: LoRA's checkpoints and adapter hold no base weights, so they record the base's fingerprint:
    the same for a copy of the directory, another for a model of the same shapes with other weights, from headers
    and a few windows of each tensor. check_base, which the documented adapter snippet calls, refuses another base."""
    import shutil

    base = tiny / "model"
    copy = shutil.copytree(base, tmp_path / "copy")
    other = tmp_path / "other"
    write_model(other, write_tokenizer(other, ["Question: what is 1 plus 1?"]), seed=1)
    assert fingerprint(base) == fingerprint(copy) != fingerprint(other)
    assert fingerprint(base).startswith("sha256:") and fingerprint(tmp_path) is None  # no weight files: none
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    record_base(adapter, str(base), fingerprint(base))
    check_base(adapter, str(copy))  # the same weights elsewhere: accepted
    shutil.copy(other / "model.safetensors", copy / "model.safetensors")  # the directory's weights replaced
    with pytest.raises(WeightsProblem) as refused:
        check_base(adapter, str(copy))
    assert str(refused.value).startswith(f"{copy} does not hold the weights the adapter in {adapter} was trained on")


@pytest.mark.parametrize("index, words", [
    ('{"weight_map": ', "model.safetensors.index.json is not JSON: give the index save_pretrained wrote"),
    ('["model.safetensors"]', "model.safetensors.index.json is not a JSON object with a weight_map"),
    ('{"weight_map": {"lm_head.weight": 7}}', "model.safetensors.index.json's weight_map is not a table of tensor "
                                              "names to shard file names"),
    ('{"weight_map": {"lm_head.weight": ["a"]}}', "model.safetensors.index.json's weight_map is not a table"),
    ('{"weight_map": {"lm_head.weight": "../model.safetensors"}}', "names a shard outside the model directory"),
])
def test_a_shard_index_that_is_not_one_is_one_line(tiny, tmp_path, index, words):
    """Issue 52, item 6: an index that is not JSON, a list, or shard names that are not strings ended in
    JSONDecodeError, AttributeError or TypeError; each is the one line load_config_and_tokenizer returns."""
    model = shutil.copytree(tiny / "model", tmp_path / "model")
    (model / "model.safetensors.index.json").write_text(index)
    error = load_config_and_tokenizer(str(model))[3]
    assert error is not None and error.startswith(f"--model {model}: ") and words in error and "\n" not in error, error


def test_a_shard_that_is_a_fifo_is_one_line_and_never_hangs(tiny, tmp_path):
    """Issue 52, item 6: a shard that is a FIFO hung the run silently before anything started. Shards are opened as
    checkpoint files are (O_NONBLOCK, then a regular file from the descriptor): one line, at once; the fingerprint
    LoRA records refuses it too."""
    model = shutil.copytree(tiny / "model", tmp_path / "model")
    os.mkfifo(model / "model-00002-of-00002.safetensors")
    os.rename(model / "model.safetensors", model / "model-00001-of-00002.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))

    def hung(signum, frame):  # not an OSError, which the check would take for a file it cannot read
        raise Hung(f"still reading the model directory after {HANG_S} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(HANG_S)
    try:
        error = load_config_and_tokenizer(str(model))[3]
        with pytest.raises(WeightsProblem, match="is a FIFO, not a weight file"):
            fingerprint(model)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert error == (f"--model {model}: {model}/model-00002-of-00002.safetensors is a FIFO, not a weight file: give a "
                     f"directory written by save_pretrained, as it wrote it"), error


def test_a_lora_checkpoint_on_a_base_whose_weights_alone_changed_is_refused(tiny, tmp_path):
    """Issue 52, item 7: the launch that holds this rule (test_finetune_lm.py) also changes --max-steps. Here nothing
    but the base's weights changes: finetune_lm's own flags and the fingerprint its run records, before and after
    another model's weights replaced the file at the same path; the resume rule refuses it, and only for that."""
    sys.path.insert(0, str(REPO / "recipes"))  # the recipe's own parse_args: its flags, as a run gets them
    import finetune_lm
    from accelrun.checkpoint.rules import incompatibility, must_match_settings
    base = shutil.copytree(tiny / "model", tmp_path / "base")
    args = finetune_lm.parse_args(["--model", str(base), "--lora-r", "8", "--max-steps", "3"])
    facts = {"train_examples": 40, "data_source": "pairs.jsonl"}
    saved = must_match_settings(args, finetune_lm.AFTER_TRAINING, {**facts, "base_weights": fingerprint(base)})
    other = tmp_path / "other"
    write_model(other, write_tokenizer(other, ["Question: what is 1 plus 1?"]), seed=1)
    shutil.copy(other / "model.safetensors", base / "model.safetensors")
    now = must_match_settings(args, finetune_lm.AFTER_TRAINING, {**facts, "base_weights": fingerprint(base)})
    assert {k for k in saved if saved[k] != now[k]} == {"base_weights"}
    layout = {"family": "full", "zero_stage": None, "world_size": 1, "grad_accum": 1}
    manifest = {"layout": layout, "must_match": saved}
    assert incompatibility(manifest, layout, now).startswith(
        f"its LoRA adapters were trained on other base weights than --model {base} holds now (fingerprint "
        f"{saved['base_weights'][:19]}, now {now['base_weights'][:19]})")
    assert incompatibility(manifest, layout, saved) is None
