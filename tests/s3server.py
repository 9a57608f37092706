"""A real S3-compatible server for the s3:// tests: scripts/s3.sh's SeaweedFS (`weed server
-s3`) on loopback, with an admin identity, a read-only one, and the keys for each as the AWS
SDKs read them. Uploads go through obstore, the client the trainer downloads with."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import envs
import prebuilds

ROOT = Path(__file__).resolve().parents[1]
S3_SH = ROOT / "scripts" / "s3.sh"


def build() -> None:
    """weed, built (or found cached) by the session's prebuild, started at collection. Where it
    cannot be built CI fails; a developer without Go gets a skip."""
    if not shutil.which("go"):
        envs.unavailable("the S3 server cannot be built: go is not installed")
    code, out, err = prebuilds.S3.result()
    if code:
        envs.unavailable(f"scripts/s3.sh build failed (exit {code}):\n" + (out + err)[-3000:])


class S3Server:
    """``scripts/s3.sh up DIR``'s server: its endpoint, its identities' environments."""

    def __init__(self, workdir: Path, bind: str = "127.0.0.1"):
        self.dir, self.bind = workdir, bind  # bind: the address it listens on (s3.sh up)

    def up(self) -> S3Server:
        done = subprocess.run(["bash", str(S3_SH), "up", str(self.dir), self.bind],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return self

    def down(self) -> None:
        subprocess.run(["bash", str(S3_SH), "down", str(self.dir)], check=True, timeout=60)

    @property
    def vars(self) -> dict[str, str]:
        lines = (self.dir / "env").read_text().splitlines()
        return dict(line.split("=", 1) for line in lines if "=" in line)

    @property
    def endpoint(self) -> str:
        return self.vars["ENDPOINT"]

    def env(self, who: str = "admin") -> dict[str, str]:
        """The AWS environment of identity ``who`` (admin, reader), or of an unknown key pair
        (``who="stranger"``)."""
        v = self.vars
        if who == "stranger":
            keys = ("AKIAFTJOBSTRANGER", "not-a-secret-the-store-knows")
        else:
            keys = (v[f"{who.upper()}_ACCESS_KEY"], v[f"{who.upper()}_SECRET_KEY"])
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1",
                "AWS_ACCESS_KEY_ID": keys[0], "AWS_SECRET_ACCESS_KEY": keys[1]}  # fmt: skip

    def store(self, bucket: str, who: str = "admin"):
        from obstore.store import S3Store

        e = self.env(who)
        return S3Store(bucket, endpoint=e["AWS_ENDPOINT_URL"], region=e["AWS_REGION"],
                       access_key_id=e["AWS_ACCESS_KEY_ID"],
                       secret_access_key=e["AWS_SECRET_ACCESS_KEY"],
                       virtual_hosted_style_request=False,
                       client_options={"allow_http": True})  # fmt: skip

    def upload(self, bucket: str, local: Path, prefix: str) -> None:
        """A file, or a folder's files under ``prefix``, as the admin (SeaweedFS creates the
        bucket on its first object)."""
        import obstore

        s = self.store(bucket)
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        for f in files:
            key = prefix if local.is_file() else f"{prefix}/{f.relative_to(local).as_posix()}"
            obstore.put(s, key, f)
