"""Where results go (accelrun/results.py), in-process and quick: the one rule, the claim at start-up, and files and
exported directories written without following a link. The attacks of issue 52 on a results folder others can write
(a link planted at the default directory, a file at runs/<recipe>, a runs/<recipe> of another user's that others can
write, two runs started together) run linear_regression.py's main() in this process (in_process.py), as another uid
where the real case is another user. The launches that hold the rule end to end: test_contract.py (a config per
directory, a continued run, a branch) and test_hostile_checkpoint_dir.py (a manifest naming an output directory)."""

import argparse
import json
import os
import sys

import pytest

from accelrun import results
from in_process import run_main
from launching import REPO, skip_unless_ci, unknown_uid

RUN, OTHER = "a" * 32, "b" * 32


def finished(directory, run_id=None):
    """A directory holding a run's results (and its run.json, when run_id is given)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "summary.json").write_text("{}")
    if run_id:
        (directory / "run.json").write_text(json.dumps({"run_id": run_id}))


def test_only_this_recipes_own_default_form_is_taken_from_a_checkpoint(tmp_path, monkeypatch):
    """A recorded output directory is a place to write only in the recipe's default form: relative, runs/<recipe>/
    <plain name>, no link on the way; an absolute path, '..', a shell expansion or a link is not."""
    monkeypatch.chdir(tmp_path)
    assert results.default_form("runs/mnist/ddp-2proc-2", "mnist")
    for recorded in ("/home/victim/runs/mnist/1proc", "/dev/null", "runs/mnist/../../x", "runs/mnist/$(id>>PWNED)",
                     "runs/gpt/1proc", "ckpt/.results/x", "runs/mnist/a/b", "", None, 7):
        assert not results.default_form(recorded, "mnist"), recorded
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "runs").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "runs" / "mnist")
    assert not results.default_form("runs/mnist/1proc", "mnist")


def test_a_run_never_writes_into_another_runs_results(tmp_path, monkeypatch):
    """The default directory taken by another run's results (or by results without run.json): the next free name,
    said in one line; --output-dir holding them: refused, naming the files and the way out; the same run (its id in
    run.json) writes on where it wrote; an empty directory is free, and one with only another run's run.json is that
run's (it claimed it at start-up: a run that ends without results gives its claim back, release)."""
    monkeypatch.chdir(tmp_path)
    place = "runs/mnist/1proc"
    assert results.choose(None, place, "mnist", RUN) == (place, None, None)
    finished(tmp_path / place, OTHER)
    finished(tmp_path / f"{place}-2")  # an older version's results: no run.json
    chosen, note, error = results.choose(None, place, "mnist", RUN)
    assert (chosen, error) == (f"{place}-3", None)
    assert note == (f"results: {place} holds another run's results (summary.json); this run writes {place}-3 (give "
                    f"--output-dir to choose)")
    assert results.choose(place, "x", "mnist", OTHER) == (place, None, None)
    _, _, error = results.choose(place, "x", "mnist", RUN)
    assert error == (f"--output-dir {place} holds another run's results (summary.json); this run would overwrite "
                     f"them. Give another --output-dir, or remove that one (rm -r {place}).")
    (tmp_path / "empty").mkdir()
    assert results.choose("empty", "x", "mnist", RUN) == ("empty", None, None)
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "run.json").write_text(json.dumps({"run_id": OTHER}))
    assert results.choose("fresh", "x", "mnist", RUN)[2] == (
        "--output-dir fresh is claimed by another run (its run.json, and no results yet: a run that is loading, or "
        "one killed before it wrote any). Give another --output-dir, or remove that one (rm -r fresh).")


def test_a_continued_run_stays_with_its_results_unless_another_run_took_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recorded, default = "runs/mnist/1proc", "runs/mnist/ddp-2proc"
    chosen, note, _ = results.choose(None, default, "mnist", RUN, recorded)
    assert chosen == recorded and note.startswith(f"results: in {recorded}, with the run this checkpoint comes from")
    finished(tmp_path / recorded, OTHER)
    assert results.choose(None, default, "mnist", RUN, recorded)[0] == f"{recorded}-2"
    assert results.choose(None, default, "mnist", RUN, "/abs/runs/mnist/1proc") == (default, None, None)


def test_result_files_replace_a_planted_link_and_never_write_through_it(tmp_path):
    outside = tmp_path / "bashrc"
    outside.write_text("kept")
    for name in ("summary.json", "metrics.jsonl", "model.safetensors"):
        os.symlink(outside, tmp_path / name)
    results.write_file(str(tmp_path / "summary.json"), "{}")
    with results.open_log(str(tmp_path / "metrics.jsonl"), ["a\n"]) as f:
        f.write("b\n")
    results.written_by(str(tmp_path / "model.safetensors"), lambda name: open(name, "w").write("weights"))
    assert outside.read_text() == "kept"
    for name, text in (("summary.json", "{}"), ("metrics.jsonl", "a\nb\n"), ("model.safetensors", "weights")):
        assert not (tmp_path / name).is_symlink() and (tmp_path / name).read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bashrc", "metrics.jsonl", "model.safetensors",
                                                           "summary.json"]


# ---- issue 52: the claim at start-up, and a results folder others can write ---------------------------------------

LR = ["--num-points", "64", "--epochs", "1"]  # linear_regression.py: 2 steps, a second in this process
DEFAULT = "runs/linear_regression/1proc"




def needs_root():
    if os.geteuid() != 0:
        skip_unless_ci("needs root, to plant entries as another user")


def refused_in_one_line(code, output, line):
    """Exit 2 with `line` as the one error line, no traceback."""
    assert code == 2 and f"error: {line}" in output and "Traceback" not in output, output[-3000:]
    assert len([text for text in output.splitlines() if text.startswith("error:")]) == 1, output[-3000:]


def test_two_runs_started_together_claim_two_directories(tmp_path, monkeypatch):
    """Attack 3: two runs of a sweep started together both chose runs/mnist/1proc, claimed it only after loading, and
    one's results were lost. The claim is made at once with exclusive creation: of two claims in a row for the same
    default, the second takes 1proc-2 and says why; each directory's run.json names its own run."""
    monkeypatch.chdir(tmp_path)
    place = "runs/mnist/1proc"
    assert results.choose(None, place, "mnist", RUN) == (place, None, None)
    assert results.choose(None, place, "mnist", OTHER) == (
        f"{place}-2", f"results: {place} is claimed by another run (its run.json, and no results yet: a run that is "
                      f"loading, or one killed before it wrote any); this run writes {place}-2 (give --output-dir to "
                      f"choose)", None)
    assert results.holder(place) is None and results._read_mark(f"{place}/run.json") == RUN
    assert results._read_mark(f"{place}-2/run.json") == OTHER
    assert results.choose(None, place, "mnist", RUN) == (place, None, None)  # its own claim: the same run again


def test_the_next_free_name_is_checked_until_free(tmp_path, monkeypatch):
    """Three taken names (another run's results, an older version's results without run.json, another run's
    results again): the fourth, every name checked, not only the first after the default."""
    monkeypatch.chdir(tmp_path)
    place = "runs/mnist/1proc"
    finished(tmp_path / place, OTHER)
    finished(tmp_path / f"{place}-2")
    finished(tmp_path / f"{place}-3", OTHER)
    chosen, note, error = results.choose(None, place, "mnist", RUN)
    assert (chosen, error) == (f"{place}-4", None) and note.endswith(f"this run writes {place}-4 (give --output-dir "
                                                                     f"to choose)")
    assert sorted(os.listdir(tmp_path / f"{place}-3")) == ["run.json", "summary.json"]


def test_output_dir_over_results_without_run_json_is_refused(tmp_path, monkeypatch):
    """Results an older version wrote (no run.json) are another run's: --output-dir over them is refused, by this
    rule alone (nothing else about the directory is wrong), and nothing in it is changed."""
    monkeypatch.chdir(tmp_path)
    finished(tmp_path / "old")
    assert results.choose("old", "x", "mnist", RUN) == (None, None, (
        "--output-dir old holds another run's results (summary.json); this run would overwrite them. Give another "
        "--output-dir, or remove that one (rm -r old)."))
    assert sorted(os.listdir(tmp_path / "old")) == ["summary.json"]


def test_a_claim_left_without_results_is_given_back(tmp_path, monkeypatch):
    """A run refused after start-up leaves no name taken: its run.json goes, and the directory when the run made it;
    a directory with results, or another run's claim, stays."""
    monkeypatch.chdir(tmp_path)
    assert results.choose(None, "runs/mnist/1proc", "mnist", RUN)[0] == "runs/mnist/1proc"
    results.release("runs/mnist/1proc", OTHER, made=True)  # not its claim: kept
    assert os.listdir("runs/mnist/1proc") == ["run.json"]
    results.release("runs/mnist/1proc", RUN, made=True)
    assert os.listdir("runs/mnist") == []
    finished(tmp_path / "done", RUN)
    results.release("done", RUN, made=True)
    assert sorted(os.listdir("done")) == ["run.json", "summary.json"]


def test_an_output_dir_that_is_a_file_or_a_device_is_one_line(tmp_path, monkeypatch):
    """Issue 52, item 6: --output-dir naming a file or /dev/null ended in FileExistsError after loading; now one
    line at start-up, from the recipe too."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("kept")
    assert results.choose("notes.txt", "x", "mnist", RUN)[2] == (
        "--output-dir notes.txt: it is a file (owned by user root (uid 0)), not a directory, so results cannot go "
        "there. Give --output-dir a directory of your own.") or os.geteuid() != 0
    code, output = run_main("linear_regression", [*LR, "--output-dir", "/dev/null"])
    refused_in_one_line(code, output, "--output-dir /dev/null: it is a device (owned by ")
    assert (tmp_path / "notes.txt").read_text() == "kept" and not (tmp_path / "runs").exists()


def test_a_link_planted_at_the_default_directory_is_never_written_through(tmp_path, monkeypatch):
    """Attack 2a: another user planted runs/<recipe>/1proc -> the victim's home, and the victim's plain run wrote its
    results there. The default directory holding a link is refused at start-up, whoever made the link, in one line
    that names its owner; nothing is written where it points."""
    needs_root()
    attacker = unknown_uid()
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("kept")
    monkeypatch.chdir(tmp_path)
    os.makedirs("runs/linear_regression")
    os.symlink(home, DEFAULT)
    os.lchown(DEFAULT, attacker, attacker)
    code, output = run_main("linear_regression", LR)
    refused_in_one_line(code, output, f"results {DEFAULT}: it is a symbolic link (owned by uid {attacker}, to "
                                      f"{str(home)!r}), and results are never written through a link.")
    assert os.listdir(home) == [".bashrc"] and (home / ".bashrc").read_text() == "kept"


def test_a_file_at_the_recipes_results_folder_is_one_line(tmp_path, monkeypatch):
    """Attack 5: `touch runs/<recipe>` by another user made every default run end in a NotADirectoryError traceback
    after loading (the victim cannot remove it): now one line at start-up naming it and its owner."""
    needs_root()
    attacker = unknown_uid()
    monkeypatch.chdir(tmp_path)
    os.mkdir("runs")
    (tmp_path / "runs" / "linear_regression").touch()
    os.chown("runs/linear_regression", attacker, attacker)
    code, output = run_main("linear_regression", LR)
    refused_in_one_line(code, output, f"results {DEFAULT}: runs/linear_regression is a file (owned by uid {attacker}),"
                                      f" not a directory, so results cannot go under it. Give --output-dir a "
                                      f"directory of your own.")


def test_a_results_folder_another_user_owns_and_others_can_write_is_refused_at_start_up(tmp_path, monkeypatch):
    """Attack 2b, at start-up: another user owns runs/<recipe> (mode 1777, so the victim can write into it), and
    swapped the victim's output directory during training for one with links where the export writes. Refused
    before anything loads (trust.py: the sticky bit does not bind a directory's owner); no directory is made."""
    needs_root()
    attacker = unknown_uid()
    monkeypatch.chdir(tmp_path)
    os.makedirs("runs/linear_regression")
    os.chmod("runs/linear_regression", 0o1777)
    os.chown("runs/linear_regression", attacker, attacker)
    code, output = run_main("linear_regression", LR)
    refused_in_one_line(code, output, f"results {DEFAULT}: {tmp_path}/runs/linear_regression is owned by uid "
                                      f"{attacker} (mode 1777), who may rename this run's entries there")
    assert os.listdir("runs/linear_regression") == []


def test_the_export_never_writes_through_links_in_the_output_directory(tmp_path):
    """Attack 2b, the export itself: the output directory's adapter/ held links at adapter_config.json, the
    tokenizer's file and base_model.json to the victim's files, and PEFT's save_pretrained, the tokenizer's and
    record_base wrote through them. finetune_lm's export writes each directory into a private temporary directory
    (mode 0700) and renames it into place: the victim's files are untouched, the links gone, nothing else left."""
    import finetune_lm

    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    (out / "adapter").mkdir(parents=True)
    for name in ("adapter_config.json", "tokenizer.json", "base_model.json"):
        (home / name).write_text("kept")
        os.symlink(home / name, out / "adapter" / name)

    class Writes:  # what save_pretrained does: open() a name in the directory it is given
        def __init__(self, name):
            self.name = name

        def save_pretrained(self, directory, **kwargs):
            with open(os.path.join(directory, self.name), "w") as f:
                f.write("new")

    accelerator = argparse.Namespace(unwrap_model=lambda model, keep_torch_compile: model)
    args = argparse.Namespace(lora_r=8, merge_lora=False, model="base", load_in_4bit=False)
    written = finetune_lm.export({}, Writes("adapter_config.json"), accelerator, Writes("tokenizer.json"), args,
                                 str(out), base_weights="sha256:" + "a" * 64)
    assert written == str(out / "adapter")
    assert all((home / name).read_text() == "kept" for name in os.listdir(home))
    adapter = out / "adapter"
    assert not adapter.is_symlink() and adapter.stat().st_mode & 0o777 == 0o777 & ~_umask()
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "base_model.json", "tokenizer.json"]
    assert not any((adapter / name).is_symlink() for name in os.listdir(adapter))
    assert json.loads((adapter / "base_model.json").read_text())["base_model"] == "base"
    assert os.listdir(out) == ["adapter"]  # no temporary directory left


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("recipe", ["pi", "data_sharding"])
def test_the_demos_never_write_through_a_link_at_their_output_dir(recipe, tmp_path, capsys):
    """pi.py and data_sharding.py keep no Run, but write summary.json the same way: a link planted at their
    --output-dir is refused in one line before anything runs (it was followed), and the file is written by rename."""
    sys.path.insert(0, str(REPO / "recipes"))  # the recipe's own parse_args
    module = __import__(recipe)
    elsewhere = tmp_path / "victim"
    elsewhere.mkdir()
    (tmp_path / "out").symlink_to(elsewhere)
    with pytest.raises(SystemExit) as exit_code:
        module.parse_args(["--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_code.value.code == 2 and "is a symbolic link" in err and len(err.strip().splitlines()) == 1, err
    assert list(elsewhere.iterdir()) == []
    assert module.parse_args(["--output-dir", str(tmp_path / "plain")]).output_dir == str(tmp_path / "plain")
