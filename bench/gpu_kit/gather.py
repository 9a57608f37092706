"""Gather the wheels the GPU machine lacks into .whl/ (git-ignored), within what a call carries.

    python -m bench.gpu_kit.gather     # here, from the repo root; prints the sizes
    python -m bench.gpu_kit.gather --python 3.11 --dest DIR   # the CPU rehearsal's wheels

Reads bench/gpu_kit/wheels.txt, checks its pins against constraints.txt, downloads each wheel
for CPython 3.12 on manylinux x86_64 (``pip download --no-deps --only-binary=:all:``; the GPU
machine has no package registry), removes wheels no longer listed (two versions of one package
stop the install there), and fails when the wheels and the working tree together exceed the
64 MiB a device call takes. bench/gpu_kit/run.sh installs them there (bench/README.md).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / "bench" / "gpu_kit" / "wheels.txt"
CONSTRAINTS = ROOT / "constraints.txt"
FOLDER = ROOT / ".whl"
# A device call carries 64 MiB (tracked + untracked-not-ignored files + carried paths); the
# kit keeps to 40, so that a carried venv or results folder never pushes it over.
LIMIT = 40 * 2**20
# pip matches manylinux_2_N exactly: name every glibc level the wheels we carry are built for.
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]  # fmt: skip


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    """Canonical name -> version of each ``name==version`` line (comments and blanks skipped)."""
    found = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not version.strip():
            raise ValueError(f"{path.name}:{number}: {line!r} is not name==version")
        name = canonical(name.strip())
        if name in found:
            raise ValueError(f"{path.name}:{number}: {name} is listed twice")
        found[name] = version.strip()
    return found


def drift(wanted: dict[str, str], constraints: dict[str, str]) -> list[str]:
    """Packages whose carried version differs from the one CI is pinned to."""
    return [
        f"{name}: wheels.txt has {version}, constraints.txt {constraints[name]}; carry what CI "
        "tests (edit bench/gpu_kit/wheels.txt)"
        for name, version in wanted.items()
        if name in constraints and constraints[name] != version
    ]


def wheel_key(filename: str) -> tuple[str, str]:
    """(canonical name, version) of a wheel file name (PEP 427)."""
    name, version = filename.split("-")[:2]
    return canonical(name), version


def travelling_bytes() -> int:
    """Bytes of what a device call sends besides carried paths: tracked and untracked files
    that git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode()  # fmt: skip
    files = (ROOT / name for name in listed.split("\0") if name)
    return sum(f.stat().st_size for f in files if f.is_file())


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Gather the GPU machine's wheels.")
    p.add_argument("--python", default="3.12", help="the Python they are for (the image's 3.12)")
    p.add_argument("--dest", type=Path, default=FOLDER, help="where (default .whl/, carried)")
    a = p.parse_args(argv)
    return gather(a.python, a.dest)


def gather(python: str, folder: Path) -> int:
    """Download the listed wheels for ``python`` into ``folder``; the size check applies to
    what a device call carries (.whl/)."""
    try:
        wanted = pins(WHEELS)
        problems = drift(wanted, pins(CONSTRAINTS))
    except ValueError as e:
        problems = [str(e)]
    if problems:
        for p in problems:
            print(f"gather: {p}", file=sys.stderr)
        return 2
    folder.mkdir(parents=True, exist_ok=True)
    for old in sorted(folder.glob("*.whl")):
        name, version = wheel_key(old.name)
        if wanted.get(name) != version:
            old.unlink()
            print(f"gather: removed {old.name} (not in wheels.txt)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp",
           *(f"--platform={p}" for p in PLATFORMS), "--dest", str(folder), "--quiet",
           *(f"{name}=={version}" for name, version in wanted.items())]  # fmt: skip
    if subprocess.run(cmd).returncode != 0:
        print("gather: pip download failed (above); nothing is carried until it works",
              file=sys.stderr)  # fmt: skip
        return 1
    got = {wheel_key(p.name): p for p in folder.glob("*.whl")}
    missing = [f"{n}=={v}" for n, v in wanted.items() if (n, v) not in got]
    if missing:
        print(f"gather: no cp312 manylinux wheel for {', '.join(missing)}", file=sys.stderr)
        return 1
    for path in sorted(got.values(), key=lambda p: -p.stat().st_size):
        print(f"{mib(path.stat().st_size):>10}  {path.name}")
    wheels = sum(p.stat().st_size for p in got.values())
    tree = travelling_bytes()
    total = wheels + tree
    print(f"gather: {len(got)} wheels, {mib(wheels)} in {folder.name}/; with the working tree "
          f"({mib(tree)}) a device call takes {mib(total)} of {mib(LIMIT)}")  # fmt: skip
    if folder.resolve() == FOLDER.resolve() and total > LIMIT:
        print(f"gather: {mib(total - LIMIT)} over the limit: carry fewer wheels (wheels.txt) "
              "or make the working tree smaller", file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
