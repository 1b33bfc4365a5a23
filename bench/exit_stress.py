"""Do 2-process runs exit cleanly? Launch the quickstart and a accelrun recipe many times and count the aborts.

    python bench/exit_stress.py                          # 50 runs each of 2 scripts x 3 configs: 300 launches
    python bench/exit_stress.py --runs 5 --parallel 3    # a quick look, 3 launches at a time

A rank's process could abort at exit, after its work was done ("terminate called without an active
exception", SIGABRT): gloo's worker threads racing Python's interpreter finalization
(docs/troubleshooting.md, Findings). It is rare and depends on timing, so one launch says nothing:
this launches `recipes/quickstart/with_accelerate.py` (plain accelerate, ending with end_training) and
`recipes/linear_regression.py` (accelrun's teardown) as 2 processes on the CPU under 2gpu.yaml, ZeRO-2 and
FSDP (fp32), --runs times each, --parallel launches at a time (a loaded machine shows the race more
often), and counts per script and config the launches whose output shows a process that aborted or
crashed, and the launches that failed otherwise. It prints the table and exits 1 if any launch aborted or
failed. It is not part of the test suite (300 launches take about an hour on 2 cores); the suite checks
every one of its own launches the same way (tests/helpers/launching.py, check_exit).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from accelrun.data.synthetic_mnist import write_synthetic_mnist  # noqa: E402
from accelrun.exits import SELF_INFLICTED  # noqa: E402  (the pattern the tests' check_exit looks for too)
from benchmark import deepspeed_json_in, free_port  # noqa: E402

STRESSED = ["2gpu.yaml", "deepspeed_zero2.yaml", "fsdp.yaml"]
SCRIPTS = {
    "quickstart": ["recipes/quickstart/with_accelerate.py", "--epochs", "1", "--batch-size", "64"],
    "accelrun (linear_regression)": ["recipes/linear_regression.py", "--epochs", "2", "--num-points", "256",
                                   "--batch-size", "32"],
}


def launch(config, script, work, index):
    """One launch: (aborted, failed, seconds, log path)."""
    out = work / f"{script.split()[0]}-{config}-{index}"
    args = ["--config_file", str(REPO / "accelerate_configs" / config), "--main_process_port", str(free_port()),
            "--mixed_precision", "no"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if config == "2gpu.yaml":
        env["ACCELERATE_USE_CPU"] = "1"  # accelerate's own CPU route for DDP
    else:
        env["PYTHONPATH"] = str(REPO / "cpu_route")  # DeepSpeed and FSDP on a CPU
        fp32 = deepspeed_json_in(config, "no", work)
        args += ["--deepspeed_config_file", str(fp32)] if fp32 else []
    recipe, *recipe_args = SCRIPTS[script]
    where = ["--data-dir", str(work / "mnist")] if script == "quickstart" else ["--output-dir", str(out)]
    started = time.perf_counter()
    result = subprocess.run(["accelerate", "launch", *args, recipe, *where, *recipe_args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    seconds = time.perf_counter() - started
    log = work / f"{out.name}.log"
    log.write_text(result.stdout)
    aborted = SELF_INFLICTED.search(result.stdout) is not None
    return aborted, result.returncode != 0 and not aborted, seconds, log


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--runs", type=int, default=50, help="launches of each script under each config")
    p.add_argument("--parallel", type=int, default=2, help="launches at a time (each is 2 processes)")
    p.add_argument("--configs", nargs="+", default=STRESSED, help="configs from accelerate_configs/")
    p.add_argument("--keep-logs", default=None, help="a folder to keep every launch's log in (default: removed)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep_logs or tmp)
        work.mkdir(parents=True, exist_ok=True)
        write_synthetic_mnist(work / "mnist", 2000, 501, seed=0)  # laid out as torchvision's MNIST reads it
        jobs = [(config, script, i) for i in range(args.runs) for config in args.configs for script in SCRIPTS]
        tally = {(config, script): [0, 0, 0, 0.0] for config in args.configs for script in SCRIPTS}
        print(f"{len(jobs)} launches, {args.parallel} at a time", flush=True)
        with ThreadPoolExecutor(args.parallel) as pool:
            futures = [(job, pool.submit(launch, job[0], job[1], work, job[2])) for job in jobs]
            for done, ((config, script, _), future) in enumerate(futures, 1):
                aborted, failed, seconds, log = future.result()
                row = tally[config, script]
                row[0], row[1], row[2], row[3] = row[0] + 1, row[1] + aborted, row[2] + failed, row[3] + seconds
                if aborted or failed:
                    print(f"{'ABORTED' if aborted else 'FAILED'}: {script} under {config}: {log}", flush=True)
                if done % 10 == 0:
                    print(f"{done}/{len(jobs)} launches done", flush=True)
    print("\n| script | config | launches | aborted | failed otherwise | mean s |\n|---|---|---|---|---|---|")
    for (config, script), (n, aborted, failed, seconds) in tally.items():
        print(f"| {script} | {config} | {n} | {aborted} | {failed} | {seconds / max(n, 1):.1f} |")
    aborts = sum(row[1] for row in tally.values())
    failures = sum(row[2] for row in tally.values())
    print(f"\n{aborts} of {len(jobs)} launches aborted, {failures} failed otherwise", flush=True)
    return 1 if aborts or failures else 0


if __name__ == "__main__":
    sys.exit(main())
