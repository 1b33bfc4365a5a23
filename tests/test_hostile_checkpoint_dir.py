"""Someone who can write into a --checkpoint-dir, and cannot touch the code (issue 28): one test per attack,
each on a real checkpoint from a real run. Nothing outside a checkpoint is read, no real checkpoint is
deleted, a save is not redirected, nothing hangs or blows up memory, and every refusal is one clear line.

Most attacks use one single-process mnist run (8 steps, checkpoints at 2, 4, 6 and 8); each tampers a copy
of its checkpoints and resumes it with `python recipes/mnist.py`, which stops at the resume for a refusal.
The DCP attacks use the FSDP reference run of test_checkpoint_resume.py. Every run is bounded (HANG_S).
"""

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import time

import pytest
import torch

from launching import CPU_SHIM, DATA_ARGS, FP32, REPO, TRAINING, check_exit, recipe_processes, run_command
from run_checks import assert_refused

sys.path.insert(0, str(REPO / "recipes"))
from runkit import integrity  # noqa: E402

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
        metadata = integrity._safe_metadata_load(f)
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
    assert integrity.check_loadable(work, [rel], files) == (
        f"{rel}: refused (it points a tensor at a file its checkpoint does not list)")
    plant(lambda info: setattr(info, "length", 6 * 10 ** 9))
    files = json.loads((work / "checkpoint.json").read_text())["files"]
    assert integrity.check_loadable(work, [rel], files) == (
        f"{rel}: refused (it points a tensor past the end of pytorch_model_fsdp_0/__0_0.distcp)")


# ---- 2. losing every real checkpoint to rotation --------------------------------------------------------------

def test_rotation_deletes_only_this_runs_older_checkpoints(written, data_dir, tmp_path):
    """Empty step-99999998 and step-99999999 and a step-00000001 link to someone's directory: the resumed run
    saves steps 6 and 8 with --keep-last 2 and keeps them, leaves the look-alikes (one warning), unlinks the link
    and never touches what it points to."""
    ckpt = copy(written, tmp_path, 2, 4)
    (ckpt / "step-99999998").mkdir()
    (ckpt / "step-99999999").mkdir()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "data.txt").write_bytes(SECRET)
    os.symlink(theirs, ckpt / "step-00000001")
    code, output = resume(data_dir, tmp_path, "--checkpoint-dir", str(ckpt), "--keep-last", "2")
    assert code == 0, output[-3000:]
    assert "resumed from " + str(ckpt / "step-00000004") in output
    assert sorted(os.listdir(ckpt)) == ["step-00000006", "step-00000008", "step-99999998", "step-99999999"]
    one_line(output, "warning", f"left alone {ckpt / 'step-99999998'}, {ckpt / 'step-99999999'}")
    assert (theirs / "data.txt").read_bytes() == SECRET


# ---- 3. files outside the manifest ------------------------------------------------------------------------------

def test_a_file_the_manifest_leaves_out_is_refused(written, data_dir, tmp_path):
    """random_states_0.pkl dropped from the manifest (so that it escaped the pre-scan): --resume PATH is one
    error naming it; --resume auto skips that checkpoint with one warning and resumes from the one before."""
    ckpt = copy(written, tmp_path, 4, 6)
    rehash(ckpt / "step-00000006", "random_states_0.pkl", drop=True)
    code, output = resume(data_dir, tmp_path, "--resume", str(ckpt / "step-00000006"), name="explicit")
    refused(code, output, "random_states_0.pkl is not listed in its checkpoint.json")
    code, output = resume(data_dir, tmp_path, "--checkpoint-dir", str(ckpt), "--keep-last", "0")
    assert code == 0, output[-3000:]
    one_line(output, "warning", f"skipping checkpoint {ckpt / 'step-00000006'}: random_states_0.pkl is not listed")
    assert "resumed from " + str(ckpt / "step-00000004") in output


def test_a_compressed_torch_file_is_refused_before_loading(written, data_dir, tmp_path):
    """optimizer.bin rewritten with compressed zip entries (a few MB can inflate to GB), its checksum updated."""
    import zipfile

    ckpt = copy(written, tmp_path, 6)
    path = ckpt / "step-00000006" / "optimizer.bin"
    with zipfile.ZipFile(path) as plain:
        entries = [(info.filename, plain.read(info)) for info in plain.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as packed:
        for name, data in entries:
            packed.writestr(name, data)
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
    code, output = resume(data_dir, tmp_path, "--resume", str(ckpt / "step-00000006"))
    refused(code, output, words)


def test_a_fifo_lock_is_one_message(data_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(mode=0o700)
    os.mkfifo(ckpt / ".lock")
    code, output = resume(data_dir, tmp_path, "--checkpoint-dir", str(ckpt))
    refused(code, output, f"{ckpt / '.lock'} is not a lock file this code writes (a FIFO")


# ---- 5. a save that writes outside -----------------------------------------------------------------------------

def test_a_planted_tmp_link_does_not_redirect_or_break_a_save(written, data_dir, tmp_path):
    """.tmp-step-00000008 planted as a link to someone's directory, under the name of the run's next save: the
    link is removed, never followed; the save of step 8 succeeds; the directory it pointed to is untouched."""
    ckpt = copy(written, tmp_path, 6)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "data.txt").write_bytes(SECRET)
    os.symlink(theirs, ckpt / ".tmp-step-00000008")
    code, output = resume(data_dir, tmp_path, "--checkpoint-dir", str(ckpt), "--keep-last", "0")
    assert code == 0 and "Traceback" not in output, output[-3000:]
    assert sorted(os.listdir(theirs)) == ["data.txt"] and (theirs / "data.txt").read_bytes() == SECRET
    assert (ckpt / "step-00000008").is_dir() and not (ckpt / "step-00000008").is_symlink()


def test_a_tmp_dir_swapped_during_the_save_is_not_published(written, data_dir, tmp_path):
    """While the save of step 8 writes (slowed by the test shim), its .tmp directory is renamed away and a link
    put in its place: the save is refused with one message, nothing is published, and no checkpoint file or
    manifest lands in the link's target."""
    ckpt = copy(written, tmp_path, 6)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    out = tmp_path / "swapped"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(CPU_SHIM),
               TEST_SLOW_SAVE_SECONDS="4", TEST_SLOW_SAVE_MATCH=".tmp-step-00000008")
    proc = subprocess.Popen(command(data_dir, out, "--checkpoint-dir", str(ckpt), "--keep-last", "0"), cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("TEST-SHIM: slow save"):
                os.rename(ckpt / ".tmp-step-00000008", tmp_path / "moved")
                os.symlink(theirs, ckpt / ".tmp-step-00000008")
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
    ckpt = copy(written, tmp_path, 6)
    ckpt.chmod(0o777)
    code, output = resume(data_dir, tmp_path, "--checkpoint-dir", str(ckpt))
    refused(code, output, f"chmod go-w {ckpt}")
    assert sorted(os.listdir(ckpt)) == ["step-00000006"]


# ---- 6. bad lock or manifest content ---------------------------------------------------------------------------

def test_garbage_lock_and_nested_manifest_are_warnings(written, data_dir, tmp_path):
    """A garbage .lock untouched for 10 minutes is taken over with a warning; a newest checkpoint whose manifest
    is nested 100000 deep is skipped with a warning under --resume auto: two distinct lines, no traceback."""
    ckpt = copy(written, tmp_path, 4, 6)
    (ckpt / ".lock").write_text('{"host": "x", "pid": ' + str(2 ** 70) + "}")
    old = time.time() - 600
    os.utime(ckpt / ".lock", (old, old))
    (ckpt / "step-00000006" / "checkpoint.json").write_text("[" * 100000 + "]" * 100000)
    code, output = resume(data_dir, tmp_path, "--checkpoint-dir", str(ckpt), "--keep-last", "0")
    assert code == 0, output[-3000:]
    one_line(output, "warning", f"taking over {ckpt / '.lock'}: its content is not a lock this code writes")
    one_line(output, "warning", f"skipping checkpoint {ckpt / 'step-00000006'}: unreadable checkpoint.json (nested")
    assert "resumed from " + str(ckpt / "step-00000004") in output


# ---- 7. numpy from the allowlist -------------------------------------------------------------------------------

class _BadDtype:
    """A uint32 dtype whose pickled state carries a subarray: built only from allowlisted classes."""

    def __reduce__(self):
        import numpy as np
        return np.dtype, ("u4", False, True), (3, "<", (np.dtype("u4"), (1 << 20,)), None, None, -1, -1, 0)


def test_rng_state_with_a_crafted_numpy_dtype_is_refused(written, data_dir, tmp_path):
    ckpt = copy(written, tmp_path, 6)
    path = ckpt / "step-00000006" / "random_states_0.pkl"
    with integrity.weights_only_loading():
        states = torch.load(path)
    states["random_state"] = ("MT19937", _BadDtype(), 624, 0, 0.0)
    torch.save(states, path)
    rehash(ckpt / "step-00000006", "random_states_0.pkl")
    code, output = resume(data_dir, tmp_path, "--resume", str(ckpt / "step-00000006"))
    refused(code, output, "random_states_0.pkl: refused (it holds a numpy dtype other than plain uint32/uint64)")
