"""The whole GPU check in one command on a GPU node without internet: the offline install, the GPU pack, then the
GPU table, in the caller's time budget, everything kept as it comes (issue 42).

    bash gpu_check/run.sh --budget-s 540        # on the GPU node, .gpu/w copied with the tree (README, "On a GPU")
    bash gpu_check/run.sh --dry-run             # anywhere, CUDA or not: the plan, the budget split and the order
    bash gpu_check/run.sh pack                  # one phase alone (or: table), with the whole budget

Owns the order, the budget split and the supervision of the three phases:
  1. the install (gpu_check/gpu_wheels.py): prebuilt wheels from .gpu/w, no index, every import checked; a missing
     wheel or import is named in one line and the check exits 2 before anything runs;
  2. the pack: `pytest tests/test_gpu.py -m gpu` (that file alone: each xdist worker collects nothing else, and no
     other module's import can abort it) on 8 workers ($PACK_WORKERS) sharing the GPU, the cores shared among their
     inductor workers; capped at PACK_SHARE of the budget (PACK_MIN_S..PACK_MAX_S), each launch at what is left of
     the cap after the workers' start (a hung launch fails its test, not the pack); at the cap pytest gets SIGINT,
     then SIGKILL. gpu_check/pack_report.py records each test as it ends, so what was not reached is known;
  3. the table (gpu_check/gpu_table.py): the fine-tune parts first, in what is left of the budget but END_S, which
     is kept for the last report. Its files are rewritten the moment each part ends.
A lower budget shortens the table (its last parts are listed as not reached) instead of losing it. Every process a
phase starts carries a mark in its environment: whatever outlives its phase is ended by it (kill_marked).
Writes into --out (default bench/results/<date>-gpu-check/): README.md (the plan, the budget, the install, the
pack; rewritten after each phase), pack.log, pack.jsonl, table.md, table.json, failures.log. Its output is a line
per phase and the table's lines, which end with table.md (a batch job's log then holds the whole result). Exit 2:
no CUDA, or the install refused (one line); 1: a pack test failed or was not reached, or a table part failed (parts
the budget did not reach are listed, not failed); else 0.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import gpu_table
import gpu_wheels
from gpu_wheels import REPO

END_S = 20  # kept at the end: the table's last files, README.md, the processes' exit
INSTALL_EXPECTED_S = 30  # for the plan of a dry run: pip with no index, then the imports (torch, DeepSpeed...)
PACK_SHARE, PACK_MIN_S, PACK_MAX_S = 0.35, 60, 210
PACK_STARTUP_S = 30  # a worker's start before its first launch: torch, the collection, gpu_data's files
TABLE_MIN_S = 60  # less than this and the table would reach no part
STOP_GRACE_S = 20  # after SIGINT (the pack) or SIGTERM (the table): time to write what was done
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
MARK = "GPU_CALL_MARK"


def split_budget(budget_s, install_s, only=None):
    """{phase: seconds} of a call: the install (as it went, or as expected), the pack's cap and each of its
    launches', the table's share (it also gets what the pack leaves unused), and END_S."""
    left = max(0.0, budget_s - install_s - END_S)
    pack = 0.0 if only == "table" else left if only == "pack" else min(max(PACK_SHARE * left, PACK_MIN_S),
                                                                      PACK_MAX_S, left)
    table = 0.0 if only == "pack" else left - pack
    return {"budget": budget_s, "install": install_s, "pack": pack,
            "launch": max(0.0, pack - PACK_STARTUP_S) if pack >= PACK_MIN_S else 0.0,
            "table": table if table >= TABLE_MIN_S else 0.0, "end": END_S}


def pack_workers(cores):
    """pytest-xdist workers sharing the one GPU: its launches are small; a test is mostly process start-up and
    compilation, which the cores share."""
    return int(os.environ.get("PACK_WORKERS") or min(8, max(2, cores // 2)))


def pack_command(workers, python=sys.executable):
    return [python, "-m", "pytest", "tests/test_gpu.py", "-m", "gpu", "-v", "-p", "no:cacheprovider", "-p",
            "pack_report", "--continue-on-collection-errors", "-n", str(workers), "--dist", "worksteal",
            "--durations=0"]


def kill_marked(mark):
    """SIGKILL every process whose environment carries MARK=mark (a phase's leftovers, in any session)."""
    needle = f"{MARK}={mark}".encode() + b"\0"
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
        except (OSError, ProcessLookupError):
            continue  # gone, or another user's
    return killed


def supervise(cmd, env, cap_s, stop, log_path=None):
    """cmd in its own session with a fresh MARK, for at most cap_s, then `stop` (a signal) to its group and
    SIGKILL after STOP_GRACE_S; whatever of it is left then is killed. Returns (exit code, stopped at the cap)."""
    mark = uuid.uuid4().hex
    log = open(log_path, "w") if log_path else None
    try:
        proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, **env, **{MARK: mark}), stdout=log,
                                stderr=subprocess.STDOUT if log else None, start_new_session=True)
        try:
            return proc.wait(timeout=max(cap_s, 1)), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, stop)
            try:
                return proc.wait(timeout=STOP_GRACE_S), True
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                return proc.wait(), True
    finally:
        kill_marked(mark)
        if log:
            log.close()


def pack_summary(record_path):
    """What the pack's record says: {"collected", "outcomes": {test: outcome}, "not_reached": [tests]}."""
    collected, outcomes = [], {}
    if Path(record_path).exists():
        for line in Path(record_path).read_text().splitlines():
            entry = json.loads(line)
            if "collected" in entry:
                collected = collected or entry["collected"]
            elif outcomes.get(entry["test"]) in (None, "passed"):  # a failed teardown after a passed call counts
                outcomes[entry["test"]] = entry["outcome"]
    return {"collected": collected, "outcomes": outcomes, "not_reached": [t for t in collected if t not in outcomes]}


def pack_lines(summary, code, stopped, seconds, workers):
    counts = {}
    for outcome in summary["outcomes"].values():
        counts[outcome] = counts.get(outcome, 0) + 1
    said = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no test reported"
    end = f"stopped at its cap after {seconds:.0f} s" if stopped else f"pytest exit {code} in {seconds:.0f} s"
    lines = [f"pack: {said}, {len(summary['not_reached'])} not reached, of {len(summary['collected'])} collected "
             f"({end}, {workers} workers; pack.log, pack.jsonl)"]
    lines += [f"- {outcome}: {test}" for test, outcome in summary["outcomes"].items() if outcome == "failed"]
    lines += [f"- not reached: {test}" for test in summary["not_reached"]]
    return lines


class Call:
    """The call's README.md in the output folder, rewritten after each phase."""

    def __init__(self, out, budget):
        self.out, self.budget, self.lines = out, budget, {}
        out.mkdir(parents=True, exist_ok=True)

    def say(self, phase, lines):
        self.lines[phase] = lines
        print("\n".join(f"gpu call: {line}" for line in lines), flush=True)
        text = "\n".join(["# GPU call", "", *(line for phase in self.lines.values() for line in [*phase, ""])])
        gpu_table.write_atomically(self.out / "README.md", text)


def budget_line(split):
    return (f"budget: {split['budget']:.0f} s = install {split['install']:.0f} s + pack cap {split['pack']:.0f} s "
            f"(each launch at most {split['launch']:.0f} s) + table {split['table']:.0f} s (and what the pack leaves) "
            f"+ {split['end']:.0f} s kept for the end")


def device_facts(python):
    """(CUDA here, one line on the machine) from a fresh interpreter: this process never holds the GPU."""
    probe = ("import os, sys, torch; ok = torch.cuda.is_available(); print(ok); print(f'{torch.cuda.device_count()} x "
             "{torch.cuda.get_device_name(0)}, ' if ok else 'no CUDA device, ', f'{os.cpu_count()} cores; torch "
             "{torch.__version__}, CUDA {torch.version.cuda}, python {sys.version.split()[0]}', sep='')")
    proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    lines = proc.stdout.splitlines()
    return (lines[:1] == ["True"], lines[1] if len(lines) > 1 else proc.stderr.strip()[-300:])


def run_install(call, wheels, python):
    """0, or 2 after one line (Refused) on stderr and in README.md."""
    begun = time.monotonic()
    try:
        if not wheels.is_dir() and not gpu_wheels.import_check(python, gpu_wheels.IMPORTS, [])["failed"]:
            call.say("install", [f"install: nothing to install (no {wheels}, and every import works)"])
            return 0
        warnings = gpu_wheels.install(wheels, python)
    except gpu_wheels.Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        call.say("install", [f"install: refused: {exc}"])
        return 2
    call.say("install", [f"install: {len(gpu_wheels.CARRY)} wheels from {wheels} in {time.monotonic() - begun:.0f} s; "
                         f"imported: {', '.join(gpu_wheels.IMPORTS)}", *(f"- warning: {w}" for w in warnings)])
    return 0


def run_pack(call, split, python):
    """The pack (module docstring, 2); returns whether every test passed (or was skipped) and none was left."""
    cores = os.cpu_count() or 2
    workers = pack_workers(cores)
    record = call.out / "pack.jsonl"
    record.unlink(missing_ok=True)
    env = {**OFFLINE, "GPU_PACK_RECORD": str(record), "GPU_PACK_LAUNCH_S": f"{split['launch']:.0f}",
           "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, cores // workers)),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "gpu_check"), os.environ.get("PYTHONPATH")]))}
    begun = time.monotonic()
    code, stopped = supervise(pack_command(workers, python), env, split["pack"], signal.SIGINT, call.out / "pack.log")
    summary = pack_summary(record)
    call.say("pack", pack_lines(summary, code, stopped, time.monotonic() - begun, workers))
    return code == 0 and not stopped and not summary["not_reached"] and bool(summary["collected"])


def run_table(call, seconds, python, parts=None):
    """The table in `seconds` (it stops itself; SIGTERM if it overruns); returns whether no part failed (parts the
    budget did not reach are listed, not failed)."""
    if seconds < TABLE_MIN_S:
        call.say("table", [f"table: not reached: {seconds:.0f} s of the budget left"])
        return True
    cmd = [python, str(REPO / "gpu_check" / "gpu_table.py"), "--budget-s", f"{seconds:.0f}", "--out", str(call.out),
           *(["--parts", *parts] if parts else [])]
    begun = time.monotonic()
    code, stopped = supervise(cmd, OFFLINE, seconds + STOP_GRACE_S, signal.SIGTERM)
    call.say("table", [f"table: {'stopped past its budget' if stopped else f'exit {code}'} after "
                       f"{time.monotonic() - begun:.0f} s: table.md, table.json, failures.log"])
    return code == 0


def dry_run(args, python):
    cuda, machine = device_facts(python)
    split = split_budget(args.budget_s, INSTALL_EXPECTED_S, args.only)
    cores = os.cpu_count() or 2
    try:
        wheels = f"{len(gpu_wheels.to_install(args.wheels))} wheels ready in {args.wheels}"
    except gpu_wheels.Refused as exc:
        wheels = f"not ready: {exc}"
    pack = "left out" if args.only == "table" else f"at most {split['pack']:.0f} s"
    table = "left out" if args.only == "pack" else f"{split['table']:.0f} s and what the pack leaves"
    command = " ".join(pack_command(pack_workers(cores), "python3")[1:])
    lines = ["dry run: nothing is installed, launched or measured",
             f"this machine: {machine}; CUDA {'present' if cuda else 'absent: a real call here stops (exit 2)'}",
             budget_line(split), "order:", f"  1. install: {wheels}; then import {', '.join(gpu_wheels.IMPORTS)}",
             f"  2. pack ({pack}): python3 {command} (here {cores} cores: {pack_workers(cores)} workers; 16 cores: "
             f"{pack_workers(16)})", f"  3. table ({table}):",
             *(f"  {line}" for line in gpu_table.plan_lines(args.selected, split["table"])),
             f"output: {args.out}: README.md, pack.log, pack.jsonl, table.md, table.json, failures.log"]
    print("\n".join(f"gpu call: {line}" for line in lines))
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bash gpu_check/run.sh", description=__doc__.split("\n")[0],
                                epilog="Where pip works, `bash gpu_check/run.sh prepare` builds .gpu/w first.")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="seconds for the whole check, install included (give the time you have, less a minute)")
    p.add_argument("--only", choices=["pack", "table"], default=None, help="one phase, with the whole budget")
    p.add_argument("--parts", nargs="+", default=None,
                   help="the table's parts to run (default: all; gpu_check/gpu_table.py PARTS), in PARTS' order")
    p.add_argument("--dry-run", action="store_true", help="print the plan, the budget split and the order; run nothing")
    p.add_argument("--wheels", type=Path, default=gpu_wheels.WHEELS, help="the prepared wheels (default .gpu/w)")
    p.add_argument("--out", type=Path, default=None,
                   help="the folder for the results (default: bench/results/<date>-gpu-check)")
    args = gpu_wheels.one_line_errors(p).parse_args(argv)
    try:
        args.selected = gpu_table.selected(args.parts)
    except ValueError as exc:
        p.error(f"--parts: {exc}")
    args.out = (args.out or REPO / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-gpu-check").resolve()
    return args


def main(argv=None):
    args, python = parse_args(argv), sys.executable
    if args.dry_run:
        return dry_run(args, python)
    started = time.monotonic()
    cuda, machine = device_facts(python)
    if not cuda:
        print("error: no CUDA device here: the GPU check needs one (see its plan with --dry-run; on a CPU run the "
              "suite: README, 'Tests')", file=sys.stderr)
        return 2
    call = Call(args.out, args.budget_s)
    call.say("machine", [f"machine: {machine}"])
    if run_install(call, args.wheels, python):
        return 2
    split = split_budget(args.budget_s, time.monotonic() - started, args.only)
    call.say("budget", [budget_line(split)])
    complete = True
    if split["pack"]:
        complete = run_pack(call, split, python)
    if args.only != "pack":
        complete = run_table(call, args.budget_s - END_S - (time.monotonic() - started), python,
                             args.parts) and complete
    call.say("end", [f"end after {time.monotonic() - started:.0f} s of {args.budget_s:.0f}: "
                     f"{'nothing failed' if complete else 'a test failed or was not reached, or a table part failed'}"
                     f"; the files are in {call.out}"])
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
