"""Ulysses sequence parallelism for finetune_lm.py: one sequence over several GPUs (ulysses.py)."""
