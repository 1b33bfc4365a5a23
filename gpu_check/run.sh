#!/usr/bin/env bash
# The GPU check in one command (README, "On a GPU"), and its preparation where pip works:
#   bash gpu_check/run.sh prepare               # login node (internet): the wheels .gpu/w (gpu_check/gpu_wheels.py)
#   bash gpu_check/run.sh --budget-s 540        # GPU node (no internet), the tree copied: install, pack, table
#   bash gpu_check/run.sh --dry-run             # anywhere: the plan, the budget split and the order
#   bash gpu_check/run.sh pack|table [...]      # one phase alone, with the whole budget
# The Python that runs it is $PYTHON, else python3 (on the GPU node, the one that holds its CUDA torch, which is
# never reinstalled). Each mode hands over to its Python program (exec): nothing is left running here.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
case "${1:-}" in
  prepare)
    shift
    exec "$python" gpu_check/gpu_wheels.py prepare "$@" ;;
  pack|table)
    only="$1"
    shift
    exec "$python" gpu_check/gpu_call.py --only "$only" "$@" ;;
  *)
    exec "$python" gpu_check/gpu_call.py "$@" ;;
esac
