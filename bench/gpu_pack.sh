#!/usr/bin/env bash
# The whole GPU story on a machine with CUDA (README, "On a GPU"):
#   bash bench/gpu_pack.sh pack     # the GPU pack: python -m pytest -m gpu (under 10 minutes on one H100)
#   bash bench/gpu_pack.sh table    # the GPU table: bench/benchmark.py --gpu-table into bench/results/<date>-<gpu>/
#   bash bench/gpu_pack.sh          # both, one after the other (two calls where a call may last 10 minutes)
# Such a machine may reach no package registry: what its Python lacks (DeepSpeed, datasets) is installed from
# the wheels in .gpu/w, prepared beforehand on a machine that does (README). torch is never reinstalled: the
# machine's own CUDA build stays. With $OUT set (a folder that is fetched back), the pack's log and the
# table's README.md and results land there too.
set -euo pipefail
cd "$(dirname "$0")/.."

what="${1:-all}"
case "$what" in
  pack|table|all) ;;
  *) echo "usage: bash bench/gpu_pack.sh [pack|table|all]" >&2; exit 2 ;;
esac
wheels=.gpu/w
packages=(deepspeed python-hostlist datasets dill multiprocess hjson pydantic pydantic-core annotated-types
          typing-inspection)

if ! python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "error: no CUDA device here: the GPU pack and table need one (on a CPU run the suite: README, 'Tests')" >&2
  exit 2
fi
if ! python -c "import deepspeed, datasets" 2>/dev/null; then
  if [[ ! -d "$wheels" ]]; then
    echo "error: DeepSpeed or datasets is missing and there is no $wheels: prepare it first (README, 'On a GPU')" >&2
    exit 2
  fi
  # --no-build-isolation: DeepSpeed's setup.py builds against the installed torch, which stays as it is.
  python -m pip install --no-deps --no-index --no-build-isolation --find-links "$wheels" "${packages[@]}"
fi

out="${OUT:-}"
status=0
if [[ "$what" != table ]]; then
  python -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "${out:-bench/results}/gpu-pack.log" || status=1
fi
if [[ "$what" != pack ]]; then
  started="$(mktemp)"
  trap 'rm -f "$started"' EXIT
  python bench/benchmark.py --gpu-table || status=1
  if [[ -n "$out" ]]; then
    # The new table (bench/results/<date>-<gpu>/README.md) and each part's report and logs; not the run
    # folders (the exported models) nor the generated images.
    while IFS= read -r readme; do
      table="$(dirname "$readme")"
      dest="$out/$(basename "$table")"
      mkdir -p "$dest"
      cp "$readme" "$dest/"
      for part in "$table"/*/; do
        if [[ -f "$part/results.json" ]]; then
          mkdir -p "$dest/$(basename "$part")"
          cp -r "$part"/results.* "$part/logs" "$dest/$(basename "$part")/"
        fi
      done
    done < <(find bench/results -mindepth 2 -maxdepth 2 -name README.md -newer "$started")
  fi
fi
exit "$status"
