"""Download rate of one object from a real S3-compatible server (scripts/s3.sh's SeaweedFS on
loopback): ftjob's s3:// download (obstore, 8 ranged GETs of 16 MiB in flight) against boto3's
transfer manager and fsspec's s3fs on the same file.

boto3 and s3fs cannot be installed beside the project (botocore pins python-dateutil < 3,
kubernetes 37 needs >= 3), so this runs in a venv of its own that has the three clients and
ftjob's source on its path:

    python3 -m venv /tmp/s3bench && /tmp/s3bench/bin/pip install boto3 s3fs obstore
    PYTHONPATH=. /tmp/s3bench/bin/python -m bench.s3 --gib 2

Each client downloads the object twice, alternating with the others; the best of the two is
kept (other work shares the machine). Every download is checked against the upload's SHA-256.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from ftjob.api.source import parse

ROOT = Path(__file__).resolve().parents[1]
S3_SH = ROOT / "scripts" / "s3.sh"
PART = 16 * 2**20
PARALLEL = 8


def _env(folder: Path) -> dict[str, str]:
    lines = (folder / "env").read_text().splitlines()
    v = dict(line.split("=", 1) for line in lines if "=" in line)
    return {"AWS_ENDPOINT_URL": v["ENDPOINT"], "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": v["ADMIN_ACCESS_KEY"],
            "AWS_SECRET_ACCESS_KEY": v["ADMIN_SECRET_KEY"]}  # fmt: skip


def _ftjob(url: str, dest: Path) -> Path:
    from ftjob.trainer.fetch import s3

    local, _ = s3.download(parse(url), dest, lambda m: None)
    return local


def _boto3(url: str, dest: Path) -> Path:
    import boto3
    from boto3.s3.transfer import TransferConfig

    where = parse(url)
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    out = dest / "blob"
    config = TransferConfig(multipart_chunksize=PART, max_concurrency=PARALLEL)
    client.download_file(where.bucket, where.key, str(out), Config=config)
    return out


def _s3fs(url: str, dest: Path) -> Path:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    out = dest / "blob"
    fs.get(url, str(out))
    return out


CLIENTS = {"ftjob (obstore)": _ftjob, "boto3 transfer manager": _boto3, "s3fs": _s3fs}


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(2**24):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.s3")
    p.add_argument("--gib", type=float, default=2.0, help="size of the object (GiB)")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ftjob-s3bench-"))
    subprocess.run(["bash", str(S3_SH), "up", str(work / "server")], check=True)
    try:
        os.environ.update(_env(work / "server"))
        blob, size = work / "blob", int(a.gib * 2**30)
        with open(blob, "wb") as f:
            for _ in range(0, size, 2**26):
                f.write(os.urandom(min(2**26, size - f.tell())))
        want = _sha(blob)
        import obstore

        from ftjob.trainer.state.objectstore import store

        obstore.put(store("bench"), "blob", blob, chunk_size=64 * 2**20)
        blob.unlink()  # the disk holds one copy at a time
        best = {name: float("inf") for name in CLIENTS}
        for _ in range(2):
            for name, get in CLIENTS.items():
                dest = work / "dest"
                dest.mkdir()
                t = time.monotonic()
                got = get("s3://bench/blob", dest)
                best[name] = min(best[name], time.monotonic() - t)
                assert _sha(got) == want, f"{name}: the download differs from the upload"
                shutil.rmtree(dest)
        print(f"| client | best of 2 (s) | MiB/s |  ({a.gib:g} GiB object, loopback)")
        print("|---|---|---|")
        for name, seconds in best.items():
            print(f"| {name} | {seconds:.2f} | {size / 2**20 / seconds:.0f} |")
    finally:
        subprocess.run(["bash", str(S3_SH), "down", str(work / "server")], check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
