"""Someone who can write into a --checkpoint-dir, and cannot touch the code (issue 28): one test per attack,
each on a real checkpoint from a real run. Nothing outside a checkpoint is read, no real checkpoint is
deleted, a save is not redirected, nothing hangs or blows up memory, and every refusal is one clear line.

Most attacks use one single-process mnist run (8 steps, checkpoints at 2, 4, 6 and 8); each tampers a copy
of its checkpoints and resumes it with `python recipes/mnist.py`. The attacks that end in "skipping checkpoint"
under --resume auto share one launch (a directory of ten attacked checkpoints, each skipped with its own line), and
so do the two attacks on rotation. A refusal (exit 2, one `error:` line, before training) is shown by one real launch
(test_a_compressed_torch_file_is_refused_before_loading); the others run mnist.py's main() in this process
(in_process.py: the exit code, what it printed, its exit handlers run), which spares an interpreter and the imports of
torch, accelerate and torchvision per refusal. The DCP attacks use the FSDP reference run of
test_checkpoint_resume.py. Every run is bounded (HANG_S).
"""

import hashlib
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from accelrun.checkpoint import safe_loading
from accelrun.checkpoint.layout import FORMAT_VERSION
from accelrun.checkpoint.resharding import NAME_SHOWN
from accelrun.checkpoint.train_state import readable_versions
from accelrun.checkpoint.untrusted import shown
from checkpoint_checks import check_loadable
from in_process import run_main
from launching import (
    CPU_SHIM,
    DATA_ARGS,
    FP32,
    REPO,
    TRAINING,
    check_exit,
    launch_environment,
    recipe_processes,
    run_command,
    skip_unless_ci,
    unknown_uid,
)
from run_checks import assert_refused
from tampering import deflated

pytestmark = pytest.mark.slow

HANG_S = 120  # a run that blocks on a FIFO would never end: each one must, well within this
SECRET = b"SENTINEL-SECRET-9f27c1"  # the content of a file outside the checkpoint that must never be read


def command(data_dir, out, *extra):
    """One process, 2 epochs of 4 steps, a checkpoint every 2 steps."""
    return [sys.executable, str(REPO / "recipes" / "mnist.py"), "--data", "synthetic", "--data-dir", str(data_dir),
            *DATA_ARGS, "--epochs", "2", "--batch-size", "500", "--log-every", "1", "--checkpoint-every", "2",
            "--output-dir", str(out), *extra]


@pytest.fixture(scope="module")
def written(data_dir, tmp_path_factory):
    """The checkpoint directory of a real run: step-00000002, 4, 6 and 8, all kept."""
    root = tmp_path_factory.mktemp("hostile")
    code, output = run_command(command(data_dir, root / "out", "--checkpoint-dir", str(root / "ckpt"),
                                       "--keep-last", "0"), timeout=300)
    assert code == 0, output[-3000:]
    assert sorted(os.listdir(root / "ckpt")) == [f"step-{n:08d}" for n in (2, 4, 6, 8)]
    return root / "ckpt"


def resume(data_dir, tmp_path, *extra, name="resumed", env=None):
    """(exit code, output) of a run with these flags; no recipe process may outlive it."""
    out = tmp_path / name
    code, output = run_command(command(data_dir, out, *extra), env=env, timeout=HANG_S)
    assert recipe_processes(str(out)) == [], "a recipe process outlived its run"
    return code, output


def refusal(data_dir, tmp_path, *extra, name="refused"):
    """(exit code, output) of a run with these flags that ends before training, through mnist.py's main() in this
    process (in_process.run_main): exit code, output and exit handlers as a process of its own gives them."""
    return run_main("mnist", command(data_dir, tmp_path / name, *extra)[2:], timeout=HANG_S)


def copy(written, tmp_path, *steps, name="ckpt"):
    """A copy of the given checkpoints in tmp_path/name."""
    root = tmp_path / name
    root.mkdir(mode=0o700)
    for step in steps:
        shutil.copytree(written / f"step-{step:08d}", root / f"step-{step:08d}")
    return root


def rehash(checkpoint, rel, drop=False):
    """What an attacker does after changing a file: the manifest made to match it (or to leave it out)."""
    manifest = json.loads((checkpoint / "checkpoint.json").read_text())
    if drop:
        del manifest["files"][rel]
    else:
        data = (checkpoint / rel).read_bytes()
        manifest["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "checkpoint.json").write_text(json.dumps(manifest))


def one_line(output, kind, words):
    """Exactly one `kind:` line holds `words`, and the recipe printed no traceback."""
    lines = [line for line in output.splitlines() if line.startswith(f"{kind}: ") and words in line]
    assert len(lines) == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def refused(code, output, words):
    """Exit 2 (the recipe's usage error) with one `error:` line, which holds `words`."""
    assert code == 2, output[-3000:]
    assert len([line for line in output.splitlines() if line.startswith("error: ")]) == 1, output[-3000:]
    one_line(output, "error", words)


# ---- 1. reading files outside the checkpoint (FSDP2's .metadata) ---------------------------------------------

def test_dcp_storage_paths_stay_inside_the_checkpoint(launch, reference, tmp_path):
    """A .metadata whose storage entries point at ../../outside/secret.pt (a copy of the real shard, so the load
    would succeed), at an absolute path, or 6e9 bytes into a listed file, its checksum updated: refused by name
    before any rank loads; the file outside is never read into the next checkpoint."""
    _, ckpt = reference("fsdp.yaml")
    work, rel = tmp_path / "step-00000015", "pytorch_model_fsdp_0/.metadata"
    shutil.copytree(ckpt / "step-00000015", work)
    outside = tmp_path / "outside" / "secret.pt"
    outside.parent.mkdir()
    outside.write_bytes((work / "pytorch_model_fsdp_0" / "__0_0.distcp").read_bytes() + SECRET)
    with open(work / rel, "rb") as f:
        metadata = safe_loading.safe_metadata_load(f)
    original = pickle.dumps(metadata)

    def plant(change):
        meta = pickle.loads(original)
        for info in meta.storage_data.values():
            if info.relative_path == "__0_0.distcp":
                change(info)
        (work / rel).write_bytes(pickle.dumps(meta))
        rehash(work, rel)

    plant(lambda info: setattr(info, "relative_path", "../../outside/secret.pt"))
    run = launch("fsdp.yaml", *TRAINING, "--resume", str(work), "--checkpoint-dir", str(tmp_path / "next"),
                 launch_args=FP32, check=False, timeout=HANG_S)
    assert run.returncode == 1, run.output[-3000:]
    assert_refused(run, f"{rel}: refused (it points a tensor at a file its checkpoint does not list)")
    assert recipe_processes(str(run.out_dir)) == [], "a recipe process outlived its run"
    assert not [p for p in (tmp_path / "next").rglob("*") if p.is_file() and SECRET in p.read_bytes()]
    assert not [p for p in tmp_path.rglob("step-*") if p != work]
    # The same pre-scan every rank runs, on the same real checkpoint: an absolute path, a length past the file.
    plant(lambda info: setattr(info, "relative_path", str(outside)))
    files = json.loads((work / "checkpoint.json").read_text())["files"]
    assert check_loadable(work, [rel], files) == (
        f"{rel}: refused (it points a tensor at a file its checkpoint does not list)")
    plant(lambda info: setattr(info, "length", 6 * 10 ** 9))
    files = json.loads((work / "checkpoint.json").read_text())["files"]
    assert check_loadable(work, [rel], files) == (
        f"{rel}: refused (it points a tensor past the end of pytorch_model_fsdp_0/__0_0.distcp)")


# ---- 2. losing every real checkpoint to rotation --------------------------------------------------------------

def another_engines(written, ckpt, step):
    """Step `step` of the same run's flags as FSDP2 (a full state dict, 1 process) would have written it: its files
    under FSDP's names (the model in torch's format, the buffers file), its manifest's layout FSDP's, every file
    rehashed. Only its engine tells it from this run's own checkpoints."""
    from safetensors.torch import load_file, save_file
    plant = ckpt / f"step-{step:08d}"
    shutil.copytree(written / "step-00000002", plant)
    torch.save(load_file(plant / "model.safetensors"), plant / "pytorch_model_fsdp.bin")
    (plant / "model.safetensors").unlink()
    save_file({"running_mean": torch.zeros(1)}, plant / "rank-0.buffers.safetensors")
    manifest = json.loads((plant / "checkpoint.json").read_text())
    manifest["step"] = manifest["train_state"]["step"] = step
    manifest["layout"] = {**manifest["layout"], "family": "fsdp", "zero_stage": None}
    manifest["files"] = {}
    (plant / "checkpoint.json").write_text(json.dumps(manifest))
    for rel in sorted(p.name for p in plant.iterdir() if p.name != "checkpoint.json"):
        rehash(plant, rel)


def test_rotation_deletes_only_this_runs_older_checkpoints_that_verify(written, reference, data_dir, tmp_path):
    """One directory, two attacks on rotation (--keep-last 2), one resume. Beside this run's steps 2, 4 and 6: empty
    step-99999998 and step-99999999, a step-00000001 link to someone's directory, a step 3 that FSDP2 wrote with the
    same flags (only its engine tells it apart: a mutation that let rotation count another engine's checkpoints
    survived the suite), FSDP's real step 5 (test_checkpoint_resume.py's reference run), and (M7) a planted step 9
    holding a copy of step 6's manifest (step 9) and no files. The run skips step 9 (one warning), resumes from step
    6, saves steps 7 and 8 (--checkpoint-every 1) and keeps them: it deletes 2, 4 and 6, unlinks the link and never
    touches what it points to, and leaves 3, 5, 9 and the look-alikes alone (one warning, once over its two
    rotations). It deleted the real checkpoints and kept the fake one, when the fake one counted."""
    ckpt = copy(written, tmp_path, 2, 4, 6)
    another_engines(written, ckpt, 3)
    _, fsdp = reference("fsdp.yaml")
    shutil.copytree(fsdp / "step-00000005", ckpt / "step-00000005")
    (ckpt / "step-00000009").mkdir()
    manifest = json.loads((ckpt / "step-00000006" / "checkpoint.json").read_text())
    manifest["step"] = manifest["train_state"]["step"] = 9
    (ckpt / "step-00000009" / "checkpoint.json").write_text(json.dumps(manifest))
    (ckpt / "step-99999998").mkdir()
    (ckpt / "step-99999999").mkdir()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "data.txt").write_bytes(SECRET)
    os.symlink(theirs, ckpt / "step-00000001")
    code, output = resume(data_dir, tmp_path, "--checkpoint-dir", str(ckpt), "--keep-last", "2",
                          "--checkpoint-every", "1")
    assert code == 0, output[-3000:]
    one_line(output, "warning", f"skipping checkpoint {ckpt / 'step-00000009'}: model.safetensors is missing")
    assert "resumed from " + str(ckpt / "step-00000006") in output
    assert sorted(os.listdir(ckpt)) == [f"step-{n:08d}" for n in (3, 5, 7, 8, 9, 99999998, 99999999)]
    one_line(output, "warning", f"left alone {ckpt / 'step-00000003'}, {ckpt / 'step-00000005'}, "
                                f"{ckpt / 'step-00000009'}, {ckpt / 'step-99999998'}, {ckpt / 'step-99999999'}: "
                                f"not a checkpoint")
    assert (theirs / "data.txt").read_bytes() == SECRET
    assert sorted(p.name for p in (ckpt / "step-00000005").rglob("*")) == sorted(
        p.name for p in (fsdp / "step-00000005").rglob("*"))


# ---- 3. files outside the manifest ------------------------------------------------------------------------------

def test_a_file_the_manifest_leaves_out_is_refused(written, data_dir, tmp_path):
    """random_states_0.pkl dropped from the manifest (so that it escaped the pre-scan): --resume PATH is one
    error naming it (--resume auto skips that checkpoint with one warning: test_each_damaged_or_planted_checkpoint_
    is_skipped_with_one_line)."""
    ckpt = copy(written, tmp_path, 4, 6)
    rehash(ckpt / "step-00000006", "random_states_0.pkl", drop=True)
    code, output = refusal(data_dir, tmp_path, "--resume", str(ckpt / "step-00000006"), name="explicit")
    refused(code, output, "random_states_0.pkl is not listed in its checkpoint.json")


def test_a_compressed_torch_file_is_refused_before_loading(written, data_dir, tmp_path):
    """optimizer.bin rewritten with compressed zip entries (a few MB can inflate to GB), its checksum updated. The
    file's refusal launched for real (the others run in this process): one line, exit 2, no process left behind."""
    ckpt = copy(written, tmp_path, 6)
    path = ckpt / "step-00000006" / "optimizer.bin"
    path.write_bytes(deflated(path.read_bytes()))
    rehash(ckpt / "step-00000006", "optimizer.bin")
    code, output = resume(data_dir, tmp_path, "--resume", str(ckpt / "step-00000006"))
    refused(code, output, "optimizer.bin: refused (its entries are compressed")


# ---- 4. special files: hangs and memory blow-ups ---------------------------------------------------------------

SPECIAL = {
    "fifo-manifest": ("checkpoint.json", "fifo", "checkpoint.json is a FIFO"),
    "fifo-weights": ("model.safetensors", "fifo", "model.safetensors is a FIFO"),
    "link-to-dev-zero": ("optimizer.bin", "/dev/zero", "optimizer.bin is a symbolic link"),
}


@pytest.mark.parametrize("case", list(SPECIAL))
def test_special_files_neither_hang_nor_blow_up(written, data_dir, tmp_path, case):
    rel, kind, words = SPECIAL[case]
    ckpt = copy(written, tmp_path, 6)
    target = ckpt / "step-00000006" / rel
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    else:
        os.symlink(kind, target)
    code, output = refusal(data_dir, tmp_path, "--resume", str(ckpt / "step-00000006"))
    refused(code, output, words)


def test_a_fifo_lock_is_one_message(data_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(mode=0o700)
    os.mkfifo(ckpt / ".lock")
    code, output = refusal(data_dir, tmp_path, "--checkpoint-dir", str(ckpt))
    refused(code, output, f"{ckpt / '.lock'} is not a lock file this code writes (a FIFO")


# ---- 5. a save that writes outside -----------------------------------------------------------------------------

def test_a_tmp_dir_swapped_during_the_save_is_not_published(written, data_dir, tmp_path):
    """While the save of step 8 writes (slowed by the test shim), its .tmp directory is renamed away and a link
    put in its place: the save is refused with one message, nothing is published, and no checkpoint file or
    manifest lands in the link's target."""
    ckpt = copy(written, tmp_path, 6)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    out = tmp_path / "swapped"
    # launch_environment: this tree's src/ first on the path (it ran the installed accelrun, another tree's)
    env = launch_environment({"PYTHONPATH": str(CPU_SHIM), "TEST_SLOW_SAVE_SECONDS": "4",
                              "TEST_SLOW_SAVE_MATCH": ".tmp-step-00000008"})
    proc = subprocess.Popen(command(data_dir, out, "--checkpoint-dir", str(ckpt), "--keep-last", "0"), cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("TEST-SHIM: slow save"):  # in .tmp-step-00000008.XXXXXXXX: a name of its own
                saving = line.split(" in ", 1)[1].strip()
                os.rename(saving, tmp_path / "moved")
                os.symlink(theirs, saving)
        proc.wait(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    output = "".join(lines)
    check_exit(output)
    assert "TEST-SHIM: slow save" in output, output[-3000:]
    refused(proc.returncode, output, "was replaced while this run wrote into it")
    assert recipe_processes(str(out)) == []
    assert not (ckpt / "step-00000008").exists()
    assert not {"checkpoint.json", "optimizer.bin", "model.safetensors"} & set(os.listdir(theirs))


def test_a_directory_others_can_write_is_refused(written, data_dir, tmp_path):
    """A --checkpoint-dir of this user's that everyone can write without the sticky bit, and (issue 52, attack 1) a
    shared 1777 one another user created, its owner having renamed this user's step 4 to a .tmp-step- name: each is
    one error naming what is wrong and what to do, exit 2, before anything is removed (the requeue deleted the
    renamed checkpoint as "a save that never finished" and trained from step 0)."""
    ckpt = copy(written, tmp_path, 6)
    ckpt.chmod(0o777)
    code, output = refusal(data_dir, tmp_path, "--checkpoint-dir", str(ckpt))
    refused(code, output, f"chmod go-w {ckpt}")
    assert sorted(os.listdir(ckpt)) == ["step-00000006"]
    needs_root()
    scratch = copy(written, tmp_path, 2, 4, name="scratch")
    os.rename(scratch / "step-00000004", scratch / ".tmp-step-00000004.aaaaaaaa")
    os.chown(scratch, ATTACKER, ATTACKER)
    scratch.chmod(0o1777)
    code, output = refusal(data_dir, tmp_path, "--checkpoint-dir", str(scratch), name="scratch-out")
    refused(code, output, f"--checkpoint-dir {scratch}: it is owned by uid {ATTACKER} (mode 1777), who may rename "
                          f"this run's entries there")
    assert "ACCELRUN_TRUST_SHARED_DIRS=1" in output and "removing" not in output
    assert sorted(os.listdir(scratch)) == [".tmp-step-00000004.aaaaaaaa", "step-00000002"]


# ---- 7. numpy from the allowlist -------------------------------------------------------------------------------

class _BadDtype:
    """A uint32 dtype whose pickled state carries a subarray: built only from allowlisted classes."""

    def __reduce__(self):
        import numpy as np
        return np.dtype, ("u4", False, True), (3, "<", (np.dtype("u4"), (1 << 20,)), None, None, -1, -1, 0)


def test_rng_state_with_a_crafted_numpy_dtype_is_refused(written, data_dir, tmp_path):
    ckpt = copy(written, tmp_path, 6)
    path = ckpt / "step-00000006" / "random_states_0.pkl"
    with safe_loading.weights_only_loading():
        states = torch.load(path)
    states["random_state"] = ("MT19937", _BadDtype(), 624, 0, 0.0)
    torch.save(states, path)
    rehash(ckpt / "step-00000006", "random_states_0.pkl")
    code, output = refusal(data_dir, tmp_path, "--resume", str(ckpt / "step-00000006"))
    refused(code, output, "random_states_0.pkl: refused (it holds a numpy dtype other than plain uint32/uint64)")


# ---- 8. manifests: every field checked, exactly the files the engine writes (issue 36: M1-M9) -----------------

def edit(checkpoint, change):
    """An attacker's edit of a checkpoint's manifest (change(manifest) edits it in place)."""
    manifest = json.loads((checkpoint / "checkpoint.json").read_text())
    change(manifest)
    (checkpoint / "checkpoint.json").write_text(json.dumps(manifest))


def renumbered(written, ckpt, step, source=8):
    """A copy of this run's step `source` (a complete checkpoint) as step `step`, its manifest saying so: the attacks
    below need more checkpoints newer than the one resumed than the run wrote."""
    plant = ckpt / f"step-{step:08d}"
    shutil.copytree(written / f"step-{source:08d}", plant)
    edit(plant, lambda m: (m.update(step=step), m["train_state"].update(step=step)))
    return plant


LATER = f"and this code reads format {readable_versions()} only (resume it with the code that wrote it)"
WHAT = "which a full save of 1 process(es) writes and a resume reads"


def test_each_damaged_or_planted_checkpoint_is_skipped_with_one_line(written, data_dir, tmp_path):
    """--resume auto over ten attacked checkpoints newer than this run's step 4, in one launch (ten: as many as a run
    names one by one, owners.SHOWN); each is skipped with one warning saying why, and the run resumes from step 4:
      * manifests of another type or range (issue 36, M1, M2, M9): train_state emptied (step 11), train_state.step
        "10" (step 10), layout.grad_accum "2" (step 9) (it tracebacked);
      * another format (issue 43, item 3): no format_version, as every checkpoint written before it was recorded
        (step 13), and format 4, a later one (step 12);
      * files its engine writes missing (M4, M5, M8): optimizer.bin (step 8) and model.safetensors (step 7) deleted
        and dropped from the manifest, a planted step 14 holding only a manifest (the empty one was chosen, then
        FileNotFoundError);
      * a file the manifest leaves out (step 6: random_states_0.pkl dropped from it, so that it escaped the pre-scan);
      * a manifest nested 100000 deep (step 5);
    and beside them a garbage .lock untouched for 10 minutes, taken over with one warning, and a .tmp-step-00000008
    planted as a link to someone's directory under the name of the run's save of step 8: the link is removed, never
    followed, the save succeeds, the directory it pointed to is untouched."""
    ckpt = copy(written, tmp_path, 2, 4, 6, 8)
    edit(renumbered(written, ckpt, 11), lambda m: m.update(train_state={}))
    edit(renumbered(written, ckpt, 10), lambda m: m["train_state"].update(step="10"))
    edit(renumbered(written, ckpt, 9), lambda m: m["layout"].update(grad_accum="2"))
    edit(renumbered(written, ckpt, 13), lambda m: m.pop("format_version"))
    edit(renumbered(written, ckpt, 12), lambda m: m.update(format_version=FORMAT_VERSION + 1))
    (ckpt / "step-00000008" / "optimizer.bin").unlink()
    rehash(ckpt / "step-00000008", "optimizer.bin", drop=True)
    missing = renumbered(written, ckpt, 7, source=6)
    (missing / "model.safetensors").unlink()
    rehash(missing, "model.safetensors", drop=True)
    (ckpt / "step-00000014").mkdir()
    manifest = json.loads((written / "step-00000008" / "checkpoint.json").read_text())
    manifest["step"] = manifest["train_state"]["step"] = 14
    (ckpt / "step-00000014" / "checkpoint.json").write_text(json.dumps({**manifest, "files": {}}))
    rehash(ckpt / "step-00000006", "random_states_0.pkl", drop=True)
    shutil.copytree(written / "step-00000004", ckpt / "step-00000005")
    (ckpt / "step-00000005" / "checkpoint.json").write_text("[" * 100000 + "]" * 100000)
    (ckpt / ".lock").write_text('{"host": "x", "pid": ' + str(2 ** 70) + "}")
    old = time.time() - 600
    os.utime(ckpt / ".lock", (old, old))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "data.txt").write_bytes(SECRET)
    os.symlink(theirs, ckpt / ".tmp-step-00000008")

    code, output = resume(data_dir, tmp_path, "--checkpoint-dir", str(ckpt), "--keep-last", "0")
    assert code == 0 and "Traceback" not in output, output[-3000:]
    skipped = {11: "its train_state lacks 'epoch'",
               10: "its train_state's step '10' is not of the type and range Run writes",
               9: "checkpoint.json: its layout's grad_accum '2' is not a number of micro-batches",
               13: f"checkpoint.json records no format_version: accelrun before format 1 wrote it, {LATER}",
               12: f"checkpoint.json records format_version {FORMAT_VERSION + 1}: another version of accelrun wrote "
                   f"it, {LATER}",
               14: f"checkpoint.json does not list random_states_0.pkl, {WHAT}",
               8: f"checkpoint.json does not list optimizer.bin, {WHAT}",
               7: f"checkpoint.json does not list model.safetensors, {WHAT}",
               6: "random_states_0.pkl is not listed",
               5: "unreadable checkpoint.json (nested"}
    for step, why in skipped.items():
        one_line(output, "warning", f"skipping checkpoint {ckpt / f'step-{step:08d}'}: {why}")
    one_line(output, "warning", f"taking over {ckpt / '.lock'}: its content is not a lock this code writes")
    assert "more entries in" not in output, output[-3000:]  # all ten named
    assert "resumed from " + str(ckpt / "step-00000004") in output
    assert sorted(os.listdir(theirs)) == ["data.txt"] and (theirs / "data.txt").read_bytes() == SECRET
    assert (ckpt / "step-00000008").is_dir() and not (ckpt / "step-00000008").is_symlink()


def test_a_checkpoint_of_another_format_version_given_by_path_is_refused(written, data_dir, tmp_path):
    """Issue 43, item 3: --resume naming a checkpoint whose manifest has no format_version (as every checkpoint
    written before it was recorded) is one error (under --resume auto it is skipped: the test above)."""
    named = copy(written, tmp_path, 8, name="named")
    edit(named / "step-00000008", lambda m: m.pop("format_version"))
    code, output = refusal(data_dir, tmp_path, "--resume", str(named / "step-00000008"), name="named-out")
    refused(code, output, f"checkpoint {named / 'step-00000008'} cannot be used: checkpoint.json records no "
                          f"format_version: accelrun before format 1 wrote it, {LATER}")


def test_a_checkpoint_without_its_rng_state_is_refused(written, data_dir, tmp_path):
    """M6: random_states_0.pkl deleted and dropped from the manifest: --resume PATH is one error (it resumed
    silently, without the RNG state: no longer exact)."""
    ckpt = copy(written, tmp_path, 6)
    (ckpt / "step-00000006" / "random_states_0.pkl").unlink()
    rehash(ckpt / "step-00000006", "random_states_0.pkl", drop=True)
    code, output = refusal(data_dir, tmp_path, "--resume", str(ckpt / "step-00000006"))
    refused(code, output, f"checkpoint {ckpt / 'step-00000006'} cannot be used: checkpoint.json does not list "
                          f"random_states_0.pkl")


# ---- 10. LoRA: the checkpoint holds exactly the adapters (L1, L3) --------------------------------------------

def test_a_lora_checkpoint_holds_exactly_the_adapters(lora, finetune, hf, tmp_path):
    """L1: the frozen base's embedding (zeros) added to step 6's model file; L3: every adapter removed from step 3's;
    each rehashed. Resumed by one process (the checkpoints are DDP's), each is one error naming the key, before any
    weight is loaded (both resumed silently: the base given by --model overridden, or the adapters left new)."""
    from safetensors.torch import load_file, save_file

    from launching import LORA

    lora("2gpu.yaml")
    written = hf / "ckpt-lora-2gpu.yaml"
    embedding = load_file(hf / "model" / "model.safetensors")["model.embed_tokens.weight"]
    cases = {6: ("frozen", "base_model.model.model.embed_tokens.weight",
                 "holds base_model.model.model.embed_tokens.weight, a weight of the frozen base model"),
             3: ("adapters", None, "lacks base_model.model.model.layers.0.mlp.down_proj.lora_A.default.weight, which "
                                   "this run trains")}
    for step, (name, key, words) in cases.items():
        work = tmp_path / name / f"step-{step:08d}"
        shutil.copytree(written / work.name, work)
        weights = load_file(work / "model.safetensors")
        weights = {**weights, key: torch.zeros_like(embedding)} if key else {
            k: v for k, v in weights.items() if ".lora_" not in k}
        save_file(weights, work / "model.safetensors")
        rehash(work, "model.safetensors")
        run = finetune("cpu.yaml", *LORA, "--resume", str(work), check=False)
        assert run.returncode == 1, run.output[-3000:]
        assert_refused(run, f"checkpoint {work} cannot be used: model.safetensors {words}")
        assert "resumed from" not in run.output
        assert recipe_processes(str(run.out_dir), "finetune_lm.py") == []


# ---- 11. DCP slices: bounded like torch zips, of the model's kind (D1, D4) ----------------------------------

def fsdp_copy(reference, tmp_path):
    """A copy of the FSDP reference run's step 15 (2 processes), and its model's .metadata as read back."""
    _, ckpt = reference("fsdp.yaml")
    work = tmp_path / "step-00000015"
    shutil.copytree(ckpt / "step-00000015", work)
    with open(work / "pytorch_model_fsdp_0" / ".metadata", "rb") as f:
        return work, safe_loading.safe_metadata_load(f)


def write_metadata(work, metadata):
    (work / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(metadata))
    rehash(work, "pytorch_model_fsdp_0/.metadata")


def resume_fsdp_on_one_process(launch, work, tmp_path):
    return launch("fsdp.yaml", *TRAINING, "--resume", str(work), "--checkpoint-dir", str(tmp_path / "next"),
                  launch_args=(*FP32, "--num_processes", "1"), check=False, timeout=HANG_S)


def test_a_compressed_dcp_slice_is_refused_before_loading(launch, reference, tmp_path):
    """D1: every slice of rank 0's model shard (__0_0.distcp) rewritten as a deflate-compressed torch zip, the
    .metadata's offsets and the checksums updated; resumed by 1 process (FSDP 2 -> 1): refused by name before
    loading (it loaded: a few MB can inflate to GB)."""
    work, metadata = fsdp_copy(reference, tmp_path)
    shard = work / "pytorch_model_fsdp_0" / "__0_0.distcp"
    data, packed = shard.read_bytes(), bytearray()
    for info in sorted((i for i in metadata.storage_data.values() if i.relative_path == "__0_0.distcp"),
                       key=lambda i: i.offset):
        compressed = deflated(data[info.offset:info.offset + info.length])
        info.offset, info.length = len(packed), len(compressed)
        packed += compressed
    shard.write_bytes(bytes(packed))
    rehash(work, "pytorch_model_fsdp_0/__0_0.distcp")
    write_metadata(work, metadata)
    run = resume_fsdp_on_one_process(launch, work, tmp_path)
    assert_refused(run, "pytorch_model_fsdp_0/__0_0.distcp: refused (a slice at 0: its entries are compressed")
    assert "resumed from" not in run.output and recipe_processes(str(run.out_dir)) == []


def test_a_dcp_entry_of_another_kind_is_one_error(launch, reference, tmp_path):
    """D4: the model's first tensor declared a bytes entry in .metadata (pointing at its first slice), rehashed;
    resumed by 1 process: one error naming it (a RuntimeError traceback)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    work, metadata = fsdp_copy(reference, tmp_path)
    fqn = "model.features.0.weight"
    first = next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)
    metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(fqn)] = first
    write_metadata(work, metadata)
    run = resume_fsdp_on_one_process(launch, work, tmp_path)
    assert_refused(run, f"checkpoint {work} cannot be loaded: its .metadata stores {fqn} as bytes, where this run "
                        f"has a tensor")
    assert "resumed from" not in run.output and recipe_processes(str(run.out_dir)) == []


# ---- 12. the universal conversion (U1, R1, R3): ZeRO-2, 2 processes -> 1 ---------------------------------------

def zero2_copy(shelf, shelf_data, tmp_path):
    """A copy of the ZeRO-2 gpt shelf run's step 4 (2 processes), under tmp_path/copy."""
    shelf("gpt", "deepspeed_zero2.yaml")
    work = tmp_path / "copy" / "step-00000004"
    shutil.copytree(shelf_data / "ckpt-gpt-deepspeed_zero2.yaml" / work.name, work)
    return work


def zero2_resume(shelf_data, data_dir, tmp_path, work):
    """(command, environment) of the gpt run that resumes `work` on 1 process, which converts it first."""
    from launching import launch_command, recipe_args
    return launch_command("deepspeed_zero2.yaml", data_dir, tmp_path / "resumed",
                          *recipe_args("gpt", "deepspeed_zero2.yaml", shelf_data), "--grad-accum", "2",
                          "--checkpoint-dir", str(tmp_path / "next"), "--resume", str(work),
                          launch_args=(*FP32, "--num_processes", "1"), recipe="recipes/gpt.py")


def run_acting(cmd, env, trigger, act):
    """(exit code, output) of a launch that calls act() when a line holds `trigger`; bounded, nothing left."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env, TEST_SLOW_CONVERT_SECONDS="5")
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if trigger in line:  # not always at a line's start: DeepSpeed's progress bar shares the line
                act()
        proc.wait(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    output = "".join(lines)
    check_exit(output)
    assert trigger in output, output[-3000:]
    assert recipe_processes(cmd[cmd.index("--output-dir") + 1], "gpt.py") == []
    return proc.returncode, output


def outside(tmp_path, *keep):
    """Every file under tmp_path but the checkpoint copy, the runs' own directories and `keep`."""
    mine = {tmp_path / name for name in ("copy", "next", "resumed", "resumed-deepspeed", *keep)}
    return sorted(p for p in tmp_path.rglob("*") if p.is_file() and not any(d in p.parents for d in mine))


def test_parameter_names_that_would_be_paths_are_refused(shelf, shelf_data, tmp_path):
    """U1: in the model states and both optimizer shards, one parameter renamed to an absolute path outside and one
    to ../../../../escaped, the manifest rehashed; resumed by 1 process: refused by name before the conversion
    writes anything (ds_to_universal joined the names into paths: directories and fp32.pt files outside)."""
    work = zero2_copy(shelf, shelf_data, tmp_path)
    names = {"wpe.weight": str(tmp_path / "outside" / "abs"), "blocks.0.ln1.weight": "../../../../escaped"}

    def renamed(group):
        return type(group)((names.get(k, k), v) for k, v in group.items())

    for rel in sorted(str(p.relative_to(work)) for p in (work / "pytorch_model").glob("*_states.pt")):
        with safe_loading.weights_only_loading():
            states = torch.load(work / rel)
        if "module" in states:
            states["module"] = renamed(states["module"])
            states["param_shapes"] = [renamed(group) for group in states["param_shapes"]]
        else:
            mappings = states["optimizer_state_dict"]["param_slice_mappings"]
            states["optimizer_state_dict"]["param_slice_mappings"] = [renamed(group) for group in mappings]
        torch.save(states, work / rel)
        rehash(work, rel)
    run = shelf("gpt", "deepspeed_zero2.yaml", "--grad-accum", "2", "--checkpoint-dir", str(tmp_path / "next"),
                "--resume", str(work), launch_args=(*FP32, "--num_processes", "1"), check=False)
    # The line shows a name's start, its repr cut to NAME_SHOWN characters (a temporary path under a pytest-xdist
    # worker is longer).
    assert_refused(run, f"checkpoint {work} cannot be used: pytorch_model/mp_rank_00_model_states.pt: refused (it "
                        f"names a parameter {shown(names['wpe.weight'], NAME_SHOWN)},")
    assert outside(tmp_path) == [] and not (tmp_path / "outside").exists()
    assert not (work / "universal").exists() and not (work / ".tmp-universal").exists()


def test_a_conversion_directory_swapped_for_a_link_receives_nothing(shelf, shelf_data, data_dir, tmp_path):
    """R1: while the conversion writes (paused by the test shim), .tmp-universal is renamed away and a link to
    someone's directory put in its place: nothing lands in that directory and nothing is published; one error (all
    41 converted files and a manifest were written into the link's target)."""
    work = zero2_copy(shelf, shelf_data, tmp_path)
    theirs = tmp_path / "theirs"
    theirs.mkdir()

    def swap():
        os.rename(work / ".tmp-universal", tmp_path / "moved")
        os.symlink(theirs, work / ".tmp-universal")

    code, output = run_acting(*zero2_resume(shelf_data, data_dir, tmp_path, work), "TEST-SHIM: slow conversion", swap)
    assert code == 1, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"{work / '.tmp-universal'} was replaced while this run wrote into it" in errors[0], \
        output[-3000:]
    assert os.listdir(theirs) == [] and not (work / "universal").exists()
    assert os.listdir(tmp_path / "moved") == []  # what the conversion wrote there is given back


def test_a_file_replaced_after_its_check_is_never_read(shelf, shelf_data, data_dir, tmp_path):
    """R3: after the checksums are verified, while the conversion runs, the model states file is replaced by a link
    to a file outside holding a secret (a model states file of its own): the conversion and the load read only the
    verified file, the run resumes, and one warning names the replaced file (the outside file was copied into
    universal/, recorded in its manifest, and the run resumed from it)."""
    work = zero2_copy(shelf, shelf_data, tmp_path)
    rel = "pytorch_model/mp_rank_00_model_states.pt"
    with safe_loading.weights_only_loading():
        states = torch.load(work / rel)
    theirs = tmp_path / "theirs" / "model_states.pt"
    theirs.parent.mkdir()
    torch.save({**states, "secret": torch.frombuffer(bytearray(SECRET), dtype=torch.uint8)}, theirs)

    def replace():
        (work / rel).unlink()
        os.symlink(theirs, work / rel)

    code, output = run_acting(*zero2_resume(shelf_data, data_dir, tmp_path, work), "TEST-SHIM: slow conversion",
                              replace)
    assert code == 0, output[-3000:]
    one_line(output, "warning", f"checkpoint {work} changed while this run read it: {rel} was replaced after it was "
                                f"verified")
    assert f"resumed from {work} (step 4" in output
    read = [p for root in (work / "universal", tmp_path / "next") for p in root.rglob("*") if p.is_file()
            and SECRET in p.read_bytes()]
    assert read == [] and (work / "universal" / "checkpoint.json").exists()


# ---- 13. a checkpoint of another recipe (issue 35, item 5) ------------------------------------------------

def test_another_recipes_checkpoint_is_named_before_the_model_loads(written, finetune, tmp_path):
    """mnist's checkpoint given to finetune_lm: one short line naming both recipes, before the model is loaded and
    the data tokenised (it was a line of 1,330 characters of settings, after 9-11 s of loading)."""
    ckpt = copy(written, tmp_path, 4)
    run = finetune("cpu.yaml", "--resume", str(ckpt / "step-00000004"), check=False)
    assert_refused(run, f"cannot resume from {ckpt / 'step-00000004'}: it was written by mnist.py, and this is "
                        f"finetune_lm.py. Give a checkpoint of finetune_lm.py, or another --checkpoint-dir.")
    errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert len(errors[0]) < 300, errors[0]
    # The run's first line comes after the model and data; datasets' "Map" bars show the tokenising.
    assert "stop with a checkpoint" not in run.output and "Map" not in run.output, run.output[-3000:]


def test_resume_given_the_checkpoint_directory_takes_its_newest(written, data_dir, tmp_path):
    """--resume given the directory of step-* checkpoints (the parent of step-*), as accelerate's load_state() and
    the trainers' resume flags take a directory (issue 35, item 6): the run resumes from its newest complete one,
    saying so, past a damaged newer one with one warning (it answered "no checkpoint.json: the save never
    finished")."""
    ckpt = copy(written, tmp_path, 2, 4, 6)
    with open(ckpt / "step-00000006" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    code, output = resume(data_dir, tmp_path, "--resume", str(ckpt))
    assert code == 0, output[-3000:]
    assert f"--resume {ckpt}: a directory of checkpoints; resuming from its newest complete one" in output
    one_line(output, "warning", f"skipping checkpoint {ckpt / 'step-00000006'}")
    assert f"resumed from {ckpt / 'step-00000004'} (step 4" in output


# ---- 14. another user beside this one in a shared directory with the sticky bit (issue 46) -----------------------

ATTACKER = unknown_uid()  # the other user of the shared directory; the suite runs as root, so it can plant as them


def needs_root():
    if os.geteuid() != 0:
        skip_unless_ci("needs root, to plant entries as another user")


def shared(written, tmp_path, *steps):
    """A directory of mode 1777 (docs/checkpoints.md: a shared directory) holding copies of this user's checkpoints."""
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o1777)
    for step in steps:
        shutil.copytree(written / f"step-{step:08d}", root / f"step-{step:08d}")
    return root


def as_attacker(path):
    """`path` and everything under it made the other user's, as if they had written it."""
    for p in [path, *path.rglob("*")]:
        os.lchown(p, ATTACKER, ATTACKER)


def attackers_checkpoint(written, root, step, zero=False):
    """A checkpoint that verifies, planted by the other user: their own run of the same public command (a copy of
    this user's step), its weights set to zero and rehashed when `zero`."""
    from safetensors.torch import load_file, save_file
    plant = root / f"step-{step:08d}"
    shutil.copytree(written / plant.name, plant)
    if zero:
        save_file({k: torch.zeros_like(v) for k, v in load_file(plant / "model.safetensors").items()},
                  plant / "model.safetensors")
        rehash(plant, "model.safetensors")
    as_attacker(plant)
    return plant


def live_lock(root):
    """A .lock of the other user's, naming a live process of this host (this test's), fresh: it never goes stale."""
    (root / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "job": None}))
    as_attacker(root / ".lock")


def snapshot(path):
    """{relative path: bytes} of every file under `path`: what must stay as it was."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def same_model(exported, checkpoint):
    """The exported model equals the checkpoint's, tensor for tensor (a resume is exact)."""
    from safetensors.torch import load_file
    mine, theirs = load_file(exported), load_file(checkpoint / "model.safetensors")
    return set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_another_users_checkpoints_and_lock_are_passed_over(written, data_dir, tmp_path):
    """In a shared directory (1777) with this user's steps 2 and 4, the other user plants checkpoints that verify:
    step 6 (weights zeroed), step 8 (the last step), a step-99999999 holding only a manifest of another recipe, and a
    live .lock of their own. Each is passed over with one line naming its owner; the run resumes its own step 4 (it
    resumed the attacker's step 6, or said "already complete" at step 8, or refused on gpt.py or the lock), trains to
    the uninterrupted run's exact weights, publishes its saves of steps 6 and 8 under names of their own (the plain
    names are the other user's, which it cannot remove), rotates only its own, and touches none of theirs."""
    needs_root()
    root = shared(written, tmp_path, 2, 4)
    attackers_checkpoint(written, root, 6, zero=True)
    attackers_checkpoint(written, root, 8)
    other = root / "step-99999999"
    other.mkdir()
    edit_to = json.loads((written / "step-00000008" / "checkpoint.json").read_text())
    (other / "checkpoint.json").write_text(json.dumps({**edit_to, "recipe": "gpt", "files": {}}))
    as_attacker(other)
    live_lock(root)
    before = {name: snapshot(root / name) for name in ("step-00000006", "step-00000008", "step-99999999")}
    code, output = resume(data_dir, tmp_path, "--checkpoint-dir", str(root), "--keep-last", "2")
    assert code == 0, output[-3000:]
    owner = f"belongs to uid {ATTACKER}, not to user root (uid 0): a run uses only its own user's files"
    for name in ("step-00000006", "step-00000008", "step-99999999"):
        one_line(output, "warning", f"skipping checkpoint {root / name}: it {owner}")
    one_line(output, "warning", f"{root / '.lock'} {owner}")
    assert f"resumed from {root / 'step-00000004'} (step 4" in output and "already complete" not in output
    assert same_model(tmp_path / "resumed" / "model.safetensors", written / "step-00000008")
    mine = sorted(p.name for p in root.iterdir() if p.name.startswith("step-") and p.stat().st_uid == 0)
    assert [name[:13] for name in mine] == ["step-00000006", "step-00000008"] and all(len(n) == 22 for n in mine)
    assert {name: snapshot(root / name) for name in before} == before
    assert (root / ".lock").stat().st_uid == ATTACKER and not [p for p in root.iterdir() if p.name.startswith(
        ".lock.")]


def test_a_directory_of_another_users_entries_only_is_a_fresh_start(data_dir, tmp_path):
    """The shared directory holds only the other user's entries: an empty step-00000001, 3,000 more empty step-*
    directories and a live .lock. --resume auto starts fresh (it refused: "none of the 1 checkpoint(s) can be
    used"), and the log names 10 of them and counts the rest in one line (100,000 entries made a 15 MB log)."""
    needs_root()
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o1777)
    for step in [1, *range(100000, 103000)]:
        (root / f"step-{step:08d}").mkdir()
        os.lchown(root / f"step-{step:08d}", ATTACKER, ATTACKER)
    live_lock(root)
    code, output = resume(data_dir, tmp_path, "--checkpoint-dir", str(root))
    assert code == 0, output[-3000:]
    assert "resumed from" not in output and len(output) < 20000, output[-3000:]
    assert len([line for line in output.splitlines() if f"uid {ATTACKER}" in line]) == 11, output[-3000:]
    one_line(output, "warning", f"skipping checkpoint 2991 more entries in {root} (the first 10 are named above)")


def test_another_users_checkpoint_given_by_path_is_one_error(written, data_dir, tmp_path):
    """--resume naming the other user's checkpoint: one error naming the owner, nothing loaded."""
    needs_root()
    plant = attackers_checkpoint(written, shared(written, tmp_path), 6)
    code, output = refusal(data_dir, tmp_path, "--resume", str(plant))
    refused(code, output, f"checkpoint {plant} cannot be used: checkpoint.json belongs to uid {ATTACKER}")
    assert "resumed from" not in output


# ---- 15. where results go: never where a manifest says (issue 46, item 2) ----------------------------------------

def test_results_go_where_this_run_says_not_where_a_manifest_says(written, data_dir, tmp_path):
    """The documented requeue (the same command, no --output-dir), on a directory whose newest checkpoint's manifest
    names `ckpt/.results/$(id>>PWNED)` as its output directory (no checksum changes: the manifest is not hashed),
    beside more planted entries: a step-99999999 holding a manifest of another recipe (it made every run exit 2),
    a checkpoint recording a 20 GiB optimizer.bin (a sparse file), and 100 step
    directories whose checkpoint.json is one 5 MB file hard-linked into each (10 of the 102 plants are named, the
    rest counted). The results go to the recipe's default directory, where the run's own run.json is; summary.json
    there, planted as a link to a file outside, is replaced, never written through; nothing carries the manifest's
    string; the big files are never hashed nor parsed."""
    work = tmp_path / "work"
    work.mkdir()
    ckpt = work / "ckpt"
    ckpt.mkdir(mode=0o700)
    for step in (2, 4):
        shutil.copytree(written / f"step-{step:08d}", ckpt / f"step-{step:08d}")
    evil = "ckpt/.results/$(id>>PWNED)"
    edit(ckpt / "step-00000004", lambda m: m["train_state"].update(output_dir=evil))
    run_id = json.loads((ckpt / "step-00000004" / "checkpoint.json").read_text())["train_state"]["run_id"]
    sparse = ckpt / "step-00000500"
    shutil.copytree(written / "step-00000006", sparse)
    with open(sparse / "optimizer.bin", "r+b") as f:
        f.truncate(20 << 30)
    edit(sparse, lambda m: m["files"]["optimizer.bin"].update(size=20 << 30))
    other = ckpt / "step-99999999"  # one mkdir and a manifest of another recipe: skipped, not a refusal of the run
    other.mkdir()
    (other / "checkpoint.json").write_text(json.dumps({**json.loads(
        (written / "step-00000008" / "checkpoint.json").read_text()), "recipe": "gpt", "files": {}}))
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"pad": "x" * (5 << 20)}))
    for step in range(100, 200):
        (ckpt / f"step-{step:08d}").mkdir()
        os.link(big, ckpt / f"step-{step:08d}" / "checkpoint.json")
    results = work / "runs" / "mnist" / "1proc"
    results.mkdir(parents=True)
    (results / "run.json").write_text(json.dumps({"run_id": run_id, "recipe": "mnist"}))
    bashrc = tmp_path / "bashrc"
    bashrc.write_bytes(SECRET)
    os.symlink(bashrc, results / "summary.json")
    cmd = command(data_dir, "unused", "--checkpoint-dir", "ckpt", "--keep-last", "0")
    del cmd[cmd.index("--output-dir"):cmd.index("--output-dir") + 2]
    code, output = run_command(cmd, cwd=work, timeout=HANG_S)
    assert code == 0, output[-3000:]
    assert f"resumed from {Path('ckpt') / 'step-00000004'} (step 4" in output
    one_line(output, "warning", "skipping checkpoint ckpt/step-00000500: its checkpoint.json records 21.5 GB of files, "
                                "more than a checkpoint of this model holds")
    one_line(output, "warning", "skipping checkpoint ckpt/step-99999999: checkpoint.json does not list")
    one_line(output, "warning", "skipping checkpoint ckpt/step-00000199: checkpoint.json is over 4 MB")
    one_line(output, "warning", "skipping checkpoint 92 more entries in ckpt (the first 10 are named above)")
    assert bashrc.read_bytes() == SECRET and not (results / "summary.json").is_symlink()
    summary = json.loads((results / "summary.json").read_text())
    assert summary["output_dir"] == "runs/mnist/1proc" and "$(" not in (results / "summary.json").read_text()
    assert not (ckpt / ".results").exists() and not list(work.rglob("PWNED"))
    assert same_model(results / "model.safetensors", written / "step-00000008")
