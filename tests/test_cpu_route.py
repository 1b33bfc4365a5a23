"""cpu_route/: what it tells a user before DeepSpeed's silent first-run compilation (quick, no launch)."""

import importlib.util

import torch

from launching import REPO


def load_route():
    spec = importlib.util.spec_from_file_location("cpu_route_under_test", REPO / "cpu_route" / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # outside a launched worker (no LOCAL_RANK) it patches nothing
    return module


def test_says_which_deepspeed_ops_a_first_run_compiles(monkeypatch, tmp_path):
    route = load_route()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", raising=False)
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)
    assert route.deepspeed_ops_to_build(torch) == ["deepspeed_shm_comm"]
    # The shipped configs name a DeepSpeed JSON: the offload is read from there.
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(REPO / "accelerate_configs" / "deepspeed_zero3.json"))
    assert route.deepspeed_ops_to_build(torch) == ["deepspeed_shm_comm"]
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE",
                       str(REPO / "accelerate_configs" / "deepspeed_zero3_offload.json"))
    assert route.deepspeed_ops_to_build(torch) == ["deepspeed_shm_comm", "cpu_adam"]
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    assert route.deepspeed_ops_to_build(torch) == ["deepspeed_shm_comm", "cpu_adam"]
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")  # built before
    assert route.deepspeed_ops_to_build(torch) == ["cpu_adam"]
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    assert route.deepspeed_ops_to_build(torch) == []


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
