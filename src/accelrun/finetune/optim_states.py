"""--optim-states {fp32,bf16,8bit}: the precision AdamW keeps its two moments in, for a full fine-tune that would not
fit with fp32 states.

Owns the flag (add_optim_states_args: the standard library only, --help answers before torch loads), the optimizer of
each choice (optimizer_for), the refusal of an engine that keeps its own optimizer (the engine says so:
Engine.optimizer_states_problem) and of an optimizer an engine cannot step (Engine.optimizer_problem), the check after
the first step that every moment really has the dtype asked for (never a silent fp32: StatesCheck), and the bytes of
optimizer state per trained parameter for summary.json.

    fp32  torch's fused AdamW, as before: 8 bytes of state per parameter (two fp32 moments).
    bf16  both moments in bf16 (torchao's AdamW arithmetic: each update computed in fp32, the moments rounded to bf16;
          weights that are themselves bf16 are updated with stochastic rounding): 4 bytes per parameter.
    8bit  torchao's AdamW8bit: each moment as uint8 codes with one fp32 scale per block of 256 values (its dynamic
          quantisation map): 2 bytes and 1/32 of a byte per parameter. torchao quantises only a tensor (its local
          shard, under FSDP2) of at least 4,096 values that its blocks divide; the rest keep bf16 moments here, never
          fp32 (torchao would keep them in the weights' dtype: fp32 masters). Whether a shard is quantised depends on
          its size, so on the number of processes (torchao issue 4912): on a resume onto another world size
          torch.distributed.checkpoint reshards the saved states into the kind each new shard takes (copy_ quantises
          or dequantises), and the check after the first step holds the result to the rule above.

torchao (0.18) handles FSDP2's DTensor parameters; bitsandbytes' 8-bit optimizers fail at their first step under FSDP2
(its issues 89 and 1633), which the engine refuses. torchao's state tensor (OptimState8bit) loads under weights-only
loading: torchao registers the class with torch.serialization.add_safe_globals when torchao.optim is imported, and its
rebuild sets only tensors and plain fields (checkpoint/safe_loading.py is unchanged).
"""

OPTIM_STATE_CHOICES = ("fp32", "bf16", "8bit")
# bytes of optimizer state per parameter each choice aims at (the planner's, bench/lm_memory.py): two moments
STATE_BYTES = {"fp32": 8.0, "bf16": 4.0, "8bit": 2.0 + 2 * 4 / 256}
QUANT_BLOCK = 256  # values per 8-bit block: one fp32 scale each (torchao's default)
SMALLEST_QUANTISED = 4096  # torchao quantises a tensor of at least this many values (bitsandbytes' rule)


def add_optim_states_args(parser):
    parser.add_argument("--optim-states", choices=OPTIM_STATE_CHOICES, default="fp32",
                        help="the precision of AdamW's two moments: fp32 (8 bytes per parameter), bf16 (4: torchao's "
                             "AdamW arithmetic, stochastic rounding of bf16 weights) or 8bit (about 2: torchao's "
                             "AdamW8bit; tensors under 4,096 values keep bf16 moments). Full fine-tunes under one "
                             "process, DDP or FSDP2; DeepSpeed keeps its own optimizer")


def flag_problem(args):
    """Decided from the flags alone: low-precision states with LoRA train a few adapters, where the states are small."""
    if args.optim_states != "fp32" and args.lora_r:
        return (f"--optim-states {args.optim_states} is for full fine-tunes; with --lora-r the adapters' fp32 states "
                f"are already small: leave it out")
    return None


def quantised(numel):
    """Whether torchao's AdamW8bit keeps a (local) tensor of numel values in 8 bits."""
    return numel >= SMALLEST_QUANTISED and numel % QUANT_BLOCK == 0


def _optimizers():
    """The two torchao optimizers, their small tensors' moments in bf16 (imported here: torchao only when asked)."""
    import torch
    from torchao.optim import AdamW8bit, _AdamW

    def placed(p, local):
        """The state for parameter p from its local tensor: a DTensor laid out as p where p is one (torchao's)."""
        if sharded(p):  # a shard may differ in shape across ranks: give the whole shape and stride
            local = type(p).from_local(local, device_mesh=p.device_mesh, placements=p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride())
        return local.to(p.device)  # CPU offload: from_local would move it to the mesh's device

    class ChecksFirstStep:
        """Calls first_step_check (once, if set) after its first step: StatesCheck's, every rank at the same step
        (accelerate's optimizer steps only at the end of an accumulation)."""

        first_step_check = None

        def step(self, closure=None):
            loss = super().step(closure)
            check, self.first_step_check = self.first_step_check, None
            if check is not None:
                check()
            return loss

    class KeepsStoredDtypes:
        """torch's Optimizer.load_state_dict casts every loaded floating-point state to its weights' dtype (fp32
        masters: bf16 moments came back fp32, which the check after the first step caught): each moment is put back
        in the dtype it was saved in (bf16 -> fp32 -> bf16 is exact; an 8-bit state changes only its nominal dtype)."""

        def load_state_dict(self, state_dict):
            saved = {pid: {k: v.dtype for k, v in state.items() if k != "step" and torch.is_tensor(v)}
                     for pid, state in state_dict["state"].items()}
            ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
            super().load_state_dict(state_dict)
            params = [p for group in self.param_groups for p in group["params"]]
            for pid, p in zip(ids, params):
                for key, dtype in saved.get(pid, {}).items():
                    if self.state[p][key].dtype != dtype:
                        self.state[p][key] = self.state[p][key].to(dtype)

    class AdamWBf16(ChecksFirstStep, KeepsStoredDtypes, _AdamW):
        """AdamW with both moments in bf16, whatever the weights' dtype."""

        def _new_buffer(self, p, signed):
            return placed(p, torch.zeros_like(local_part(p), dtype=torch.bfloat16))

    class AdamW8bitBf16Rest(ChecksFirstStep, KeepsStoredDtypes, AdamW8bit):
        """torchao's AdamW8bit, the tensors it does not quantise in bf16 rather than in the weights' dtype."""

        def _new_buffer(self, p, signed):
            local = local_part(p)
            if quantised(local.numel()):
                return placed(p, self._subclass_zeros(local, signed, self.block_size))
            return placed(p, torch.zeros_like(local, dtype=torch.bfloat16))

    return {"bf16": AdamWBf16, "8bit": AdamW8bitBf16Rest}


def sharded(t):
    """Whether t is FSDP2's DTensor (told by its to_local: the recipes' helpers import nothing of torch.distributed)."""
    return hasattr(t, "to_local")


def local_part(t):
    """This rank's part of t: a DTensor's local shard, or t itself."""
    return t.to_local() if sharded(t) else t


def optimizer_for(trainable, args, engine):
    """(the optimizer of --optim-states for the trainable parameters, None) or (None, the refusal, one line). The groups
    (weight decay on the matrices only) and hyperparameters are finetune/training.py's AdamW's."""
    from .training import adamw
    plain = adamw(trainable, args)
    if args.optim_states == "fp32":
        return plain, None
    if problem := engine.optimizer_states_problem(args.optim_states):
        return None, problem
    import torch
    kind = _optimizers()[args.optim_states]
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in plain.param_groups]
    betas = plain.defaults["betas"]
    optimizer = kind(groups, lr=torch.tensor(args.lr), betas=betas, eps=plain.defaults["eps"], weight_decay=0.0,
                     bf16_stochastic_round=True)  # applied by torchao only where the weights are bf16
    return optimizer, engine.optimizer_problem(optimizer)


def moments(optimizer):
    """(the local parameter, {state key: its local moment}) of every parameter the stepping optimizer holds state
    for (under FSDP2 this rank's shards)."""
    from ..optimizers import innermost_optimizer
    inner = innermost_optimizer(optimizer)
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state.get(p, {})
            held = {key: local_part(v) for key, v in state.items() if key != "step" and hasattr(v, "dtype")}
            if held:
                yield local_part(p), held


def moment_kind(moment):
    """'8bit' for torchao's 8-bit state, else the moment's dtype's name (float32, bfloat16)."""
    if type(moment).__name__ == "OptimState8bit":
        return "8bit"
    return str(moment.dtype).removeprefix("torch.")


def state_bytes(moment):
    """The bytes a moment holds: an 8-bit state's codes and scales (its 256-value quantisation map is a constant,
    the same for every tensor, and left out); a plain tensor's elements."""
    if moment_kind(moment) == "8bit":
        return moment.codes.numel() * moment.codes.element_size() + moment.scale.numel() * moment.scale.element_size()
    return moment.numel() * moment.element_size()


def local_problem(optimizer, asked):
    """(None or the first moment of this rank's that is not of the kind asked for, state bytes, parameter elements
    those states cover). 8bit: a tensor torchao quantises has 8-bit moments, the others bf16 ones."""
    wanted = {"fp32": "float32", "bf16": "bfloat16"}.get(asked)
    problem, held, covered = None, 0, 0
    for p, states in moments(optimizer):
        want = wanted or ("8bit" if quantised(p.numel()) else "bfloat16")
        for key, moment in states.items():
            got = moment_kind(moment)
            if got != want and problem is None:
                problem = (f"--optim-states {asked}: after the first step a moment ({key}, of a parameter of shape "
                           f"{tuple(p.shape)}) is {got}, not {want}; the optimizer that steps is not the one asked "
                           f"for (nothing was changed silently: the run stops here)")
            held += state_bytes(moment)
        covered += p.numel()
    return problem, held, covered


class StatesCheck:
    """After the first optimizer step of a run (a resumed one too), from inside the optimizer's step (bf16, 8bit):
    every moment of every rank is of the kind asked for, or the run stops with one line. At the end (summary): the
    bytes of optimizer state per trained parameter, summed over the ranks (a DDP rank's whole copy counted with the
    parameters it covers: 8 for fp32 states on any engine)."""

    def __init__(self, asked, optimizer, accelerator, fail):
        """fail: ends the run with one line on every rank (the recipe's run.fail)."""
        self.asked, self.accelerator, self.fail = asked, accelerator, fail
        if hasattr(optimizer, "first_step_check"):
            optimizer.first_step_check = lambda: self.check(optimizer)

    def check(self, optimizer):
        """Collective: stop every rank with the first rank's problem, if one has one."""
        from accelerate.utils import gather_object
        problem = local_problem(optimizer, self.asked)[0]
        problems = gather_object([problem]) if self.accelerator.num_processes > 1 else [problem]
        if first := next((p for p in problems if p), None):
            self.fail(first)

    def summary(self, optimizer):
        """Collective: summary.json's optim_states and optimizer_state_bytes_per_param (None before any step)."""
        import torch
        _, held, covered = local_problem(optimizer, self.asked)
        totals = self.accelerator.reduce(torch.tensor([held, covered], dtype=torch.float64,
                                                      device=self.accelerator.device), "sum")
        per_param = totals[0].item() / totals[1].item() if totals[1].item() else None
        return {"optim_states": self.asked,
                "optimizer_state_bytes_per_param": None if per_param is None else round(per_param, 4)}
