#!/usr/bin/env bash
# The whole GPU story on a machine with CUDA (README, "On a GPU"), each command sized for one 10-minute call:
#   bash bench/gpu_pack.sh pack     # the GPU pack: python -m pytest -m gpu on $PACK_WORKERS pytest workers that
#                                   # share the GPU (pytest-xdist); target: under 5 minutes on one H100, install included
#   bash bench/gpu_pack.sh table    # the GPU table (bench/gpu_table.py) into bench/results/<date>-<gpu>/; target:
#                                   # under 8 minutes; it stops itself at $TABLE_BUDGET_S (540) s, install included
#   bash bench/gpu_pack.sh          # both, one after the other (two calls where a call may last 10 minutes)
# Such a machine may reach no package registry: what its Python lacks (DeepSpeed, datasets, pytest-xdist) is
# installed from the wheels in .gpu/w, prepared beforehand on a machine that does (README). torch is never
# reinstalled: the machine's own CUDA build stays. Nothing here needs the network, so the Hugging Face libraries
# are told so (no lookup waits for a timeout). Prints the machine, then each part's time: the install, the pack
# (and each test's, --durations), the table (and each of its parts). With $OUT set (a folder that is fetched
# back), the pack's log and the table's README.md, reports and logs land there too.
set -euo pipefail
cd "$(dirname "$0")/.."

what="${1:-all}"
case "$what" in
  pack|table|all) ;;
  *) echo "usage: bash bench/gpu_pack.sh [pack|table|all]" >&2; exit 2 ;;
esac
wheels=.gpu/w
packages=(deepspeed python-hostlist datasets dill multiprocess hjson pydantic pydantic-core annotated-types
          typing-inspection pytest-xdist execnet)
started=$SECONDS
say() { printf 'gpu_pack: %s\n' "$*"; }

if ! python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "error: no CUDA device here: the GPU pack and table need one (on a CPU run the suite: README, 'Tests')" >&2
  exit 2
fi
python -c "import os, sys, torch; print(f'gpu_pack: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, '
           f'{os.cpu_count()} cores; torch {torch.__version__}, CUDA {torch.version.cuda}, '
           f'python {sys.version.split()[0]}')"
if ! python -c "import deepspeed, datasets, xdist" 2>/dev/null; then
  if [[ ! -d "$wheels" ]]; then
    echo "error: DeepSpeed, datasets or pytest-xdist is missing and there is no $wheels: prepare it first" \
         "(README, 'On a GPU')" >&2
    exit 2
  fi
  # --no-build-isolation: DeepSpeed's setup.py builds against the installed torch, which stays as it is.
  if ! python -m pip install --no-deps --no-index --no-build-isolation --find-links "$wheels" "${packages[@]}"; then
    echo "error: $wheels lacks one of ${packages[*]}: prepare it again with the README's commands ('On a GPU')" >&2
    exit 2
  fi
fi
say "install: $((SECONDS - started)) s"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1

out="${OUT:-}"
status=0
if [[ "$what" != table ]]; then
  # Workers share the one GPU: the pack's launches are small, so the GPU has room for 8 of them; each test is
  # mostly process start-up and compilation, which the cores share. worksteal: an idle worker takes a waiting test.
  cores="$(nproc)"
  workers="${PACK_WORKERS:-$(( cores / 2 < 2 ? 2 : (cores / 2 > 8 ? 8 : cores / 2) ))}"
  pack_started=$SECONDS
  python -m pytest -m gpu -q -p no:cacheprovider -n "$workers" --dist worksteal --durations=0 2>&1 \
    | tee "${out:-bench/results}/gpu-pack.log" || status=1
  say "pack: $((SECONDS - pack_started)) s on $workers workers ($((SECONDS - started)) s since the start)"
fi
if [[ "$what" != pack ]]; then
  table_started=$SECONDS
  newer="$(mktemp)"
  trap 'rm -f "$newer"' EXIT
  # The budget counts the install too: the table stops itself in time to leave its results in one call.
  python bench/benchmark.py --gpu-table --budget-s "$(( ${TABLE_BUDGET_S:-540} - (table_started - started) ))" \
    || status=1
  say "table: $((SECONDS - table_started)) s ($((SECONDS - started)) s since the start)"
  if [[ -n "$out" ]]; then
    # The new table (bench/results/<date>-<gpu>/README.md), each part's report and logs, and the warm-up's logs;
    # not the run folders (the exported models) nor the inputs (images, the 1B model).
    while IFS= read -r readme; do
      table="$(dirname "$readme")"
      dest="$out/$(basename "$table")"
      mkdir -p "$dest"
      cp "$readme" "$dest/"
      if [[ -d "$table/warm/logs" ]]; then
        mkdir -p "$dest/warm"
        cp -r "$table/warm/logs" "$dest/warm/"
      fi
      for part in "$table"/*/; do
        if [[ -f "$part/results.json" ]]; then
          mkdir -p "$dest/$(basename "$part")"
          cp -r "$part"/results.* "$part/logs" "$dest/$(basename "$part")/"
        fi
      done
    done < <(find bench/results -mindepth 2 -maxdepth 2 -name README.md -newer "$newer")
  fi
fi
exit "$status"
