"""A DeepSpeed config's JSON in another precision: with a DeepSpeed JSON only the JSON sets the dtype (accelerate
launch's --mixed_precision beside it changes nothing), so a run in another precision takes a copy of the JSON.

    python launch/precision.py accelerate_configs/deepspeed_zero2.yaml no OUT_DIR    # prints the copy's path
    accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml --deepspeed_config_file COPY ...

Each shipped JSON already has an fp32 twin (NAME_fp32.json); this writes any precision, and a copy with a few keys
changed (overrides), for bench/benchmark.py's variants and the tests. Standard library and PyYAML only.
"""

import argparse
import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def deepspeed_json_in(config, precision, out_dir, overrides=None):
    """The path of a copy of `config`'s DeepSpeed JSON (a file of accelerate_configs/, or CONFIG+VARIANT read as its
    base) in `precision` ("no", "bf16", "fp16"), written into out_dir, or None for a config without a JSON. Nothing
    else in the copy changes but `overrides` ({section: {key: value}})."""
    cfg = yaml.safe_load(open(REPO / "accelerate_configs" / config.split("+")[0]))
    ds_file = (cfg.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if not ds_file:
        return None
    ds = json.loads((REPO / ds_file).read_text())
    for dtype in ("bf16", "fp16"):
        ds[dtype] = {"enabled": precision == dtype}
    for section, values in (overrides or {}).items():
        ds[section].update(values)
    suffix = "".join(f".{k}-{v}" for values in (overrides or {}).values() for k, v in values.items())
    copy = Path(out_dir) / f"{Path(ds_file).stem}.{precision}{suffix}.json"
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(json.dumps(ds, indent=1))
    return copy


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("config", help="a DeepSpeed config of accelerate_configs/ (its name)")
    p.add_argument("precision", choices=("no", "bf16", "fp16"), help="the copy's precision (no: fp32)")
    p.add_argument("out_dir", help="where the copy is written")
    args = p.parse_args()
    copy = deepspeed_json_in(Path(args.config).name, args.precision, args.out_dir)
    print(copy if copy else f"{args.config} has no DeepSpeed JSON")
