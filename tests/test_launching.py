"""The shared launch helper's own check (helpers/launching.py, check_exit): every launch in the suite fails when one
of its processes aborts or crashes, even after its work is done and whatever its exit code (issue: two
processes that finish their work must exit cleanly)."""

import sys

import pytest

from launching import check_exit, free_port, run_command

ABORT_AFTER_WORK = """
import os, sys, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
dist.barrier()
print(f"rank {rank}: work done", flush=True)
if rank == int(sys.argv[1]):
    os.abort()  # what std::terminate does: SIGABRT
dist.destroy_process_group()
"""


def test_a_rank_that_aborts_after_its_work_fails_the_launch(tmp_path):
    script = tmp_path / "abort_after_work.py"
    script.write_text(ABORT_AFTER_WORK)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(script)]
    with pytest.raises(pytest.fail.Exception, match="a process aborted or crashed"):
        run_command(cmd + ["1"], timeout=120)
    code, output = run_command(cmd + ["-1"], timeout=120)  # nobody aborts: the same launch passes the check
    assert code == 0 and output.count("work done") == 2, output[-2000:]


@pytest.mark.parametrize("output", [
    "epoch 1: train loss 1.8644\nterminate called without an active exception\n",
    "  exitcode  : -6 (pid: 4242)\n  error_file: <N/A>\n",
    "  traceback : Signal 11 (SIGSEGV) received by PID 4242\n",
])
def test_check_exit_names_the_crash(output):
    with pytest.raises(pytest.fail.Exception, match="a process aborted or crashed"):
        check_exit(output)


@pytest.mark.parametrize("output", [
    "  exitcode  : -9 (pid: 4242)\n  traceback : Signal 9 (SIGKILL) received by PID 4242\n",  # a test killed it
    "error: --lr must be positive\n",
    "stopped by SIGTERM after step 4: checkpoint saved\n",
])
def test_check_exit_leaves_what_tests_do_on_purpose(output):
    check_exit(output)
