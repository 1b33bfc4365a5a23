"""A checkpoint resumed on another world size or --grad-accum: its state brought onto this run's ranks.

Owns what rules.py's WORLD_SIZE_CHANGE and PER_RANK rules say is done, each rule in the one function its
row names:
  * DeepSpeed ZeRO on another world size: the checkpoint's ZeRO state as DeepSpeed's universal checkpoint,
    converted once by the main process into the checkpoint's universal/ part, with a manifest of its own, and
    verified by every rank like any checkpoint file (universal_part); loaded instead of the ZeRO files
    (loading_universal), with the repair of DeepSpeed 0.19.8's ZeRO-3 universal load (repair_zero3_universal_load).
    The conversion reads only the files the main process verified and holds, writes only into a directory it
    created and holds, and checks first every parameter name that becomes a path (path_names_problem); what
    DeepSpeed's converter prints stays out of the run's log unless it fails (converter_quiet);
  * each rank's own state: the RNG state of a new rank (rng_for_new_rank), FSDP's per-rank buffers
    (save_rank_buffers, load_rank_buffers), the open log window (reshaped_window), and accelerate's micro-batch
    counter (set_micro_batch_counter).
Whatever it reads from a checkpoint it reads through what was verified (held.HeldCheckpoint's view) and under
safe_loading.weights_only_loading: no file runs code.
"""

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import stat
import sys
import tempfile
import time

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..collectives import checked_by_every_rank, first_rank_problems, main_process_result
from ..engines import Engine
from ..exits import fail
from .files import entry_identity, file_table, listing
from .formats import of
from .held import HeldCheckpoint
from .layout import DERIVED, DERIVING
from .manifest import read_manifest, write_manifest
from .rules import saved_grad_accum
from .safe_loading import UnsafeCheckpointFile, plain_name, weights_only_loading
from .untrusted import shown

# A refused parameter name is planted, of any length: the refusal line shows its first characters (untrusted.shown).
NAME_SHOWN = 80


# ---- DeepSpeed ZeRO through the universal checkpoint -------------------------------------------------------
class ConversionReplaced(RuntimeError):
    """The conversion's directory was replaced while it wrote into it: someone else writes into the checkpoint."""


def needs_universal(manifest, now):
    """Whether the checkpoint's ZeRO state must go through the universal checkpoint: DeepSpeed on another world
    size (WORLD_SIZE_CHANGE), as the engine that wrote it says."""
    saved = manifest["layout"]
    return of(saved).needs_universal(saved, now)


def universal_part(accelerator, held, manifest):
    """Collective: the checkpoint's ZeRO state as DeepSpeed's universal checkpoint, which loads on any world
    size: PATH/universal, converted once (by the main process, from the files it verified and holds, weights-only)
    and kept as a derived part with its own manifest and checksums; every rank verifies its share of it like any
    checkpoint file. Returns it held (held.HeldCheckpoint): load through its view, then close it."""
    path = held.path
    derived = os.path.join(path, DERIVED)
    source = hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()
    error = None
    if accelerator.is_main_process:
        try:
            if entry_identity(held.root, DERIVED) is None:
                _convert(held, manifest, source)
        except UnsafeCheckpointFile as exc:
            error = (f"checkpoint {path} cannot be used: {exc}. This code never writes such a file: find out who "
                     f"did, and do not load it by other means.")
        except ConversionReplaced as exc:
            error = (f"checkpoint {path} cannot be used on {_processes(accelerator.num_processes)}: {exc}. Use a "
                     f"--checkpoint-dir only you can write to (chmod go-w), and check the files there")
        except Exception as exc:  # noqa: BLE001 - DeepSpeed's converter on a file it cannot use: one message
            error = (f"checkpoint {path} cannot be used on {_processes(accelerator.num_processes)}: converting its "
                     f"ZeRO state to DeepSpeed's universal checkpoint failed ({type(exc).__name__}: "
                     f"{(str(exc).splitlines() or [''])[0][:300]}). Relaunch with "
                     f"{_processes(manifest['layout']['world_size'])}.")
    main_process_result(accelerator, (None, error))
    part, problem = _derived_part(held, source)
    problem = first_rank_problems(accelerator, problem)[0]
    damage, unsafe = (problem, None) if problem else checked_by_every_rank(accelerator, part)
    if damage or unsafe:
        part.close()
        fail(accelerator, f"checkpoint {path} cannot be used on {_processes(accelerator.num_processes)}: its "
                          f"converted part {derived}: {damage or unsafe}. Remove {derived} to have it converted "
                          f"again, or relaunch with {_processes(manifest['layout']['world_size'])}.")
    return part


def _processes(n):
    return f"{n} process" + ("es" if n != 1 else "")


def _derived_part(held, source):
    """(the converted part, held once verified; None or why it is not a directory this code wrote from this
    checkpoint's files)."""
    derived = os.path.join(held.path, DERIVED)
    try:
        if not stat.S_ISDIR(os.stat(DERIVED, dir_fd=held.root, follow_symlinks=False).st_mode):
            raise ValueError("a symbolic link or a file, not a directory this code writes")
        derived_manifest = read_manifest(derived)
        if derived_manifest.get("derived_from") != source:
            raise ValueError("it was converted from other files than this checkpoint's")
        return HeldCheckpoint(derived, derived_manifest["files"], follow=False), None
    except (OSError, ValueError) as exc:
        return HeldCheckpoint(derived, {}, follow=False), str(exc)


def path_names_problem(held):
    """None, or why the names DeepSpeed's ds_to_universal would join into paths cannot be: every parameter name in
    the held checkpoint's ZeRO files (the model states' module and parameter shapes, the optimizer states' slice
    mappings) must be one plain path component, or the conversion would write outside its directory."""
    with weights_only_loading():
        for rel in sorted(held.files):
            if not (rel.startswith("pytorch_model/") and rel.endswith(("_model_states.pt", "_optim_states.pt"))):
                continue
            states = torch.load(held.fd_path(rel), map_location="cpu", mmap=True)
            if not isinstance(states, dict):
                return f"{rel}: refused (not the state dict DeepSpeed writes)"
            shared = states.get("shared_params") or {}
            groups = [states.get("module"), states.get("frozen_param_shapes"), states.get("param_shapes"), shared,
                      dict.fromkeys(shared.values()) if isinstance(shared, dict) else None,
                      *_slice_mappings(states)]
            for group in groups:
                for part in group if isinstance(group, list) else [group]:
                    bad = next((n for n in (part if isinstance(part, dict) else {}) if not plain_name(n)), None)
                    if bad is not None:
                        return f"{rel}: refused (it names a parameter {shown(bad, NAME_SHOWN)}, which a model's " \
                               f"parameter never is: the conversion would write outside its directory)"
    return None


def _slice_mappings(states):
    optimizer = states.get("optimizer_state_dict")
    mappings = optimizer.get("param_slice_mappings") if isinstance(optimizer, dict) else None
    return mappings if isinstance(mappings, list) else []


def _convert(held, manifest, source):
    """Main process: DeepSpeed's ds_to_universal, reading the checkpoint's files this process verified and holds
    (held.view()), writing only into .tmp-universal, a directory it creates (mode 0700) and holds open (the output
    path goes through its descriptor, so a link put in its place receives nothing), published by one rename only if
    .tmp-universal is still that directory; every parameter name checked first (path_names_problem)."""
    from deepspeed.checkpoint import ds_to_universal

    problem = path_names_problem(held)
    if problem:
        raise UnsafeCheckpointFile(problem)
    started, root = time.perf_counter(), held.root
    _remove_at(root, DERIVING)  # a conversion a kill interrupted, or a planted link
    os.mkdir(DERIVING, 0o700, dir_fd=root)
    fd = os.open(DERIVING, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root)
    try:
        st = os.fstat(fd)
        out = f"/proc/{os.getpid()}/fd/{fd}"
        # Accelerate's DeepSpeed checkpoints lack the universal_checkpoint_info a Megatron client writes; for a
        # plain data-parallel model its defaults (no tensor-parallel patterns) are right: inject_missing_state.
        args = argparse.Namespace(input_folder=os.path.join(held.view(), "pytorch_model"),
                                  output_folder=os.path.join(out, "pytorch_model"), num_extract_workers=1,
                                  num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
        # ds_to_universal's own torch.load calls ask for weights_only=False; what it prints is not the run's log
        with weights_only_loading(), converter_quiet():
            ds_to_universal.main(args)
        files = file_table(out, listing(out))
        write_manifest(out, {"step": manifest["step"], "layout": manifest["layout"], "derived_from": source,
                             "must_match": manifest["must_match"], "train_state": {}, "files": files})
        if entry_identity(root, DERIVING) != (st.st_dev, st.st_ino):
            _empty(fd)
            raise ConversionReplaced(f"{os.path.join(held.path, DERIVING)} was replaced while this run wrote into "
                                     f"it (someone else writes into {held.path}); nothing was published")
        os.replace(DERIVING, DERIVED, src_dir_fd=root, dst_dir_fd=root)
        os.fsync(root)
    finally:
        os.close(fd)
    print(f"converted {held.path}'s ZeRO state to DeepSpeed's universal checkpoint in "
          f"{os.path.join(held.path, DERIVED)} ({len(files)} files, {time.perf_counter() - started:.1f} s): later "
          f"resumes on another world size reuse it", flush=True)


# What a failed conversion shows of what DeepSpeed's converter printed: its end, where the cause is.
SHOWN_ON_FAILURE = 6000


@contextlib.contextmanager
def converter_quiet():
    """While DeepSpeed's converter runs, what it prints stays out of the run's log: its steps and banners, its own
    tqdm bars (carriage returns), the temporary /proc/PID/fd paths it writes through, "No AutoEP layers found".
    Caught at Python's streams (print, tqdm) and at file descriptors 1 and 2 (a logger's handler holds the stream it
    was given, a library may write to the descriptor); shown on stderr, its end, if the conversion fails. The run's
    own line follows the conversion (_convert)."""
    streams = (sys.stdout, sys.stderr)
    for stream in streams:
        stream.flush()
    saved = os.dup(1), os.dup(2)
    failed = False
    with tempfile.TemporaryFile() as sink, io.StringIO() as text:
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield
        except BaseException:
            failed = True
            raise
        finally:
            for stream in streams:
                stream.flush()
            for fd, own in zip((1, 2), saved):
                os.dup2(own, fd)
                os.close(own)
            if failed:
                sink.seek(0)
                printed = text.getvalue() + sink.read().decode(errors="replace")
                sys.stderr.write(f"DeepSpeed's converter printed:\n{printed[-SHOWN_ON_FAILURE:]}\n")
                sys.stderr.flush()


def _remove_at(dir_fd, name):
    """Remove whatever is at `name` in the directory dir_fd: a tree, or a link or file itself (never followed)."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


def _empty(dir_fd):
    """Give back what a conversion wrote into the directory it holds, wherever that directory went."""
    for name in os.listdir(dir_fd):
        _remove_at(dir_fd, name)


@contextlib.contextmanager
def loading_universal(ds_engine, root):
    """While active (root given), accelerate's load_state reads the DeepSpeed engine's state from the universal
    checkpoint under root instead of the checkpoint's own ZeRO files; the rest (scheduler, RNG) as usual."""
    if root is None:
        yield
        return
    own = ds_engine.load_checkpoint

    def load_checkpoint(load_dir, tag=None, **kwargs):
        loaded = own(root, tag, **kwargs)
        if ds_engine.zero_optimization_stage() == 3 and kwargs.get("load_optimizer_states", True):
            saved = os.path.join(root, tag, "zero", "optimizer_state.pt")
            repair_zero3_universal_load(ds_engine.optimizer.optimizer, saved)
        return loaded

    ds_engine._config.load_universal_checkpoint = True
    ds_engine.load_checkpoint = load_checkpoint
    try:
        yield
    finally:
        del ds_engine.load_checkpoint
        ds_engine._config.load_universal_checkpoint = False


def repair_zero3_universal_load(optimizer, path):
    """Two faults of ZeRO-3's universal load (DeepSpeed 0.19.8, stage3.load_hp_checkpoint_state_from_checkpoint_
    dir_stage3) that made the training drift (0.2% in the loss 8 steps after a 2 -> 1 resume, the step most of
    it): it gives every parameter group's state one and the same `step` tensor, which ZeRO-3's step of each
    group then increments in place, so Adam's bias correction runs ahead; and it gives every group the first
    group's settings, so the gpt recipe's group without weight decay decays. Each group takes its own step
    tensor and its own settings back from the converted optimizer_state.pt (under weights_only_loading: the
    file runs no code)."""
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    saved = torch.load(path)["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"{path} holds {len(saved)} parameter groups and the optimizer {len(optimizer.param_groups)}")
    for group, settings in zip(optimizer.param_groups, saved):
        group.update({key: value for key, value in settings.items() if key != "params"})


# ---- each rank's own state (PER_RANK) ----------------------------------------------------------------------
def rng_for_new_rank(accelerator, path, manifest):
    """After load_state, which gave a rank the checkpoint has its own RNG state: a new rank (the checkpoint was
    written by fewer processes) takes rank 0's, as load_state sets its own. Call under weights_only_loading."""
    if accelerator.process_index < manifest["layout"]["world_size"]:
        return
    states = torch.load(os.path.join(path, "random_states_0.pkl"))
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"][:torch.cuda.device_count()])


# FSDP's sharded checkpoint keeps one copy of a buffer, but BatchNorm statistics differ per rank: keep each.
def save_rank_buffers(accelerator, model, root):
    """FSDP (an engine that keeps_rank_buffers): this rank's buffers into root/rank-R.buffers.safetensors."""
    if Engine.of(accelerator).keeps_rank_buffers:
        buffers = {name: b.detach().cpu().contiguous() for name, b in model.named_buffers()}
        save_file(buffers, os.path.join(root, f"rank-{accelerator.process_index}.buffers.safetensors"))


def load_rank_buffers(accelerator, model, root):
    """FSDP (an engine that keeps_rank_buffers): this rank's buffers; a rank the checkpoint does not have (written by
    fewer processes) takes rank 0's."""
    path = os.path.join(root, f"rank-{accelerator.process_index}.buffers.safetensors")
    if not os.path.exists(path):
        path = os.path.join(root, "rank-0.buffers.safetensors")
    if Engine.of(accelerator).keeps_rank_buffers and os.path.exists(path):
        saved = load_file(path)
        for name, b in ((n, b) for n, b in model.named_buffers() if n in saved):
            b.copy_(saved[name].to(b.device))


def reshaped_window(window, manifest, now):
    """The checkpoint's open log window as this run's ranks carry it: unchanged when the world size and
    --grad-accum are; otherwise the mean loss over the old ranks on every new rank, its micro-batch count
    converted to the new --grad-accum (a window starts at an optimizer step, so its count is a whole number of
    optimizer steps). Every rank then has an entry of its own."""
    old_accum = saved_grad_accum(manifest, now)
    sums, micro = window["loss_sums"], window["micro"]
    if len(sums) == now["world_size"] and old_accum == now["grad_accum"]:
        return window
    new_micro = micro // old_accum * now["grad_accum"]
    mean = sum(sums) / len(sums) / micro if micro else 0.0
    return {**window, "loss_sums": [mean * new_micro] * now["world_size"], "micro": new_micro}


def set_micro_batch_counter(accelerator, step):
    """After load_state, which restored accelerate's micro-batch counter: its remainder modulo the accumulation
    steps decides which micro-batch syncs, so after a change of --grad-accum it must fall on an optimizer step
    again: the checkpoint's step x this run's accumulation steps."""
    accelerator.step = step * accelerator.gradient_accumulation_steps
