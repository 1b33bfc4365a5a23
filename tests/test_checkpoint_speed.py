"""Issue 51: checksums that cost little (xxh3-128, hashed in parallel), a checkpoint of the earlier formats (SHA-256)
that still verifies and loads, the save's and the resume's times, and bench/checkpoint_speed.py's table (a tiny
size, one process: every column filled)."""

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from accelrun.checkpoint.files import CHECKSUMS, SAVED, file_table, matches, recorded
from accelrun.checkpoint.held import HeldCheckpoint
from accelrun.checkpoint.layout import FORMAT_VERSION
from launching import REPO


def test_a_save_records_xxh3_and_an_entry_is_verified_by_its_own_algorithm(tmp_path):
    """A save's table records xxh3_128 (32 hex digits); an entry of the earlier formats records sha256 (64) and is
    checked with it; an entry of an unknown algorithm, of the wrong length, or of two algorithms is none."""
    data = os.urandom(3 << 20) + b"tail"
    (tmp_path / "a.bin").write_bytes(data)
    table = file_table(str(tmp_path), ["a.bin"])
    import xxhash
    assert table == {"a.bin": {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}}
    assert SAVED == "xxh3_128" and set(CHECKSUMS) == {"xxh3_128", "sha256"}
    old = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(tmp_path / "a.bin", "rb") as f:
        assert matches(f.fileno(), table["a.bin"]) and matches(f.fileno(), old)
        assert not matches(f.fileno(), {"size": len(data), "sha256": hashlib.sha256(data[:-1]).hexdigest()})
        assert not matches(f.fileno(), {"size": len(data) - 1, "xxh3_128": table["a.bin"]["xxh3_128"]})
    assert recorded(old) == ("sha256", old["sha256"])
    for bad in ({"size": 1, "xxh3_128": "0" * 64}, {"size": 1, "sha256": "0" * 32}, {"size": 1, "md5": "0" * 32},
                {"size": 1, "sha256": "0" * 64, "xxh3_128": "0" * 32}, {"size": 1}, {"size": 1, "sha256": 7}):
        assert recorded(bad) is None, bad
    assert FORMAT_VERSION == 3  # the checksum a manifest records changed: formats 1 and 2 recorded sha256


def test_the_parallel_verification_names_the_first_damaged_file_of_the_share(tmp_path):
    """The files of a share are hashed at once; the one named is the first of the share that differs (as the loop
    named it), whichever thread finishes first."""
    root = tmp_path / "step-00000001"
    root.mkdir()
    for name in ("a.json", "b.json", "c.json", "d.json"):
        (root / name).write_bytes(os.urandom(1 << 20))
    files = file_table(str(root), ["a.json", "b.json", "c.json", "d.json"])
    with HeldCheckpoint(str(root), files, follow=False) as held:
        assert held.share_problems(0, 1) == (None, None)
    for name in ("d.json", "b.json"):  # one byte flipped in two files: b is named
        data = bytearray((root / name).read_bytes())
        data[len(data) // 2] ^= 1
        (root / name).write_bytes(bytes(data))
    with HeldCheckpoint(str(root), files, follow=False) as held:
        assert held.share_problems(0, 1)[0] == "b.json does not match its recorded size and checksum (truncated " \
                                               "or overwritten)"
    with HeldCheckpoint(str(root), files, follow=False) as held:  # rank 1 of 2 holds b and d: b again
        assert held.share_problems(1, 2)[0].startswith("b.json does not match")
        assert held.share_problems(0, 2) == (None, None)  # a and c


@pytest.fixture
def accelerator():
    """A one-process CPU Accelerator in this process, its global state reset afterwards."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _saved(acc, directory, model, optimizer):
    from accelrun.checkpoint import Checkpointer, lock_directory
    sys.path.insert(0, str(REPO / "bench"))
    from checkpoint_speed import train_state
    lock, _ = lock_directory(acc, str(directory), "none", "speed")
    ckpt = Checkpointer(acc, str(directory), 0, {"x": 1}, model, lock, "speed")
    ckpt.save(3, train_state(3))
    ckpt.release()
    return ckpt


def _resumed(acc, directory, model):
    from accelrun.checkpoint import Checkpointer, lock_directory
    lock, _ = lock_directory(acc, str(directory), "auto", "speed")
    ckpt = Checkpointer(acc, str(directory), 0, {"x": 1}, model, lock, "speed")
    chosen = ckpt.choose("auto")
    try:
        return chosen and (chosen[0], ckpt.load(*chosen), ckpt.times)
    finally:
        ckpt.release()


def test_a_checkpoint_of_format_1_or_2_verifies_and_loads_and_the_times_say_where_they_went(tmp_path, accelerator,
                                                                                                capsys):
    """A save through the real Checkpointer records format 3 and xxh3_128 and says where its time went (line and
    times); the same checkpoint with the manifest of format 1 (and 2), each file's SHA-256 in it, still verifies and
    loads; one byte flipped in it is still refused (--resume auto skips it, naming the file)."""
    acc = accelerator
    torch.manual_seed(0)
    plain = torch.nn.Linear(8, 8)
    model, optimizer = acc.prepare(plain, torch.optim.AdamW(plain.parameters()))
    acc.backward(model(torch.ones(2, 8)).sum())
    optimizer.step()  # the moments exist: optimizer.bin holds tensors
    ckpt = _saved(acc, tmp_path, model, optimizer)
    line = capsys.readouterr().out
    assert re.search(r"checkpoint saved: \S+step-00000003 \(written in [\d.]+ s, checksums by 1 rank\(s\) in [\d.]+ s, "
                     r"flushed to disk in [\d.]+ s, published in [\d.]+ s\)", line), line
    assert {k: ckpt.times[k] >= 0 for k in ("save_write_s", "save_checksum_s", "save_flush_s", "save_publish_s")} \
        == dict.fromkeys(("save_write_s", "save_checksum_s", "save_flush_s", "save_publish_s"), True)
    path = ckpt.newest
    manifest = json.loads((tmp_path / "step-00000003" / "checkpoint.json").read_text())
    assert manifest["format_version"] == 3 and all(set(w) == {"size", "xxh3_128"} for w in manifest["files"].values())
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    for version in (1, 2):
        old = {**manifest, "format_version": version, "files": {
            rel: {"size": want["size"], "sha256": hashlib.sha256((tmp_path / "step-00000003" / rel).read_bytes())
                  .hexdigest()} for rel, want in manifest["files"].items()}}
        (tmp_path / "step-00000003" / "checkpoint.json").write_text(json.dumps(old))
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        resumed, state, times = _resumed(acc, tmp_path, model)
        assert resumed == path and state["step"] == 3 and times["resume_verify_s"] > 0
        assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    data = bytearray((tmp_path / "step-00000003" / "optimizer.bin").read_bytes())
    data[-100] ^= 1
    (tmp_path / "step-00000003" / "optimizer.bin").write_bytes(bytes(data))
    capsys.readouterr()
    with pytest.raises(SystemExit):  # the only checkpoint of this user's is damaged: refused, not started fresh
        _resumed(acc, tmp_path, model)
    out = capsys.readouterr()
    assert "optimizer.bin does not match its recorded size and checksum" in out.out + out.err


def test_the_benchmark_prints_every_column(tmp_path):
    """bench/checkpoint_speed.py at a tiny size, one process, one round: its table has every column, each cell of
    the row a number (the save's flush and publish timed on their own: '-' before issue 51)."""
    sys.path.insert(0, str(REPO / "bench"))
    from checkpoint_speed import COLUMNS
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH"))
                                                      if p))
    out = subprocess.run([sys.executable, str(REPO / "bench" / "checkpoint_speed.py"), "--size-gb", "0.004",
                          "--processes", "1", "--repeat", "1", "--dir", str(tmp_path), "--json",
                          str(tmp_path / "rows.json")], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    table = [line for line in out.stdout.splitlines() if line.startswith("|")]
    assert table[0] == "| " + " | ".join(COLUMNS) + " |"
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert len(cells) == len(COLUMNS) and cells[0] == "1", table
    assert all(re.fullmatch(r"\d+\.\d\dx?", c) for c in cells[1:]), dict(zip(COLUMNS, cells))
    row = json.loads((tmp_path / "rows.json").read_text())[0]
    assert row["save ratio"] == pytest.approx(row["save"] / row["raw save+fsync"])
