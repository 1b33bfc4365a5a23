"""checkpoint.json, a checkpoint's manifest: its schema, read once and checked field by field, written once.

Owns (docs/checkpoints.md, "What a checkpoint can and cannot do"):
* the format version a manifest records (layout.FORMAT_VERSION): new saves write it, a manifest of an earlier one
  this code still reads verifies by the checksum it recorded, and one of another version, or of none (written
  before it was recorded), is refused in one line naming the version (train_state.version_problem);
* every field's type and range (read_manifest), the layout's included (the family and ZeRO stage one of formats.py's
  formats writes), and the training state Run keeps in it (train_state.py, which the stop command reads too); a
  manifest on shared storage is untrusted, and a field of another type would otherwise surface as a traceback deep in
  a resume;
* reading it (train_state.read_json: one descriptor, bounded, parsed once per process) and, with contents, that the
  checkpoint holds exactly the files it lists (files.coverage);
* writing it once, never over a file or through a link another wrote (write_manifest);
* which recipe wrote it (another_recipe), and whether it is one this run's save would have written (run_problem).
"""

import json
import os
import re

from .files import coverage, file_table, recorded
from .formats import FORMATS, files_problem, fingerprint
from .layout import FORMAT_VERSION, LAYOUT_MAX, MANIFEST
from .train_state import TRAIN_STATE, WINDOW_STATE, read_json, state_problem, version_problem
from .untrusted import shown, whole

MANIFEST_FIELDS = {"format_version", "step", "layout", "must_match", "train_state", "files"}
OPTIONAL_FIELDS = {"recipe", "derived_from"}  # the recipe that wrote it (since issue 36); a derived part's source
LAYOUT_FIELDS = {"family", "zero_stage", "world_size"}  # engines.Engine.layout writes them always,
LAYOUT_OPTIONAL = {"grad_accum", "sequence_parallel"}  # these where they apply


def _plain_path(rel):
    """A relative path of plain names: no absolute part, no '..', '.' or empty component."""
    parts = rel.split("/") if isinstance(rel, str) else []
    return bool(parts) and "\0" not in rel and all(p not in ("", ".", "..") for p in parts)


def _is_sha256(value):
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def _layout_problem(layout):
    """None, or why a manifest's layout is not one engines.Engine.layout writes."""
    if not (isinstance(layout, dict) and LAYOUT_FIELDS <= set(layout) <= LAYOUT_FIELDS | LAYOUT_OPTIONAL):
        return "its layout is not one this code writes"
    family, stage = layout["family"], layout["zero_stage"]
    engine = FORMATS.get(family) if isinstance(family, str) else None
    if engine is None:
        return f"its layout names an engine this code does not write ({shown(family)})"
    if not engine.writes_stage(stage):
        return f"its layout's zero_stage {shown(stage)} is not one a {family} run writes"
    if not whole(layout["world_size"], 1, LAYOUT_MAX):
        return f"its layout's world_size {shown(layout['world_size'])} is not a number of processes"
    if "grad_accum" in layout and not whole(layout["grad_accum"], 1, LAYOUT_MAX):
        return f"its layout's grad_accum {shown(layout['grad_accum'])} is not a number of micro-batches"
    if "sequence_parallel" in layout and not whole(layout["sequence_parallel"], 2, layout["world_size"]):
        return f"its layout's sequence_parallel {shown(layout['sequence_parallel'])} is not a size of process groups"
    return None


def read_manifest(path, contents=True):
    """The checkpoint's manifest, or raise ValueError saying why there is none to use (cheap: no hashing). Its format
    version first, then every field is checked for its type and range (a train_state's own fields are
    state_problem's to check). contents: also check that the checkpoint holds exactly the files it lists, each a
    regular file of its recorded size (lstat: nothing is opened or followed)."""
    manifest = read_json(path)
    problem = version_problem(manifest)
    if problem:
        raise ValueError(problem)
    if not (isinstance(manifest, dict) and MANIFEST_FIELDS <= set(manifest) <= MANIFEST_FIELDS | OPTIONAL_FIELDS
            and whole(manifest["step"]) and isinstance(manifest["must_match"], dict)
            and isinstance(manifest["train_state"], dict) and isinstance(manifest["files"], dict)
            and isinstance(manifest.get("recipe", ""), str) and _is_sha256(manifest.get("derived_from", "0" * 64))):
        raise ValueError(f"{MANIFEST} is not a manifest this code wrote")
    problem = _layout_problem(manifest["layout"]) or FORMATS[manifest["layout"]["family"]].older_format_problem(
        manifest["format_version"], manifest)
    if problem:
        raise ValueError(f"{MANIFEST}: {problem}")
    for rel, want in manifest["files"].items():
        if not _plain_path(rel) or rel == MANIFEST:
            raise ValueError(f"{MANIFEST} names {rel!r}, which is not a file inside the checkpoint")
        if not (recorded(want) and whole(want["size"])):  # {size, xxh3_128}, or {size, sha256} (formats 1, 2)
            raise ValueError(f"{MANIFEST} records no valid size and checksum for {rel!r}")
    if contents:
        problem = coverage(path, manifest["files"])
        if problem:
            raise ValueError(problem)
    return manifest


def write_manifest(directory, manifest):
    """directory/checkpoint.json, with this code's format version, written once (never over a file or through a link
    another wrote) and synced."""
    fd = os.open(os.path.join(directory, MANIFEST), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump({"format_version": FORMAT_VERSION, **manifest}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def another_recipe(manifest, recipe):
    """The recipe that wrote the checkpoint when it is not `recipe` (this run's), else None. A manifest written before
    manifests named their recipe names none: then the settings tell (rules.incompatibility)."""
    other = manifest.get("recipe")
    return other if recipe and other and other != recipe else None


def run_problem(manifest, size_limit, models, optimizers, schedulers):
    """None, or why a manifest that read_manifest accepts is not one this run's save would have written: its files
    together larger than a checkpoint of this run's model holds (size_limit: nothing beyond it is hashed), its
    train_state, or its files not exactly those its engine and layout write for this many models, optimizers and
    schedulers."""
    total = sum(want["size"] for want in manifest["files"].values())
    if total > size_limit:
        return f"its {MANIFEST} records {total / 1e9:.3g} GB of files, more than a checkpoint of this model " \
               f"holds ({size_limit / 1e9:.3g} GB at most)"
    return state_problem(manifest) or files_problem(manifest, models, optimizers, schedulers)


def format_fingerprint():
    """What a save writes and records, as plain data to compare: per engine format, its files and LoRA's rule
    (formats.fingerprint); the manifest's fields, its layout's and its train_state's; and the entry it records for a
    file (files.file_table of 8 known bytes: its fields and checksum). A change here is a change of the checkpoint
    format: tests/test_format_version.py fails until layout.FORMAT_VERSION moves with it (docs/checkpoints.md, "What
    a format version promises")."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        with open(os.path.join(scratch, "probe"), "wb") as f:
            f.write(b"accelrun")
        entry = file_table(scratch, ["probe"])["probe"]
    return {"formats": fingerprint(),
            "manifest": {"fields": sorted(MANIFEST_FIELDS), "optional": sorted(OPTIONAL_FIELDS),
                         "layout": sorted(LAYOUT_FIELDS), "layout_optional": sorted(LAYOUT_OPTIONAL),
                         "train_state": sorted(TRAIN_STATE), "window": sorted(WINDOW_STATE), "file_entry": entry}}

