#!/usr/bin/env bash
# The whole GPU proof in one device call (README, "On a GPU"), and its preparation where pip works:
#   bash bench/gpu_pack.sh prepare               # here: the wheels .gpu/w for the GPU image (bench/gpu_wheels.py)
#   bash bench/gpu_pack.sh --budget-s 540        # there, .gpu/w carried: install, pack, table (bench/gpu_call.py)
#   bash bench/gpu_pack.sh --dry-run             # anywhere: the plan, the budget split and the order
#   bash bench/gpu_pack.sh pack|table [...]      # one phase alone, with the whole budget
# The Python that runs it is $PYTHON, else python3 (on the GPU machine, the one that holds its CUDA torch, which is
# never reinstalled). Each mode hands over to its Python program (exec): nothing is left running here.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
case "${1:-}" in
  prepare)
    shift
    exec "$python" bench/gpu_wheels.py prepare "$@" ;;
  pack|table)
    only="$1"
    shift
    exec "$python" bench/gpu_call.py --only "$only" "$@" ;;
  *)
    exec "$python" bench/gpu_call.py "$@" ;;
esac
