"""Which optimizer really steps, inside accelerate's and DeepSpeed's wrappers.

Owns the optimizer's name and implementation (fused, foreach or a Python loop) for the first log line
and the summary, and the one repair DeepSpeed's optimizer offload needs: it replaces the recipe's
optimizer, so the scheduler is pointed at the one that steps.
"""


def innermost_optimizer(prepared):
    """The torch optimizer that really steps, inside accelerate's and DeepSpeed's wrappers."""
    inner = prepared
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return inner


def optimizer_name(prepared):
    """The class name of the optimizer that really steps (DeepSpeedCPUAdam under optimizer offload)."""
    return type(innermost_optimizer(prepared)).__name__


def implementation(prepared):
    """How the stepping optimizer runs its update: one fused kernel, foreach kernels, or a Python loop."""
    defaults = getattr(innermost_optimizer(prepared), "defaults", {})
    return "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "default"


def repoint_scheduler(prepared, scheduler):
    """Under optimizer offload prepare() replaces the recipe's optimizer by DeepSpeedCPUAdam, and a scheduler
    would go on setting the learning rate of one that never steps: point it at the prepared optimizer."""
    inner = getattr(scheduler, "scheduler", None)
    if inner is not None and innermost_optimizer(inner.optimizer) is not innermost_optimizer(prepared):
        inner.optimizer = prepared
