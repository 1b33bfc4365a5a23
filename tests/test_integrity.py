"""The checkpoint file rules that need no launch (src/accelrun/checkpoint/: safe_loading.py, untrusted.py,
files.py, held.py, manifest.py, formats.py): what a checkpoint file may
contain (no code, plain numpy RNG state, no compressed torch zip), that links, FIFOs and malformed manifests
are refused with a reason, and which rank hashes which files.

The launches that prove the same end to end (a planted pickle under DDP, ZeRO-2, ZeRO-3 and FSDP; a
truncated or flipped file refused) are in test_checkpoint_resume.py; the attacks of someone who can write into
--checkpoint-dir, in test_hostile_checkpoint_dir.py.
"""

import hashlib
import io
import json
import os
import pickle
import pwd
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from accelrun.checkpoint import safe_loading
from accelrun.checkpoint import train_state as manifest_json
from accelrun.checkpoint.files import coverage, my_share
from accelrun.checkpoint.formats import files_problem
from accelrun.checkpoint.held import HeldCheckpoint
from accelrun.checkpoint.layout import FORMAT_VERSION, size_limit
from accelrun.checkpoint.manifest import read_manifest, run_problem, state_problem, write_manifest
from accelrun.checkpoint.untrusted import RefusedFile, open_regular
from checkpoint_checks import check_files, check_loadable
from launching import skip_unless_ci
from tampering import deflated


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
        assert "w" in safe_loading.safe_metadata_load(f).state_dict_metadata
    marker = tmp_path / "code-ran"
    attacks = [pickle.dumps(RunsCode(marker)),
               # a dotted name walks from an allowed module to what it imports
               stack_global("torch.distributed.checkpoint.filesystem", "os.getenv"),
               stack_global("torch.distributed.checkpoint.filesystem", "pickle.loads"),
               stack_global("torch.distributed.checkpoint.filesystem", "FileSystemWriter")]
    for attack in attacks:
        with pytest.raises(safe_loading.UnsafeCheckpointFile, match="refused .it asks for"):
            safe_loading.safe_metadata_load(io.BytesIO(attack))
    assert not marker.exists()


def test_torch_files_load_weights_only(tmp_path):
    ok = {"state": {0: {"exp_avg": torch.zeros(3)}}, "rng": np.random.get_state(), "lr": 0.1}
    torch.save(ok, tmp_path / "optimizer.bin")
    marker = tmp_path / "code-ran"
    torch.save({"state": RunsCode(marker)}, tmp_path / "evil.pt")
    assert check_loadable(tmp_path, ["optimizer.bin"]) is None
    problem = check_loadable(tmp_path, ["optimizer.bin", "evil.pt"])
    assert problem.startswith("evil.pt: not loadable as weights only (it asks for posix.system"), problem
    assert not marker.exists()
    with safe_loading.weights_only_loading():  # what DeepSpeed's own torch.load(weights_only=False) gets
        with pytest.raises(safe_loading.UnsafeCheckpointFile):
            torch.load(tmp_path / "evil.pt", weights_only=False)
    assert not marker.exists() and torch.load is not None


def test_hashing_is_shared_and_a_rank_hashes_its_own_files():
    rels = ["pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt", "random_states_0.pkl",
            "random_states_1.pkl", "pytorch_model_fsdp_0/__1_0.distcp", "scheduler.bin", "latest",
            "pytorch_model_fsdp_0/.metadata"]
    shares = [my_share(rels, rank, 2) for rank in (0, 1)]
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
    assert check_loadable(tmp_path, ["ok.pkl"]) is None
    assert check_loadable(tmp_path, ["random_states_0.pkl"]) == (
        "random_states_0.pkl: refused (it holds a numpy dtype other than plain uint32/uint64)")
    problem = check_loadable(tmp_path, ["floats.pkl"])
    assert problem is not None and problem.startswith("floats.pkl: "), problem
    # An object subarray: torch's weights-only unpickler already refuses numpy's object dtype; the walk, given
    # such a dtype however it was built, refuses it without printing it.
    evil = pickle.loads(pickle.dumps(_BadDtype(subarray=(np.dtype("O"), (2,)))))
    assert evil.type is np.uint32 and evil.subdtype is not None
    assert safe_loading.numpy_problem("random_states_0.pkl", {"random_state": ("MT19937", evil)}) == (
        "random_states_0.pkl: refused (it holds a numpy dtype other than plain uint32/uint64)")


def test_a_compressed_torch_file_is_refused_before_loading(tmp_path):
    torch.save({"w": torch.zeros(1000)}, tmp_path / "optimizer.bin")
    assert check_loadable(tmp_path, ["optimizer.bin"]) is None
    (tmp_path / "small.bin").write_bytes(deflated((tmp_path / "optimizer.bin").read_bytes()))
    problem = check_loadable(tmp_path, ["small.bin"])
    assert problem.startswith("small.bin: refused (its entries are compressed"), problem


def test_special_files_are_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "model.safetensors")
    os.symlink("/dev/zero", tmp_path / "optimizer.bin")
    with pytest.raises(RefusedFile, match="model.safetensors is a FIFO"):
        open_regular(str(tmp_path / "model.safetensors"), name="model.safetensors")
    assert check_files(tmp_path, {"optimizer.bin": {"size": 10, "sha256": "0" * 64}}) == (
        "optimizer.bin is a symbolic link, not a file a save writes")
    assert coverage(tmp_path, {}) == "model.safetensors is a FIFO, not a file a save writes"


def test_manifest_parsing_never_raises_anything_but_valueerror(tmp_path):
    bad = ["[" * 100000 + "]" * 100000, "[]", '{"step": "1"}', "\xff\xfe",
           json.dumps({"format_version": 1, "step": 1, "layout": {"family": "full", "zero_stage": None,
                                                                    "world_size": 1},
                       "must_match": {}, "train_state": {}, "files": {"../x": {"size": 1, "sha256": "0" * 64}}}),
           json.dumps({"format_version": 1, "step": 1, "layout": {"family": "full", "zero_stage": None,
                                                                    "world_size": 1},
                       "must_match": {}, "train_state": {}, "files": {"a": {"size": 2 ** 70 * 1.0,
                                                                            "sha256": "0" * 64}}})]
    for text in bad:
        (tmp_path / "checkpoint.json").write_text(text)
        with pytest.raises(ValueError):
            read_manifest(str(tmp_path))
    os.unlink(tmp_path / "checkpoint.json")
    os.mkfifo(tmp_path / "checkpoint.json")
    with pytest.raises(ValueError, match="checkpoint.json is a FIFO"):
        read_manifest(str(tmp_path))


LAYOUT = {"family": "full", "zero_stage": None, "world_size": 1, "grad_accum": 1}


def manifest_with(**change):
    """A well-formed manifest of one file, with `change` applied (layout keys as layout_KEY)."""
    layout = {**LAYOUT, **{k[7:]: v for k, v in change.items() if k.startswith("layout_")}}
    fields = {k: v for k, v in change.items() if not k.startswith("layout_")}
    return {"format_version": FORMAT_VERSION, "step": 2, "layout": layout, "must_match": {}, "train_state": {},
            "files": {}, **fields}


def test_every_manifest_field_is_checked_for_type_and_range(tmp_path):
    """Issue 36, M9 and the like: a field of another type or range is a ValueError saying which (a traceback)."""
    cases = {"layout_grad_accum": ("2", "its layout's grad_accum '2' is not a number of micro-batches"),
             "layout_world_size": (0, "its layout's world_size 0 is not a number of processes"),
             "layout_family": ("megatron", "its layout names an engine this code does not write ('megatron')"),
             "layout_zero_stage": (2, "its layout's zero_stage 2 is not one a full run writes"),
             "step": (True, "checkpoint.json is not a manifest this code wrote"),
             "files": ({"a": {"size": 1, "sha256": "0" * 64, "x": 1}}, "records no valid size and checksum for 'a'"),
             "surprise": ({}, "checkpoint.json is not a manifest this code wrote")}
    for key, (value, words) in cases.items():
        (tmp_path / "checkpoint.json").write_text(json.dumps(manifest_with(**{key: value})))
        with pytest.raises(ValueError, match=re.escape(words)):
            read_manifest(str(tmp_path), contents=False)
    (tmp_path / "checkpoint.json").write_text(json.dumps(manifest_with(recipe="mnist")))
    assert read_manifest(str(tmp_path), contents=False)["recipe"] == "mnist"


def test_a_manifest_of_another_format_version_is_refused_naming_it(tmp_path):
    """Issue 43, item 3: a save writes this code's format version into its manifest; a manifest of a version this code
    does not read, or of none (the checkpoints written before it was recorded), is one line saying which version
    wrote it. Issue 54, item 4: format 2, and format 1 still reads, but for an FSDP2 LoRA checkpoint (format 1 held
    the whole model before it held the adapters only: the two cannot be told apart)."""
    write_manifest(str(tmp_path), {k: v for k, v in manifest_with().items() if k != "format_version"})
    assert read_manifest(str(tmp_path), contents=False)["format_version"] == FORMAT_VERSION == 3
    later = "and this code reads format 1 to 3 only (resume it with the code that wrote it)"
    cases = {None: f"checkpoint.json records no format_version: accelrun before format 1 wrote it, {later}",
             4: f"checkpoint.json records format_version 4: another version of accelrun wrote it, {later}",
             0: f"checkpoint.json records format_version 0: another version of accelrun wrote it, {later}",
             "1": f"checkpoint.json records format_version '1': another version of accelrun wrote it, {later}",
             True: f"checkpoint.json records format_version True: another version of accelrun wrote it, {later}"}
    for version, line in cases.items():
        manifest = manifest_with(format_version=version)
        if version is None:
            del manifest["format_version"]
        (tmp_path / "checkpoint.json").write_text(json.dumps(manifest))
        with pytest.raises(ValueError) as refused:
            read_manifest(str(tmp_path), contents=False)
        assert str(refused.value) == line
    fsdp = {**LAYOUT, "family": "fsdp"}
    for version, layout, must_match, refused in ((1, LAYOUT, {"lora_r": 8}, False), (1, fsdp, {"lora_r": 0}, False),
                                                 (1, fsdp, {"lora_r": 8}, True), (2, fsdp, {"lora_r": 8}, False)):
        manifest = manifest_with(format_version=version, layout=layout, must_match=must_match)
        (tmp_path / "checkpoint.json").write_text(json.dumps(manifest))
        if refused:
            with pytest.raises(ValueError, match="format_version 1 for an FSDP2 LoRA checkpoint, which may hold the "
                                                 "whole model where format 2 holds the adapters only"):
                read_manifest(str(tmp_path), contents=False)
        else:
            assert read_manifest(str(tmp_path), contents=False)["format_version"] == version


def test_train_state_fields_are_checked_for_type_and_range():
    """Issue 36, M1 and M2: what Run writes, field by field (manifest.py's TRAIN_STATE)."""
    state = {"step": 2, "total_steps": 20, "epoch": 0, "step_in_epoch": 2, "epochs_run": 1, "first_loss": 2.5,
             "final_loss": None, "last_eval": None, "train_time": 1.5, "output_dir": "out", "stopped": False,
             "run_id": "0f" * 16,
             "window": {"loss_sums": [1.0, 2.0], "micro": 1, "data_time": 0.1, "compute_time": 0.2}}
    layout = {**LAYOUT, "world_size": 2}
    assert state_problem(manifest_with(train_state=state, layout=layout)) is None
    cases = [({}, "its train_state lacks 'epoch'"), ({**state, "extra": 1}, "holds an unknown field 'extra'"),
             ({**state, "step": "2"}, "its train_state's step '2' is not of the type"),
             ({**state, "train_time": -1.0}, "its train_state's train_time -1.0 is not of the type"),
             ({**state, "step": 3}, "its train_state's step 3 is not its step 2"),
             ({**state, "stopped": 1}, "its train_state's stopped 1 is not of the type"),
             ({**state, "run_id": "$(id)"}, "its train_state's run_id '$(id)' is not of the type"),
             # An evaluation's figures reach summary.json: numbers only, never a string from a checkpoint.
             ({**state, "last_eval": {"step": 2, "test_loss": "$(id>>PWNED)"}}, "its train_state's last_eval"),
             ({**state, "window": {**state["window"], "loss_sums": [1.0]}}, "holds 1 loss sums for 2 processes"),
             ({**state, "window": {**state["window"], "micro": None}}, "its train_state's micro None is not")]
    for bad, words in cases:
        assert words in state_problem(manifest_with(train_state=bad, layout=layout)), words


def test_a_manifest_lists_exactly_the_files_of_its_engine():
    """Issue 36, M4-M8: each engine's files per rank (accelerate's, DeepSpeed's, torch.distributed.checkpoint's,
    accelrun's own); none missing, none that no save writes."""
    def table(*rels):
        return {rel: {"size": 1, "sha256": "0" * 64} for rel in rels}

    common = ["random_states_0.pkl", "random_states_1.pkl", "rank-0.done", "rank-1.done", "scheduler.bin"]
    full = manifest_with(layout_world_size=2, files=table(*common, "model.safetensors", "optimizer.bin"))
    assert files_problem(full) is None
    assert "does not list random_states_1.pkl" in files_problem(
        {**full, "files": table(*common[:1], *common[2:], "model.safetensors", "optimizer.bin")})
    assert "lists custom.pkl, which no full save" in files_problem(
        {**full, "files": {**full["files"], **table("custom.pkl")}})
    assert "does not list optimizer_1.bin" in files_problem(full, optimizers=2)
    assert files_problem({**full, "files": table(*common, "model.safetensors")}, optimizers=0) is None
    zero3 = manifest_with(layout_family="deepspeed", layout_zero_stage=3, layout_world_size=2, files=table(
        *common, "latest", "zero_to_fp32.py", *(f"pytorch_model/zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt"
                                                 for r in (0, 1) for kind in ("model", "optim"))))
    assert files_problem(zero3) is None
    missing = {k: v for k, v in zero3["files"].items() if "rank_1_mp_rank_00_optim" not in k}
    assert "does not list pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt" in files_problem(
        {**zero3, "files": missing})
    fsdp = manifest_with(layout_family="fsdp", layout_world_size=2, files=table(
        *common, "rank-0.buffers.safetensors", "rank-1.buffers.safetensors",
        *(f"{d}/{f}" for d in ("pytorch_model_fsdp_0", "optimizer_0") for f in (".metadata", "__0_0.distcp",
                                                                               "__1_0.distcp"))))
    assert files_problem(fsdp) is None
    assert "does not list optimizer_0/__1_0.distcp" in files_problem(
        {**fsdp, "files": {k: v for k, v in fsdp["files"].items() if k != "optimizer_0/__1_0.distcp"}})


def test_a_held_checkpoint_reads_what_was_verified(tmp_path):
    """Issue 36, R3: once held, a file replaced at its path (by a link to a file outside) is never read through the
    view; replaced() names it. A link anywhere on the way is refused, never followed."""
    root, secret = tmp_path / "step-00000001", tmp_path / "secret.bin"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.json").write_bytes(b"verified")
    secret.write_bytes(b"outside!")
    files = {"sub/a.json": {"size": 8, "sha256": hashlib.sha256(b"verified").hexdigest()}}
    with HeldCheckpoint(str(root), files, follow=False) as held:
        assert held.share_problems(0, 1) == (None, None)
        (root / "sub" / "a.json").unlink()
        os.symlink(secret, root / "sub" / "a.json")
        assert (Path(held.view()) / "sub" / "a.json").read_bytes() == b"verified"
        assert held.replaced() == ["sub/a.json"]
        view = held.view()
    assert not os.path.exists(view)  # the private view goes with the held files
    os.rename(root / "sub", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", root / "sub")
    with HeldCheckpoint(str(root), files) as held:
        assert held.share_problems(0, 1)[0] == "sub/a.json: sub is not a directory a save writes (a link or a file)"


def test_dcp_slices_are_bounded_like_torch_files(tmp_path):
    """Issue 36, D1: a slice of a .distcp file stored compressed, or through a transform, is refused before loading,
    like a torch file's compressed entries."""

    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0).view(2, 3)}, checkpoint_id=str(tmp_path))
    rels = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.iterdir())
    assert check_loadable(tmp_path, [".metadata"], {rel: {"size": None} for rel in rels}) is None
    with open(tmp_path / ".metadata", "rb") as f:
        metadata = safe_loading.safe_metadata_load(f)
    (info,) = metadata.storage_data.values()
    data = (tmp_path / info.relative_path).read_bytes()
    packed = deflated(data[info.offset:info.offset + info.length])
    (tmp_path / info.relative_path).write_bytes(packed)
    info.offset, info.length = 0, len(packed)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    files = {rel: {"size": None} for rel in rels}
    assert check_loadable(tmp_path, [".metadata"], files) == (
        f"{info.relative_path}: refused (a slice at 0: its entries are compressed; torch.save never compresses, and "
        f"they could inflate to far more memory than the file's size)")
    info.transform_descriptors = ["zstd"]
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    assert "it asks for a transform of" in check_loadable(tmp_path, [".metadata"], files)


def test_a_dcp_entry_loads_only_into_an_object_of_its_kind(tmp_path):
    """Issue 36, D4: a tensor declared a bytes entry in .metadata: the load plan refuses it with one message."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(tmp_path))
    with open(tmp_path / ".metadata", "rb") as f:
        metadata = safe_loading.safe_metadata_load(f)
    metadata.storage_data[MetadataIndex("w")] = next(iter(metadata.storage_data.values()))
    metadata.state_dict_metadata["w"] = BytesStorageMetadata()
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    target = {"w": torch.zeros(6)}
    with safe_loading.weights_only_loading(), pytest.raises(BaseException) as raised:
        dcp.load(target, checkpoint_id=str(tmp_path))
    assert "its .metadata stores w as bytes, where this run has a tensor" in str(raised.value)


def test_plain_names():
    assert safe_loading.plain_name("blocks.0.ln1.weight")
    assert not any(safe_loading.plain_name(n) for n in ("", ".", "..", "a/b", "/abs", "../../x", "a\0b", "x" * 300))


# ---- rules that passed only because another refused first (issue 52, item 7) --------------------------------------

def test_another_users_manifest_in_a_directory_of_mine_is_refused(tmp_path):
    """The owner of checkpoint.json alone: the checkpoint's directory is this user's, only its manifest is another
    user's (a uid this system does not know): refused naming them (the test given another user's whole checkpoint was
    answered by the directory's owner check first)."""
    if os.geteuid() != 0:
        skip_unless_ci("needs root, to make a file another user's")
    other = next(uid for uid in range(50000, 60000) if uid not in {u.pw_uid for u in pwd.getpwall()})
    write_manifest(str(tmp_path), manifest_with())
    assert read_manifest(str(tmp_path), contents=False)["step"] == 2
    manifest_json._PARSED.clear()
    os.chown(tmp_path / "checkpoint.json", other, other)
    assert tmp_path.stat().st_uid == os.geteuid()
    with pytest.raises(ValueError, match=f"checkpoint.json belongs to uid {other}, not to "):
        read_manifest(str(tmp_path), contents=False)


def test_recorded_sizes_beyond_what_the_model_holds_are_refused_alone():
    """The size bound alone (layout.size_limit: 40 bytes a parameter and 64 MB): a manifest of a fine step whose
    recorded sizes add up to one byte more than a checkpoint of the model holds is refused for that, and at the bound
    it is not (the planted step of the launch test was refused for its step number first)."""
    limit = size_limit(1000)
    files = {"model.safetensors": {"size": limit - 10, "sha256": "0" * 64},
             "optimizer.bin": {"size": 10, "sha256": "0" * 64}}
    at_bound = manifest_with(files=files)
    assert "GB of files" not in str(run_problem(at_bound, limit, 1, 1, 1))
    over = manifest_with(files={**files, "optimizer.bin": {"size": 11, "sha256": "0" * 64}})
    assert run_problem(over, limit, 1, 1, 1) == (
        f"its checkpoint.json records {(limit + 1) / 1e9:.3g} GB of files, more than a checkpoint of this model holds "
        f"({limit / 1e9:.3g} GB at most)")


def test_a_manifest_hard_linked_into_many_checkpoints_is_parsed_once(tmp_path, monkeypatch):
    """The parse cache keyed by the file (device, inode, size, mtime), not its path: one manifest under the 4 MB bound
    hard-linked into 50 directories is parsed once (the launch test's manifest was over 4 MB, refused by its size
    before the cache was reached, so a cache keyed by path passed it)."""
    parsed = []
    real = manifest_json._parsed
    monkeypatch.setattr(manifest_json, "_parsed", lambda data: parsed.append(len(data)) or real(data))
    manifest_json._PARSED.clear()
    first = tmp_path / "step-00000001"
    first.mkdir()
    write_manifest(str(first), manifest_with(train_state={"pad": "x" * (1 << 20)}))
    for step in range(2, 52):
        (tmp_path / f"step-{step:08d}").mkdir()
        os.link(first / "checkpoint.json", tmp_path / f"step-{step:08d}" / "checkpoint.json")
    for step in range(1, 52):
        assert read_manifest(str(tmp_path / f"step-{step:08d}"), contents=False)["step"] == 2
    assert len(parsed) == 1 and parsed[0] > 1 << 20


def test_the_base_fingerprint_samples_tensor_bytes(tmp_path):
    """The LoRA base fingerprint (finetune/weights.py) alone: a base whose weights changed in a sampled window, its
    file's names, header and size the same, has another fingerprint (the launch test changed --max-steps too, which
    refused first); a byte between the sampled windows does not change it (a sample, not a checksum)."""
    from safetensors.torch import save_file

    from accelrun.finetune.weights import WINDOW, fingerprint, safetensors_header

    save_file({"w": torch.arange(50_000, dtype=torch.float32)}, tmp_path / "model.safetensors")
    before = fingerprint(str(tmp_path))
    _, _, data = safetensors_header(str(tmp_path / "model.safetensors"))
    raw = bytearray((tmp_path / "model.safetensors").read_bytes())
    raw[data + WINDOW + 100] ^= 0xFF  # after the first window, before the middle one
    (tmp_path / "model.safetensors").write_bytes(bytes(raw))
    assert fingerprint(str(tmp_path)) == before
    raw[data + 100] ^= 0xFF  # inside the first window
    (tmp_path / "model.safetensors").write_bytes(bytes(raw))
    assert fingerprint(str(tmp_path)) != before
