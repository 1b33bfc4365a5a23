"""The checkpoint format version kept honest (issue 54, item 4; docs/checkpoints.md, "What a format version promises").

What a save writes and records, per engine format (checkpoint/manifest.py's format_fingerprint: the files, LoRA's
rule, the manifest's fields, a file's recorded entry), is stored per format version in
tests/fixtures/format_fingerprints.json: a change of it without a new layout.FORMAT_VERSION fails here (FSDP2's LoRA
checkpoints going from the whole model to the adapters only would have). And a checkpoint of format 1, kept as a small
fixture written by the code of format 1 (tests/fixtures/format_1: linear_regression, one process, step 2 of 4),
still resumes through the real Checkpointer: chosen, verified, loaded, trained on, saved in this code's format.
"""

import json
import shutil

from accelrun.checkpoint.layout import FORMAT_VERSION, READ_SINCE
from accelrun.checkpoint.manifest import format_fingerprint, read_manifest
from in_process import run_main
from launching import REPO

FINGERPRINTS = REPO / "tests" / "fixtures" / "format_fingerprints.json"
FORMAT_1 = REPO / "tests" / "fixtures" / "format_1"
# How the format-1 fixture was written (python recipes/linear_regression.py at format 1), and how it is resumed.
FORMAT_1_FLAGS = ["--epochs", "2", "--num-points", "64", "--batch-size", "32"]


def differences(old, new, where=""):
    """The paths under which two fingerprints differ, for the failure message."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new)) for d in differences(old.get(k), new.get(k), f"{where}/{k}")]
    return [] if old == new else [where or "/"]


def test_the_format_fingerprint_changes_only_with_the_format_version():
    """Each format version has its fingerprint; this code's must be the one stored for layout.FORMAT_VERSION, and each
    version's differs from the one before (a version that changed nothing promises nothing new). On a change of what a
    save writes or records: move FORMAT_VERSION by one, store the new fingerprint under it (the command below), say in
    docs/checkpoints.md what changed and which versions still load."""
    stored = json.loads(FINGERPRINTS.read_text())
    now = json.loads(json.dumps(format_fingerprint()))  # as JSON reads it back: tuples become lists
    store = (f"python3 -c \"import json, sys; sys.path.insert(0, 'src'); from accelrun.checkpoint.manifest import "
             f"format_fingerprint as f; p = '{FINGERPRINTS.relative_to(REPO)}'; d = json.load(open(p)); "
             f"d[str({FORMAT_VERSION})] = f(); json.dump(d, open(p, 'w'), indent=1, sort_keys=True)\"")
    assert str(FORMAT_VERSION) in stored, f"format {FORMAT_VERSION} has no fingerprint stored: {store}"
    changed = differences(stored[str(FORMAT_VERSION)], now)
    assert not changed, (f"what a save writes or records changed ({', '.join(changed[:8])}) while FORMAT_VERSION "
                         f"stayed {FORMAT_VERSION}: move it to {FORMAT_VERSION + 1}, then {store}")
    versions = sorted(map(int, stored))
    assert versions[-1] == FORMAT_VERSION and READ_SINCE <= FORMAT_VERSION, versions
    assert all(stored[str(a)] != stored[str(b)] for a, b in zip(versions, versions[1:])), versions


def test_the_fingerprint_sees_what_fsdp2_lora_saves():
    """The change that format 2 records, FSDP2's LoRA checkpoints holding the adapters only (accelerate's save_state
    and load_state given adapter_only), is in the fingerprint: without it, it would not have failed the test above."""
    frozen = format_fingerprint()["formats"]["fsdp-sharded"]["frozen"]
    assert frozen["save_and_load_replaced"] == [True, True], frozen


def test_a_checkpoint_of_format_1_still_resumes(tmp_path):
    """A checkpoint written by the code of format 1 (tests/fixtures/format_1/step-00000002, 17 KB) is chosen under
    --resume auto, verified (sizes and checksums), loaded, trained on to the end, and the next save is of this code's
    format."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(mode=0o700)
    shutil.copytree(FORMAT_1 / "step-00000002", ckpt / "step-00000002")
    assert read_manifest(str(ckpt / "step-00000002"))["format_version"] == 1
    code, output = run_main("linear_regression", [*FORMAT_1_FLAGS, "--checkpoint-dir", ckpt,
                                                  "--output-dir", tmp_path / "out"])
    assert code == 0, output[-3000:]
    assert f"resumed from {ckpt / 'step-00000002'} (step 2, written by 1 process; checksums and formats" in output
    assert "epoch 1 step 4/4" in output and "epoch 0 step" not in output, output[-3000:]  # on from step 2, not afresh
    assert read_manifest(str(ckpt / "step-00000004"))["format_version"] == FORMAT_VERSION
