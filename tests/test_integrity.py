"""The checkpoint file rules that need no launch (recipes/runkit/integrity.py): what a checkpoint file may
contain (no code, plain numpy RNG state, no compressed torch zip), that links, FIFOs and malformed manifests
are refused with a reason, and which rank hashes which files.

The launches that prove the same end to end (a planted pickle under DDP, ZeRO-2, ZeRO-3 and FSDP; a
truncated or flipped file refused) are in test_checkpoint_resume.py; the attacks of someone who can write into
--checkpoint-dir, in test_hostile_checkpoint_dir.py.
"""

import io
import json
import os
import pickle
import sys

import numpy as np
import pytest
import torch

from launching import REPO

sys.path.insert(0, str(REPO / "recipes"))
from runkit import integrity  # noqa: E402


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def stack_global(module, name):
    """A protocol-4 pickle that calls module.name("HOME"): find_class receives the dotted name as is."""
    text = lambda s: b"\x8c" + bytes([len(s)]) + s.encode()  # noqa: E731
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text("HOME") + b"\x85R."


def test_checkpoint_metadata_builds_only_its_own_classes(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0).view(2, 3), "step": 3}, checkpoint_id=str(tmp_path / "real"))
    with open(tmp_path / "real" / ".metadata", "rb") as f:  # a real one loads
        assert "w" in integrity._safe_metadata_load(f).state_dict_metadata
    marker = tmp_path / "code-ran"
    attacks = [pickle.dumps(RunsCode(marker)),
               # a dotted name walks from an allowed module to what it imports
               stack_global("torch.distributed.checkpoint.filesystem", "os.getenv"),
               stack_global("torch.distributed.checkpoint.filesystem", "pickle.loads"),
               stack_global("torch.distributed.checkpoint.filesystem", "FileSystemWriter")]
    for attack in attacks:
        with pytest.raises(integrity.UnsafeCheckpointFile, match="refused .it asks for"):
            integrity._safe_metadata_load(io.BytesIO(attack))
    assert not marker.exists()


def test_torch_files_load_weights_only(tmp_path):
    ok = {"state": {0: {"exp_avg": torch.zeros(3)}}, "rng": np.random.get_state(), "lr": 0.1}
    torch.save(ok, tmp_path / "optimizer.bin")
    marker = tmp_path / "code-ran"
    torch.save({"state": RunsCode(marker)}, tmp_path / "evil.pt")
    assert integrity.check_loadable(tmp_path, ["optimizer.bin"]) is None
    problem = integrity.check_loadable(tmp_path, ["optimizer.bin", "evil.pt"])
    assert problem.startswith("evil.pt: not loadable as weights only (it asks for posix.system"), problem
    assert not marker.exists()
    with integrity.weights_only_loading():  # what DeepSpeed's own torch.load(weights_only=False) gets
        with pytest.raises(integrity.UnsafeCheckpointFile):
            torch.load(tmp_path / "evil.pt", weights_only=False)
    assert not marker.exists() and torch.load is not None


def test_hashing_is_shared_and_a_rank_hashes_its_own_files():
    rels = ["pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt", "random_states_0.pkl",
            "random_states_1.pkl", "pytorch_model_fsdp_0/__1_0.distcp", "scheduler.bin", "latest",
            "pytorch_model_fsdp_0/.metadata"]
    shares = [integrity.my_share(rels, rank, 2) for rank in (0, 1)]
    assert sorted(shares[0] + shares[1]) == sorted(rels)  # every file once
    assert "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt" in shares[1]
    assert "pytorch_model_fsdp_0/__1_0.distcp" in shares[1]


class _BadDtype:
    """A uint32 dtype whose pickled state carries a subarray: every class it needs is on the allowlist, and an
    array built on it can crash numpy's repr."""

    def __init__(self, subarray=(np.dtype("u4"), (1 << 20,))):
        self.subarray = subarray

    def __reduce__(self):
        return np.dtype, ("u4", False, True), (3, "<", self.subarray, None, None, -1, -1, 0)


def test_numpy_in_a_torch_file_must_be_plain_rng_state(tmp_path):
    torch.save({"random_state": ("MT19937", np.random.get_state()[1], 624, 0, 0.0)}, tmp_path / "ok.pkl")
    torch.save({"random_state": ("MT19937", _BadDtype())}, tmp_path / "random_states_0.pkl")
    torch.save({"x": np.zeros(3, dtype=np.float64)}, tmp_path / "floats.pkl")
    assert integrity.check_loadable(tmp_path, ["ok.pkl"]) is None
    assert integrity.check_loadable(tmp_path, ["random_states_0.pkl"]) == (
        "random_states_0.pkl: refused (it holds a numpy dtype other than plain uint32/uint64)")
    problem = integrity.check_loadable(tmp_path, ["floats.pkl"])
    assert problem is not None and problem.startswith("floats.pkl: "), problem
    # An object subarray: torch's weights-only unpickler already refuses numpy's object dtype; the walk, given
    # such a dtype however it was built, refuses it without printing it.
    evil = pickle.loads(pickle.dumps(_BadDtype(subarray=(np.dtype("O"), (2,)))))
    assert evil.type is np.uint32 and evil.subdtype is not None
    assert integrity._numpy_problem("random_states_0.pkl", {"random_state": ("MT19937", evil)}) == (
        "random_states_0.pkl: refused (it holds a numpy dtype other than plain uint32/uint64)")


def test_a_compressed_torch_file_is_refused_before_loading(tmp_path):
    import zipfile

    torch.save({"w": torch.zeros(1000)}, tmp_path / "optimizer.bin")
    assert integrity.check_loadable(tmp_path, ["optimizer.bin"]) is None
    with zipfile.ZipFile(tmp_path / "optimizer.bin") as plain, \
            zipfile.ZipFile(tmp_path / "small.bin", "w", zipfile.ZIP_DEFLATED) as packed:
        for info in plain.infolist():
            packed.writestr(info.filename, plain.read(info))
    problem = integrity.check_loadable(tmp_path, ["small.bin"])
    assert problem.startswith("small.bin: refused (its entries are compressed"), problem


def test_special_files_are_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "model.safetensors")
    os.symlink("/dev/zero", tmp_path / "optimizer.bin")
    with pytest.raises(integrity.RefusedFile, match="model.safetensors is a FIFO"):
        integrity.open_regular(str(tmp_path / "model.safetensors"), name="model.safetensors")
    assert integrity.check_files(tmp_path, {"optimizer.bin": {"size": 10, "sha256": "0" * 64}}) == (
        "optimizer.bin is a symbolic link, not a file a save writes")
    assert integrity.coverage(tmp_path, {}) == "model.safetensors is a FIFO, not a file a save writes"


def test_manifest_parsing_never_raises_anything_but_valueerror(tmp_path):
    bad = ["[" * 100000 + "]" * 100000, "[]", '{"step": "1"}', "\xff\xfe",
           json.dumps({"step": 1, "layout": {"family": "full", "zero_stage": None, "world_size": 1}, "must_match": {},
                       "train_state": {}, "files": {"../x": {"size": 1, "sha256": "0" * 64}}}),
           json.dumps({"step": 1, "layout": {"family": "full", "zero_stage": None, "world_size": 1}, "must_match": {},
                       "train_state": {}, "files": {"a": {"size": 2 ** 70 * 1.0, "sha256": "0" * 64}}})]
    for text in bad:
        (tmp_path / "checkpoint.json").write_text(text)
        with pytest.raises(ValueError):
            integrity.read_manifest(str(tmp_path))
    os.unlink(tmp_path / "checkpoint.json")
    os.mkfifo(tmp_path / "checkpoint.json")
    with pytest.raises(ValueError, match="checkpoint.json is a FIFO"):
        integrity.read_manifest(str(tmp_path))
