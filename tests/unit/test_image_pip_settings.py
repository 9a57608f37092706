"""What scripts/images.sh forwards of a machine's pip settings into its image builds
(scripts/pip_forward.py, which images.sh runs): where packages come from, each with the folder
or file it names, and nothing that names a file of the machine's own (a constraint file: the
build's `pip install` then fails with `Could not open requirements file`)."""

import configparser
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def forwarded(tmp_path, conf: str, **env) -> tuple[dict, list, list, str]:
    """Run images.sh's step on a machine whose system pip.conf (XDG_CONFIG_DIRS, as
    /etc/xdg/pip/pip.conf) is ``conf``: (the build's pip.conf, mounts, files, stderr)."""
    (tmp_path / "xdg" / "pip").mkdir(parents=True)
    (tmp_path / "xdg" / "pip" / "pip.conf").write_text(conf)
    (tmp_path / "home").mkdir()
    (tmp_path / "out").mkdir()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    clean.update(XDG_CONFIG_DIRS=str(tmp_path / "xdg"), HOME=str(tmp_path / "home"), **env)
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "pip_forward.py"), str(tmp_path / "out")],
        capture_output=True, text=True, env=clean, check=True,
        timeout=120,  # a hang guard: pip's `config list` takes about a second
    )  # fmt: skip
    parser = configparser.ConfigParser()
    parser.read(tmp_path / "out" / "pip.conf")
    lines = [(tmp_path / "out" / name).read_text().split() for name in ("mounts", "files")]
    return dict(parser["global"]), *lines, done.stderr


def test_a_constraint_file_of_the_machine_stays_out_and_the_index_settings_go(tmp_path):
    wheels, cert = tmp_path / "wheels", tmp_path / "ca.pem"
    wheels.mkdir()
    cert.write_text("a CA file\n")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch==2.13.0\n")
    conf, mounts, files, said = forwarded(
        tmp_path,
        f"[global]\nconstraint = {constraints}\nfind-links = {wheels}\n"
        "index-url = https://pypi.example/simple\n",
        PIP_DEFAULT_TIMEOUT="180",
        PIP_CERT=str(cert),  # PIP_*: a machine's /etc/pip.conf, read after XDG's, would win
    )
    assert "constraint" not in conf
    assert "constraint (not an index setting) is left out" in said
    assert conf["find-links"] == str(wheels) and mounts == [str(wheels)]
    assert conf["index-url"] == "https://pypi.example/simple"
    assert conf["default-timeout"] == "180"  # PIP_* as pip reads them
    assert conf["cert"] == str(cert) and files == [str(cert)]


def test_a_setting_whose_folder_or_file_is_missing_is_left_out(tmp_path):
    conf, mounts, files, said = forwarded(
        tmp_path,
        "[global]\nretries = 2\n",
        PIP_CERT="/nonexistent/ca.pem",
        PIP_FIND_LINKS=f"/nonexistent/wheels {tmp_path}",
        PIP_EXTRA_INDEX_URL="file:///nonexistent/index/simple",
    )
    assert "cert" not in conf and files == []
    assert conf["find-links"] == str(tmp_path) and mounts == [str(tmp_path)]
    assert "extra-index-url" not in conf
    assert conf["retries"] == "2"
    assert "find-links /nonexistent/wheels (no such folder here)" in said
    assert "cert (/nonexistent/ca.pem is not a file here)" in said
