"""An image's layers a containerd does not hold yet, as the OCI archive `ctr images import` takes.

scripts/nodes.sh gives a real node the images of an earlier run (its cache) and then imports
the current ones. A change to ftjob/ rebuilds the trainer image's top layers only (the
Dockerfile copies ftjob/ last), yet `podman save | ctr import` streams all ~6 GB of it again
(150-190 s). Here the image is kept as an OCI layout folder (`podman save --format oci-dir
--uncompressed`, which writes a blob only where the folder has none), and the archive handed
to containerd leaves out each layer whose snapshot the node already has: containerd unpacks a
layer only when no snapshot of its chain ID exists, and reads no blob it does not unpack.
After an import every layer blob is made hollow (a sparse file of the same size, no data), so
the folder costs kilobytes and podman still sees the blob as there and skips it next time.

    oci_delta.py needs DIR SNAPSHOTS   the hollow blobs this import must have (to delete and
                                       save again); SNAPSHOTS is `ctr snapshots ls` output
    oci_delta.py tar DIR SNAPSHOTS     the archive on stdout, the node's layers left out
    oci_delta.py hollow DIR            every layer blob hollow
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tarfile
from pathlib import Path


def chain_ids(diff_ids: list[str]) -> list[str]:
    """The snapshot key of each layer (the OCI image spec's ChainID): the first layer's
    diff ID, then the digest of the previous chain ID, a space and the layer's diff ID."""
    chains: list[str] = []
    for diff in diff_ids:
        if chains:
            diff = "sha256:" + hashlib.sha256(f"{chains[-1]} {diff}".encode()).hexdigest()
        chains.append(diff)
    return chains


def committed(snapshots_ls: str) -> set[str]:
    """The keys of `ctr snapshots ls`'s committed snapshots (KEY PARENT KIND)."""
    rows = (line.split() for line in snapshots_ls.splitlines()[1:])
    return {row[0] for row in rows if row and row[-1] == "Committed"}


def blob(folder: Path, digest: str) -> Path:
    algorithm, hex_ = digest.split(":", 1)
    return folder / "blobs" / algorithm / hex_


def images(folder: Path) -> list[tuple[list[Path], list[tuple[str, str]]]]:
    """Each image of the folder's index: its manifest and config blobs, and the (blob
    digest, chain ID) of each of its layers, base first."""
    out = []
    for entry in json.loads((folder / "index.json").read_text())["manifests"]:
        manifest = json.loads(blob(folder, entry["digest"]).read_text())
        config = manifest["config"]["digest"]
        chains = chain_ids(json.loads(blob(folder, config).read_text())["rootfs"]["diff_ids"])
        layers = [(d["digest"], c) for d, c in zip(manifest["layers"], chains, strict=True)]
        out.append(([blob(folder, entry["digest"]), blob(folder, config)], layers))
    return out


def layers(folder: Path) -> list[tuple[str, str]]:
    return [layer for _, each in images(folder) for layer in each]


def hollow(path: Path) -> bool:
    """A blob whose bytes were dropped (sparse, no block allocated): its size, no data."""
    st = path.stat()
    return st.st_size > 0 and st.st_blocks == 0


def needed(folder: Path, present: set[str]) -> list[Path]:
    """The layer blobs this import sends: those whose snapshot the node lacks."""
    return [blob(folder, d) for d, chain in layers(folder) if chain not in present]


def write_archive(folder: Path, present: set[str], out) -> None:
    """The index's images as an OCI layout tar stream: the index, each manifest and config,
    and the blobs of the layers whose chain ID is not in ``present``."""
    with tarfile.open(fileobj=out, mode="w|") as tar:
        for name in ("oci-layout", "index.json"):
            tar.add(folder / name, arcname=name)
        for documents, _ in images(folder):
            for path in documents:
                tar.add(path, arcname=str(path.relative_to(folder)))
        for path in needed(folder, present):
            if hollow(path):  # its bytes are gone: `needs` names it, podman writes it again
                raise SystemExit(f"oci_delta.py: {path} is hollow; save the image again")
            tar.add(path, arcname=str(path.relative_to(folder)))


def make_hollow(folder: Path) -> None:
    """Every blob but the index's manifests and configs made hollow: the layers, and what
    earlier saves left (podman keeps one image per folder here: nodes.sh empties the index)."""
    keep = {path for documents, _ in images(folder) for path in documents}
    for path in (folder / "blobs").rglob("*"):
        if path.is_file() and path not in keep and not hollow(path):
            size = path.stat().st_size
            # A new file, not a truncation in place: the blob may be a hard link podman shares.
            path.unlink()
            with open(path, "wb") as f:
                f.truncate(size)


def main(argv: list[str]) -> int:
    command, folder = argv[0], Path(argv[1])
    if command == "hollow":
        make_hollow(folder)
        return 0
    present = committed(Path(argv[2]).read_text())
    if command == "needs":
        print("\n".join(str(p) for p in needed(folder, present) if hollow(p)))
    elif command == "tar":
        write_archive(folder, present, sys.stdout.buffer)
    else:
        print(f"oci_delta.py: unknown command {command!r} (needs, tar, hollow)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main(sys.argv[1:]))
