"""The GPU pack's record: a pytest plugin (`-p pack_report`, gpu_check/ on PYTHONPATH) that appends each test's outcome
to the JSON-lines file $GPU_PACK_RECORD the moment the test ends, and first the tests collected, so that a pack
stopped at its time cap still says what passed, what failed and what was not reached (gpu_check/gpu_call.py reads it).
Under pytest-xdist only the controller writes: the workers' reports reach it one by one.
"""

import json
import os

import pytest

_state = {}


def _write(record):
    path = os.environ.get("GPU_PACK_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _controller(config):
    return not hasattr(config, "workerinput")  # a worker's reports reach the controller, which records them


def pytest_configure(config):
    _state["config"] = config


def pytest_collection_finish(session):
    if _controller(session.config) and not session.config.pluginmanager.hasplugin("dsession"):
        _write({"collected": [item.nodeid for item in session.items]})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    if not _state.get("collected"):  # every worker collects the same tests: the first list is the pack's
        _state["collected"] = True
        _write({"collected": list(ids)})


def pytest_runtest_logreport(report):
    if not _controller(_state["config"]):
        return
    # The call's outcome; a setup or teardown only when it did not pass (a fixture error, a skip in setup).
    if report.when == "call" or report.outcome != "passed":
        gateway = getattr(getattr(report, "node", None), "gateway", None)
        _write({"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                "seconds": round(report.duration, 1), "worker": getattr(gateway, "id", None)})
