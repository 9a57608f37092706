"""Which of this machine's pip settings scripts/images.sh forwards into its image builds.

    python3 scripts/pip_forward.py OUT_DIR   # -> OUT_DIR/pip.conf, OUT_DIR/mounts, OUT_DIR/files

Only where packages come from (:data:`FORWARDED`: indexes, find-links, trusted hosts, proxy,
CA and client certificates, timeouts), so that the images install what the tests here install.
A setting that names something on this machine goes only with it: a local find-links folder
or ``file://`` index is mounted read-only into the build steps (``mounts``), a certificate is
copied into the stand-in base at the same path (``files``); one whose path is missing is left
out. Every other setting (a constraint or requirement file, ``user``, a target, ...) is this
machine's own policy: it is left out and said on stderr, since a build step that reads a file
the container lacks fails (``Could not open requirements file``).
"""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

FORWARDED = (
    "index-url", "extra-index-url", "find-links", "no-index", "trusted-host", "proxy",
    "cert", "client-cert", "timeout", "default-timeout", "retries",
)  # fmt: skip
FILES = ("cert", "client-cert")  # forwarded with the file, or not at all
FOLDERS = ("find-links", "index-url", "extra-index-url")  # local items: mounted, or dropped
# pip's own order: config files (global, then the install command's section), then PIP_*.
SCOPES = ("global.", "install.", ":env:.")


def listed() -> list[str]:
    """``pip config list``: one ``scope.key='value'`` per line, files' and PIP_* alike."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    )
    return out.stdout.splitlines()


def settings(lines: list[str]) -> dict[str, str]:
    """The settings in effect for ``pip install``, later scopes winning."""
    found: dict[str, str] = {}
    for scope in SCOPES:
        for line in lines:
            key, _, value = line.partition("=")
            if key.startswith(scope):
                found[key[len(scope) :].replace("_", "-")] = value.strip().strip("'\"")
    return found


def local(item: str, key: str) -> str | None:
    """The folder on this machine that a find-links or index item needs, or None (a URL)."""
    path = item.removeprefix("file://")
    if not path.startswith("/"):
        return None
    path = path.rstrip("/")
    # An index's pages (or a find-links page) link to files beside them: its folder.
    return path if key == "find-links" and os.path.isdir(path) else os.path.dirname(path)


def forward(found: dict[str, str]) -> tuple[dict[str, str], list[str], list[str], list[str]]:
    """(the pip.conf's settings, folders to mount, files to copy, what was left out and why)."""
    conf: dict[str, str] = {}
    mounts: list[str] = []
    files: list[str] = []
    left: list[str] = []
    for key, value in found.items():
        if key not in FORWARDED:
            left.append(f"{key} (not an index setting)")
        elif key in FILES:
            if os.path.isfile(value):
                conf[key] = value
                files.append(value)
            else:
                left.append(f"{key} ({value} is not a file here)")
        elif key in FOLDERS:
            kept = []
            for item in value.split():
                folder = local(item, key)
                if folder is None or os.path.isdir(folder):
                    kept.append(item)
                    if folder:
                        mounts.append(folder)
                else:
                    left.append(f"{key} {item} (no such folder here)")
            if kept:
                conf[key] = "\n".join(kept) if len(kept) > 1 else kept[0]
        else:
            conf[key] = value
    return conf, sorted(set(mounts)), files, left


def main(out: Path) -> None:
    conf, mounts, files, left = forward(settings(listed()))
    parser = configparser.ConfigParser()
    parser["global"] = conf
    with open(out / "pip.conf", "w") as f:
        parser.write(f)
    (out / "mounts").write_text("".join(m + "\n" for m in mounts))
    (out / "files").write_text("".join(p + "\n" for p in files))
    for what in left:
        print(
            f"images: this machine's pip setting {what} is left out of the builds", file=sys.stderr
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
