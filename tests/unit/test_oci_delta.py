"""scripts/oci_delta.py: which of an image's layers a real node is sent, and the folder kept.

The chain IDs are checked against the snapshot keys a real containerd (1.6) made when it
unpacked the operator image (`ctr snapshots ls`, 2026-12-05); the archive and the hollow blobs
on an OCI folder laid out as `podman save --format oci-dir --uncompressed` writes it. A real
node importing a real image through them is tests/cluster/test_real_nodes.py's, whenever the
images changed since the cache's (scripts/nodes.sh, nodes_import_delta).

    python -m pytest tests/unit/test_oci_delta.py -q
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("oci_delta", ROOT / "scripts" / "oci_delta.py")
oci_delta = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(oci_delta)

# The operator image's diff IDs and the snapshot keys containerd gave its three layers.
DIFF_IDS = [
    "sha256:a4a22f7665df95bd83617e25294b2a2c9f593d5a95f0709be3e505221f229d05",
    "sha256:59713958112c3208983b99796ff98abfee0e5cca9f64f64eb0ad9feb2bacb325",
    "sha256:a942b84c2b1e1a5f4c9533ee4b7fe7daf20706e247119c4685263a9c2f5a8f23",
]
SNAPSHOTS_LS = """\
KEY                                                                     PARENT                                                                  KIND
sha256:5190137873953a4df3bcf47aedc2c99fb56dac8f5d191fe26efcdb1d6dcecbe8 sha256:7031fe8059ce695922bca34f17f5456efeea9c97faa9e8b4b0c7899dac0a4b7c Committed
sha256:7031fe8059ce695922bca34f17f5456efeea9c97faa9e8b4b0c7899dac0a4b7c sha256:a4a22f7665df95bd83617e25294b2a2c9f593d5a95f0709be3e505221f229d05 Committed
sha256:a4a22f7665df95bd83617e25294b2a2c9f593d5a95f0709be3e505221f229d05                                                                         Committed
k8s.io/12/extract-1234 sha256:a4a22f7665df95bd83617e25294b2a2c9f593d5a95f0709be3e505221f229d05 Active
"""  # noqa: E501  (ctr's own columns)


def test_chain_ids_are_the_snapshot_keys_containerd_made():
    chains = oci_delta.chain_ids(DIFF_IDS)
    assert chains[0] == DIFF_IDS[0]
    assert set(chains) == oci_delta.committed(SNAPSHOTS_LS)  # the Active one is not a layer


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def oci_folder(folder: Path, layers: list[bytes]) -> list[str]:
    """An OCI layout of one image with these (uncompressed) layers; their digests."""
    blobs = folder / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def put(data: bytes) -> dict:
        (blobs / digest(data).split(":")[1]).write_bytes(data)
        return {"digest": digest(data), "size": len(data)}

    digests = [digest(layer) for layer in layers]
    config = put(json.dumps({"rootfs": {"type": "layers", "diff_ids": digests}}).encode())
    manifest = put(json.dumps({"config": config, "layers": [put(x) for x in layers]}).encode())
    index = {"schemaVersion": 2, "manifests": [manifest]}
    (folder / "index.json").write_text(json.dumps(index))
    (folder / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return digests


def archive(folder: Path, present: set[str]) -> dict[str, bytes]:
    out = io.BytesIO()
    oci_delta.write_archive(folder, present, out)
    out.seek(0)
    with tarfile.open(fileobj=out) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_the_archive_leaves_out_the_layers_the_node_has_and_keeps_the_rest(tmp_path):
    base, top = b"base layer " * 1000, b"ftjob's layer"
    digests = oci_folder(tmp_path, [base, top])
    chains = oci_delta.chain_ids(digests)
    sent = archive(tmp_path, {chains[0]})
    names = {f"blobs/sha256/{d.split(':')[1]}" for d in digests}
    assert f"blobs/sha256/{digests[1].split(':')[1]}" in sent
    assert f"blobs/sha256/{digests[0].split(':')[1]}" not in sent
    assert {"index.json", "oci-layout"} <= sent.keys() and len(sent) == 5  # + config, manifest
    # A node with nothing gets every layer; one with both, none.
    assert names <= archive(tmp_path, set()).keys()
    assert not names & archive(tmp_path, set(chains)).keys()


def test_hollow_blobs_keep_their_size_are_never_sent_and_are_named_when_needed(tmp_path):
    base, top = b"b" * 100_000, b"t" * 10
    digests = oci_folder(tmp_path, [base, top])
    chains = oci_delta.chain_ids(digests)
    oci_delta.make_hollow(tmp_path)
    paths = [oci_delta.blob(tmp_path, d) for d in digests]
    assert [p.stat().st_size for p in paths] == [len(base), len(top)]
    assert all(oci_delta.hollow(p) for p in paths)
    # The config and manifest stay whole: the next import reads the chain from them.
    assert len(oci_delta.layers(tmp_path)) == 2
    # A node that lacks the top layer needs its blob written again; one with both needs none.
    assert oci_delta.needed(tmp_path, {chains[0]}) == [paths[1]]
    assert oci_delta.needed(tmp_path, set(chains)) == []
    # Sent, a hollow blob would be zeros: the archive refuses it instead.
    assert archive(tmp_path, set(chains)).keys() == {"index.json", "oci-layout"} | {
        f"blobs/sha256/{p.name}" for p in oci_delta.images(tmp_path)[0][0]
    }
    with pytest.raises(SystemExit, match="is hollow; save the image again"):
        archive(tmp_path, {chains[0]})


def test_what_earlier_saves_left_is_made_hollow_and_the_index_kept_whole(tmp_path):
    oci_folder(tmp_path, [b"old top layer"])
    old = [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
    (tmp_path / "index.json").unlink()  # as nodes.sh does before each save
    digests = oci_folder(tmp_path, [b"new top layer"])
    oci_delta.make_hollow(tmp_path)
    assert all(oci_delta.hollow(p) for p in old)  # the old manifest and config too
    ((documents, _),) = oci_delta.images(tmp_path)
    assert not any(oci_delta.hollow(p) for p in documents)
    assert oci_delta.hollow(oci_delta.blob(tmp_path, digests[0]))
