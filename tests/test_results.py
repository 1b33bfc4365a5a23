"""Where results go (accelrun/results.py), in-process and quick: the one rule, and files written without following a
link. The launches that hold it end to end: test_contract.py (a config per directory, a continued run, a branch) and
test_hostile_checkpoint_dir.py (a manifest naming an output directory)."""

import json
import os

from accelrun import results

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
    run.json) writes on where it wrote; a directory with only run.json (a run that ended before writing) is free."""
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
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "run.json").write_text(json.dumps({"run_id": OTHER}))
    assert results.choose("fresh", "x", "mnist", RUN) == ("fresh", None, None)


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
