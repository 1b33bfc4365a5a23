"""cpu_route/: DeepSpeed's CPU ops built once per environment and announced when they really are built, and the gloo
threads' wait in end_training (quick, no launch)."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from launching import REPO


def load_route():
    spec = importlib.util.spec_from_file_location("cpu_route_under_test", REPO / "cpu_route" / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # outside a launched worker (no LOCAL_RANK) it patches nothing
    return module


def test_each_python_environment_gets_its_own_extensions_directory(monkeypatch, tmp_path):
    """torch's default, ~/.cache/torch_extensions/py311_cpu, is shared by every environment of one Python version:
    two environments whose torch or DeepSpeed differ rebuilt each other's ops at every switch (minutes each)."""
    route = load_route()
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(sys, "prefix", "/envs/one")
    one = route.extensions_dir(None)
    monkeypatch.setattr(sys, "prefix", "/envs/two")
    two = route.extensions_dir(None)
    assert one != two and os.path.dirname(one) == os.path.dirname(two) == str(tmp_path / "torch_extensions")
    assert os.path.basename(one).startswith(f"py{sys.version_info.major}{sys.version_info.minor}")
    assert "-one-" in os.path.basename(one) and route.extensions_dir(None) == two  # stable for one environment
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert route.extensions_dir(None) == str(tmp_path / "mine")  # the user's choice stands


BUILD = """
import importlib.util, sys
from torch.utils import cpp_extension
spec = importlib.util.spec_from_file_location("route", sys.argv[1])
route = importlib.util.module_from_spec(spec)
spec.loader.exec_module(route)
route._announce_builds(cpp_extension)
cpp_extension.load(name="tiny_op", sources=[sys.argv[2]], extra_cflags=sys.argv[3:], is_python_module=False)
print("loaded", flush=True)
"""


@pytest.mark.slow
def test_a_build_is_announced_when_it_really_happens(tmp_path):
    """torch's JIT extensions (DeepSpeed's CPU ops) through cpu_route's announcement, on a one-line C++ op: the first
    load compiles and says so; a fresh process finds it built and says nothing; a process whose flags differ (what
    another environment's torch or DeepSpeed gives) recompiles, and says so: a check of the .so alone missed that."""
    source = tmp_path / "tiny_op.cpp"
    source.write_text("int tiny_op() { return 1; }\n")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))

    def load(*flags):
        out = subprocess.run([sys.executable, "-c", BUILD, str(REPO / "cpu_route" / "sitecustomize.py"), str(source),
                              *flags], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0 and out.stdout.strip() == "loaded", out.stderr[-3000:]
        return [line for line in out.stderr.splitlines() if line.startswith("cpu_route:")]

    first = load("-DENVIRONMENT=1")
    assert len(first) == 2 and first[0].startswith("cpu_route: compiling DeepSpeed's CPU op tiny_op into "), first
    assert re.fullmatch(r"cpu_route: compiled tiny_op in \d+ s", first[1]), first
    assert load("-DENVIRONMENT=1") == []
    assert [line.split(" into ")[0] for line in load("-DENVIRONMENT=2")][:1] == [
        "cpu_route: compiling DeepSpeed's CPU op tiny_op"]


def named_thread(name, work):
    """A thread whose kernel-level name (what /proc shows, like gloo's pt_gloo_runloop) is `name`, running work()."""
    import ctypes
    import threading

    def run():
        ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME
        work()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_end_training_waits_while_a_gloo_thread_works_and_not_once_they_sleep():
    """cpu_route's end_training() waits until gloo's worker threads are idle: it sees a thread asleep on its queue
    as idle, and one that still runs (here a loop that keeps taking the GIL) as not."""
    import threading

    route = load_route()
    assert route.wait_for_idle_gloo_threads()  # no gloo thread at all
    stop, ready = threading.Event(), threading.Event()

    def sleep_on_queue():
        ready.set()
        stop.wait()

    def keep_working():
        ready.set()
        while not stop.is_set():
            sum(range(1000))

    for work, idle in ((sleep_on_queue, True), (keep_working, False)):
        stop.clear()
        ready.clear()
        thread = named_thread("pt_gloo_runloop", work)
        ready.wait()
        try:
            assert route.wait_for_idle_gloo_threads(deadline=0.5) is idle, work.__name__
        finally:
            stop.set()
            thread.join()
