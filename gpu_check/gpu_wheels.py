"""The wheels a GPU node without internet needs, built in .gpu/w where pip works, and their offline install there.

    bash gpu_check/run.sh prepare                  # on the login node (internet): builds .gpu/w (README, "On a GPU")
    bash gpu_check/run.sh prepare --dry-run        # what it would build, and whether this Python can build it
    python3 gpu_check/gpu_wheels.py install        # on the GPU node (gpu_check/gpu_call.py runs it first): no index

Owns CARRY (what the GPU pack and table import that the GPU node's environment lacks), that environment's package
list (gpu_check/gpu_image.txt), the preparation and the install:
  * prepare: each pinned distribution of CARRY downloaded as a wheel for CPython 3.12 on x86-64 Linux, DeepSpeed
    built here from its source package with no op prebuilt (its setup.py then needs no CUDA toolkit; the ops
    compile on first use, and the pack and the table use none), then the carried wheels' requirements followed:
    each is carried (fetched at the version the requirement allows) or in the GPU node's list (and met by its
    version where the list gives one), or preparation stops naming it; pip checks that each wheel installs on the
    node's Python (its tags); `import deepspeed` is tried with no compiler on PATH, through this very interpreter
    (a virtual environment's included). .gpu/w is replaced only when every check passed; it lies inside the tree,
    so copying the tree to the GPU node takes it along;
  * install: one wheel per distribution of CARRY, else one line naming the missing one and exit 2; pip installs
    them with no index and no dependency resolution; then every module of IMPORTS is imported in a fresh
    interpreter, and one that fails is named in one line with the module it lacked (exit 2). Requirements the
    installed versions do not meet are printed as warnings: the imports decide.
Nothing here imports more than the standard library and `packaging` (both machines have it), so that the install
runs before anything else is known to be there.
"""

import argparse
import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".gpu" / "w"
IMAGE = REPO / "gpu_check" / "gpu_image.txt"
# Distribution: the version carried ("": the one the requirement of another carried wheel picks). Pinned: the
# versions the CPU suite runs with (requirements.txt), and bitsandbytes' release with CUDA 13 libraries.
CARRY = {
    "deepspeed": "0.19.8",  # built here (BUILT_HERE); its import needs hjson and pydantic, which the image lacks
    "hjson": "",
    "pydantic": "2.13.4",
    "pydantic-core": "",
    "annotated-types": "",
    "typing-inspection": "",
    "datasets": "5.2.0",  # gpt.py and finetune_lm.py's data; pyarrow, xxhash, pandas come with the image
    "dill": "",
    "multiprocess": "",
    "bitsandbytes": "0.50.2",  # QLoRA's 4-bit weights (finetune_lm.py --load-in-4bit)
}
BUILT_HERE = {"deepspeed"}  # a source package only: built into a pure-Python wheel with DS_BUILD_OPS=0
# Checked after the install: this tree's accelrun, the carried ones, the image's that they import (named in issue 42),
# and the pack's.
IMPORTS = ["accelrun", "deepspeed", "datasets", "bitsandbytes", "hjson", "pydantic", "dill", "multiprocess", "einops",
           "msgpack", "pyarrow", "xxhash", "pandas", "accelerate", "transformers", "peft", "xdist"]
PYTHON = "3.12"  # the image's Python (3.12.3)
TARGET = {"python_version": PYTHON, "python_full_version": f"{PYTHON}.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
# pip matches a manylinux tag's glibc version exactly: every one up to the image's (Ubuntu 24.04, glibc 2.39).
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
IMPORT_MARK = "GPU-WHEELS-IMPORTS "
TO_PREPARE = "run `bash gpu_check/run.sh prepare` where pip works, then copy .gpu/w here (README, 'On a GPU')"
# What prepare needs of the Python that runs it, {module: what to install}: pip fetches, and DeepSpeed's setup.py
# imports torch and setuptools (built with --no-build-isolation, against this torch); setuptools before 70.1 builds
# no wheel without the `wheel` package ("invalid command 'bdist_wheel'").
PREPARE_NEEDS = {"pip": "pip", "setuptools": "setuptools>=70.1", "torch": "torch"}
PREPARE_PROBE = '''
import importlib.util, sys
from importlib import metadata
def lacks(module):
    if importlib.util.find_spec(module) is None:
        return True
    if module == "setuptools" and importlib.util.find_spec("wheel") is None:
        return tuple(int(x) for x in metadata.version("setuptools").split(".")[:2]) < (70, 1)
    return False
print(" ".join(m for m in sys.argv[1:] if lacks(m)))
'''


class Refused(Exception):
    """One line for the user: what is wrong and what to do (exit 2)."""


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


# ---- what a wheel says about itself ---------------------------------------------------------------------------
def wheel_metadata(path):
    """(name, version, [requirement strings]) from a wheel's METADATA."""
    with zipfile.ZipFile(path) as whl:
        meta = next(n for n in whl.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        msg = email.parser.Parser().parsestr(whl.read(meta).decode("utf-8"))
    return msg["Name"], msg["Version"], msg.get_all("Requires-Dist") or []


def wheels_in(folder):
    """{canonical name: [wheel paths]} of a folder (a name's wheel file begins with it, '-' written '_')."""
    found = {}
    for path in sorted(Path(folder).glob("*.whl")):
        found.setdefault(canonical(path.name.split("-")[0]), []).append(path)
    return found


def needed(requirements, environment=None):
    """The requirements that hold for the target (no extras): [(canonical name, specifier text)]."""
    from packaging.requirements import Requirement
    out = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(environment or TARGET):
            out.append((canonical(req.name), str(req.specifier)))
    return out


def read_image(path=IMAGE):
    """{canonical name: version or ""} of gpu_check/gpu_image.txt."""
    image = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            image[canonical(name)] = version
    return image


def closure(metadata, carry, image):
    """What the carried wheels still need. metadata: {canonical name: (version, [requirement strings])} of the
    wheels at hand. Returns (to fetch: {name: specifier}, problems: [one line each], unchecked: [lines]): a
    requirement is met by a wheel at hand (whose version must satisfy it), by the image (the same where the list
    gives its version; else unchecked until the machine's install), or is fetched when CARRY names it."""
    from packaging.specifiers import SpecifierSet
    carry = {canonical(n): v for n, v in carry.items()}
    to_fetch, problems, unchecked = {}, [], []
    for owner, (_, requirements) in sorted(metadata.items()):
        for name, spec in needed(requirements):
            if name in metadata:
                if not SpecifierSet(spec).contains(metadata[name][0], prereleases=True):
                    problems.append(f"{owner} needs {name}{spec}, and the carried wheel is {metadata[name][0]}")
            elif name in image:
                have = image[name]
                if have and not SpecifierSet(spec).contains(have, prereleases=True):
                    problems.append(f"{owner} needs {name}{spec}, and the GPU image has {have}")
                elif not have and spec:
                    unchecked.append(f"{owner} needs {name}{spec} (the image's version is checked on the machine)")
            elif name in carry:
                to_fetch[name] = f"=={carry[name]}" if carry[name] else spec
            else:
                problems.append(f"{owner} needs {name}, which the GPU image lacks and CARRY does not name")
    for name in sorted(set(carry) & set(image)):
        problems.append(f"CARRY names {name}, which the GPU image has (carry only what it lacks)")
    return to_fetch, problems, unchecked


# ---- prepare (where pip works) ---------------------------------------------------------------------------------
def pip(*args, env=None):
    """python -m pip ARGS; Refused with pip's last error line, naming what it was asked for (the last argument)."""
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})))
    if proc.returncode:
        errors = [line for line in proc.stderr.splitlines() if "WARNING" not in line and line.strip()]
        raise Refused(f"pip {args[0]} {Path(args[-1]).name} failed: {errors[-1] if errors else proc.returncode}")


def target_flags():
    """pip's flags for the image's interpreter: CPython 3.12 on x86-64 Linux (any manylinux up to glibc 2.39)."""
    return ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp", "--abi",
            f"cp{PYTHON.replace('.', '')}", *(arg for p in PLATFORMS for arg in ("--platform", p)), "--platform", "any"]


def fetch(name, spec, dest):
    """One distribution into dest: its wheel for the image, or for BUILT_HERE its source package built here."""
    if name not in BUILT_HERE:
        pip("download", "-q", "--no-deps", *target_flags(), "-d", str(dest), f"{name}{spec}")
        return
    with tempfile.TemporaryDirectory() as src:
        pip("download", "-q", "--no-deps", "--no-binary=:all:", "-d", src, f"{name}{spec}")
        [sdist] = Path(src).iterdir()
        # No op prebuilt: setup.py then compiles nothing and needs no CUDA toolkit; against the torch here
        # (--no-build-isolation), whose version only matters to prebuilt ops. setuptools >= 70.1 builds wheels.
        pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest), str(sdist), env={"DS_BUILD_OPS": "0"})


def check_import_without_compiler(wheel, python=sys.executable):
    """`import deepspeed` from the built wheel (the rest from `python`'s environment) with no compiler to be found and
    the CUDA accelerator chosen, as on the GPU node: it must import and build nothing. `python` runs by its own path:
    a virtual environment is found from the interpreter's location (its pyvenv.cfg), and a link to it from another
    folder would run the bare base interpreter without the environment's packages (torch among them). PATH holds only
    `python3`, a two-line script that runs the same interpreter by that path, for whatever the import starts."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pip("install", "-q", "--no-deps", "--no-index", "--no-compile", "--target", str(tmp / "site"), str(wheel))
        (tmp / "bin").mkdir()
        (tmp / "bin" / "python3").write_text(f'#!/bin/sh\nexec "{python}" "$@"\n')
        (tmp / "bin" / "python3").chmod(0o755)
        env = {"PATH": str(tmp / "bin"), "PYTHONPATH": str(tmp / "site"), "CC": "/nonexistent", "CXX": "/nonexistent",
               "DS_ACCELERATOR": "cuda", "TORCH_EXTENSIONS_DIR": str(tmp / "ext"), "HOME": str(tmp)}
        proc = subprocess.run([python, "-c", "import deepspeed; print(deepspeed.__file__)"],
                              capture_output=True, text=True, env=env, timeout=300)
        if proc.returncode or str(tmp / "site") not in proc.stdout:
            raise Refused(f"the built DeepSpeed wheel does not import without a compiler: "
                          f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        if (tmp / "ext").exists() and any((tmp / "ext").iterdir()):
            raise Refused("importing the built DeepSpeed wheel compiled an op: it must build nothing at import")


def prepare_problems(python=sys.executable):
    """What this Python lacks to prepare (PREPARE_NEEDS), found in a fresh interpreter before anything is fetched:
    [one line each]."""
    proc = subprocess.run([python, "-c", PREPARE_PROBE, *PREPARE_NEEDS], capture_output=True, text=True, timeout=120)
    missing = proc.stdout.split() if proc.returncode == 0 else list(PREPARE_NEEDS)
    return [f"{python} has no {PREPARE_NEEDS[m]}: prepare with the Python the project is installed in (README, "
            f"'Install'), after `{python} -m pip install '{PREPARE_NEEDS[m]}'`" for m in missing]


def prepare_plan(wheels=WHEELS, carry=None):
    """The lines of `prepare --dry-run`: what would be built where, and whether this Python can; nothing fetched."""
    carry = CARRY if carry is None else carry
    pinned = [f"{n}=={v}{' (built here from its source package)' if n in BUILT_HERE else ''}"
              for n, v in carry.items() if v]
    followed = [n for n, v in carry.items() if not v]
    problems = prepare_problems()
    return ["prepare (dry run): nothing is fetched or built",
            f"into {wheels}: wheels for CPython {PYTHON} on x86-64 Linux: {', '.join(pinned)}; then, at the versions "
            f"their requirements pick: {', '.join(followed)}",
            f"checked against {IMAGE.relative_to(REPO)} (what the GPU node's Python already has)",
            *(f"not ready: {line}" for line in problems),
            *([] if problems else [f"this Python ({sys.executable}) can build them"])]


def prepare(wheels=WHEELS, carry=None, image_path=IMAGE):
    """Build `wheels` afresh (module docstring), in a sibling folder that replaces it once every check passed (and
    is removed if one fails); returns the report's lines. Raises Refused."""
    problems = prepare_problems()
    if problems:
        raise Refused(problems[0])
    carry, image = CARRY if carry is None else carry, read_image(image_path)
    new = wheels.with_name(wheels.name + ".new")
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir(parents=True)
    try:
        count, unchecked = build(new, carry, image)
        size = sum(p.stat().st_size for p in new.glob("*.whl"))
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    shutil.rmtree(wheels, ignore_errors=True)
    new.rename(wheels)
    return [*(f"  {p.name}  {p.stat().st_size / 2**20:.2f} MiB" for p in sorted(wheels.glob("*.whl"))),
            f"{wheels.relative_to(REPO) if wheels.is_relative_to(REPO) else wheels}: {count} wheels, "
            f"{size / 2**20:.1f} MiB: copy it with the tree to the GPU node",
            *(f"  unchecked here: {u}" for u in unchecked)]


def build(new, carry, image):
    """CARRY's pinned wheels into `new`, then what their requirements add, until closure() asks for nothing more;
    then pip's own check that each installs on the image's Python, and DeepSpeed's import without a compiler.
    Returns (how many wheels, the requirements left to the machine's check)."""
    for name, version in carry.items():
        if version:
            fetch(canonical(name), f"=={version}", new)
    fetched = set()
    while True:
        metadata = {canonical(n): (v, r) for n, v, r in map(wheel_metadata, sorted(new.glob("*.whl")))}
        to_fetch, problems, unchecked = closure(metadata, carry, image)
        if not to_fetch:
            break
        if set(to_fetch) & fetched:  # fetched, yet its wheel names another distribution
            raise Refused(f"pip fetched no wheel named {', '.join(sorted(set(to_fetch) & fetched))}")
        for name, spec in to_fetch.items():
            fetch(name, spec, new)
            fetched.add(name)
    missing = [n for n in map(canonical, carry) if n not in metadata]
    problems += [f"CARRY names {n}, but no carried wheel needs it and it has no version to fetch" for n in missing]
    if problems:
        raise Refused("; ".join(problems))
    with tempfile.TemporaryDirectory() as tmp:
        pip("install", "--dry-run", "-q", "--no-index", "--no-deps", *target_flags(), "--target", tmp,
            *map(str, sorted(new.glob("*.whl"))))
    check_import_without_compiler(next(new.glob("deepspeed-*.whl")))
    return len(metadata), unchecked


# ---- install (on the GPU machine) ------------------------------------------------------------------------------
def to_install(wheels, carry=None):
    """The wheel of each distribution of CARRY in `wheels`; Refused naming what is missing or doubled."""
    carry = CARRY if carry is None else carry
    if not Path(wheels).is_dir():
        raise Refused(f"there is no {wheels}: {TO_PREPARE}")
    found = wheels_in(wheels)
    missing = [n for n in map(canonical, carry) if n not in found]
    if missing:
        raise Refused(f"{wheels} has no wheel for {', '.join(missing)}: {TO_PREPARE}")
    doubled = [n for n in map(canonical, carry) if len(found[n]) > 1]
    if doubled:
        raise Refused(f"{wheels} holds two versions of {', '.join(doubled)}: keep one ({TO_PREPARE})")
    return [found[canonical(n)][0] for n in carry]


def import_check(python, modules, carry, target=None):
    """{"failed": {module: error}, "unmet": [lines]} from a fresh interpreter: each module imported, each carried
    distribution's requirements against the installed versions."""
    env = dict(os.environ)
    if target:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    proc = subprocess.run([python, str(Path(__file__).resolve()), "check-imports", "--carry", *carry, "--modules",
                           *modules], capture_output=True, text=True, env=env, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(IMPORT_MARK)), None)
    if line is None:
        raise Refused(f"the import check did not answer: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(line[len(IMPORT_MARK):])


def tree_importable(python):
    """This tree's accelrun (src/accelrun), importable by `python` as if installed editable (`pip install -e .` does the
    same: a .pth file naming src/ in its site-packages), with no build step and no index: the recipes import it, and
    whatever the working tree holds when the call starts is what runs."""
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "accelrun-tree.pth").write_text(f"{REPO / 'src'}\n")


def install(wheels=WHEELS, python=sys.executable, target=None, carry=None, imports=None):
    """Offline install of the carried wheels, then the import check (module docstring). Raises Refused."""
    carry, imports = CARRY if carry is None else carry, IMPORTS if imports is None else imports
    files = to_install(wheels, carry)
    where = ["--target", str(target), "--upgrade"] if target else []
    proc = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--only-binary=:all:",
                           "--no-compile", "--disable-pip-version-check", *where, *map(str, files)],
                          capture_output=True, text=True, env=dict(os.environ, PIP_ROOT_USER_ACTION="ignore"))
    if proc.returncode:
        errors = [x for x in proc.stderr.splitlines() if x.strip() and "WARNING" not in x]
        raise Refused(f"pip could not install {wheels} offline: {errors[-1] if errors else proc.returncode} "
                      f"({TO_PREPARE})")
    if target is None:
        tree_importable(python)
    result = import_check(python, imports, list(carry), target)
    if result["failed"]:
        module, error = next(iter(result["failed"].items()))
        lacking = re.search(r"No module named '([^'.]+)", error)
        why = (f"this machine lacks {lacking.group(1)}: add its distribution to CARRY in gpu_check/gpu_wheels.py, then "
               f"{TO_PREPARE}" if lacking else TO_PREPARE)
        more = ", ".join(m for m in result["failed"] if m != module)
        raise Refused(f"import {module} fails after the install ({error}){f', and so do {more}' if more else ''}: "
                      f"{why}")
    return result["unmet"]


def check_imports(modules, carry):
    """Run in the interpreter checked (install's fresh one): print IMPORT_MARK and the JSON of the results."""
    from importlib import import_module, metadata
    failed, unmet = {}, []
    for module in modules:
        try:
            import_module(module)
        except BaseException as exc:  # an import may raise anything, SystemExit included: it is reported
            failed[module] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    environment = None
    try:
        from packaging.markers import default_environment
        from packaging.specifiers import SpecifierSet
        environment = {**default_environment(), "extra": ""}
        for dist in carry:
            for name, spec in needed(metadata.requires(dist) or [], environment):
                try:
                    have = metadata.version(name)
                except metadata.PackageNotFoundError:
                    have = None
                if have is None or not SpecifierSet(spec).contains(have, prereleases=True):
                    unmet.append(f"{dist} needs {name}{spec}, and this machine has {have or 'none'}")
    except Exception as exc:  # the requirement check only warns; it must not hide the imports' answer
        unmet.append(f"requirements not checked: {type(exc).__name__}: {exc}")
    print(IMPORT_MARK + json.dumps({"failed": failed, "unmet": unmet}), flush=True)


def one_line_errors(*parsers):
    """A wrong flag as one line, `PROG: error: ... (PROG --help lists the flags)`, and exit 2: no usage block."""
    for parser in parsers:
        def error(message, prog=parser.prog):
            print(f"{prog}: error: {message} ({prog} --help lists the flags)", file=sys.stderr)
            sys.exit(2)
        parser.error = error
    return parsers[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    prep = sub.add_parser("prepare", help="build .gpu/w here (pip reaches PyPI)")
    prep.add_argument("--wheels", type=Path, default=WHEELS, help="the folder to build (default: .gpu/w)")
    prep.add_argument("--dry-run", action="store_true",
                      help="say what would be built and whether this Python can build it; fetch nothing")
    inst = sub.add_parser("install", help="install .gpu/w offline on the GPU node and check every import")
    inst.add_argument("--wheels", type=Path, default=WHEELS, help="the prepared wheels (default: .gpu/w)")
    inst.add_argument("--target", type=Path, default=None, help="install into this folder (default: this Python)")
    check = sub.add_parser("check-imports", help=argparse.SUPPRESS)
    check.add_argument("--carry", nargs="*", default=[], help="the distributions whose requirements are checked")
    check.add_argument("--modules", nargs="*", default=[], help="the modules imported")
    one_line_errors(p, prep, inst, check)
    args = p.parse_args(argv)
    if args.what == "check-imports":
        return check_imports(args.modules, args.carry) or 0
    try:
        if args.what == "prepare":
            print("\n".join((prepare_plan if args.dry_run else prepare)(args.wheels.resolve())))
        else:
            for line in install(args.wheels, target=args.target):
                print(f"warning: {line}", file=sys.stderr)
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
