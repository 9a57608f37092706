"""Credentials stay out of what a training process says (issue 71, item 5): the values of the
variables FTJOB_SECRET_ENV names are masked in stdout, stderr and logging (the pod log, whose
last lines may become the termination message), in termination records (status and Events)
and in an object store's reply; a tracker's parameters carry env's names, never values.

The same on a real cluster, with a real Secret: tests/cluster/test_real_gang.py greps everything
the job wrote for the planted value."""

from __future__ import annotations

import json
import logging
import sys

from test_children import job as job_doc

from ftjob.api import contract
from ftjob.api.jobspec import parse_resource
from ftjob.api.profile import apply, parse_profile
from ftjob.api.source import parse
from ftjob.cli.run import _unset_secrets
from ftjob.operator import render
from ftjob.trainer.fetch import storeerrors
from ftjob.trainer.gang import termination
from ftjob.trainer.report import secrecy, trackers

PLANTED = "plantedValue-7f3a9c"  # what a Secret holds
SIGNED_URL = (
    "https://bucket.s3.example.com/key?X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20261205"
    "&X-Amz-Signature=0f9e8d7c6b5a"
)


def secret_env(monkeypatch) -> None:
    monkeypatch.setenv(contract.SECRET_ENV, "TEAM_TOKEN,AWS_SECRET_ACCESS_KEY,SHORT")
    monkeypatch.setenv("TEAM_TOKEN", PLANTED)
    monkeypatch.setenv("SHORT", "1")  # too short to mask without masking every "1"


def test_what_a_process_prints_and_logs_carries_no_secret_value(monkeypatch, capsys):
    secret_env(monkeypatch)
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # install() replaces them; undone after
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    secrecy.install()
    secrecy.install()  # idempotent: wrapped once
    handler = logging.StreamHandler()  # made after install, as the trainer's loggers are
    log = logging.getLogger("test_secrecy")
    log.addHandler(handler)
    try:
        print(f"connecting with {PLANTED} to {SIGNED_URL}; retries 1")
        log.error("request failed: token=%s", PLANTED)
    finally:
        log.removeHandler(handler)
    out, err = capsys.readouterr()
    assert PLANTED not in out + err and "0f9e8d7c6b5a" not in out and "AKIA" not in out
    assert out.startswith("connecting with [TEAM_TOKEN] to https://bucket.s3.example.com/")
    assert "X-Amz-Signature=[masked]" in out and out.endswith("retries 1\n")
    assert err == "request failed: token=[TEAM_TOKEN]\n"


def test_a_termination_record_carries_no_secret_value(monkeypatch, tmp_path):
    secret_env(monkeypatch)
    target = tmp_path / "termination-log"
    monkeypatch.setenv("FTJOB_TERMINATION_LOG", str(target))
    termination.write(termination.failure(RuntimeError(f"hub refused {PLANTED}")))
    text = target.read_text()
    assert PLANTED not in text and "[TEAM_TOKEN]" in json.loads(text)["message"]


def test_an_object_stores_reply_is_masked_before_it_is_quoted(monkeypatch):
    secret_env(monkeypatch)
    reply = PermissionError(f"SignatureDoesNotMatch for GET {SIGNED_URL} secret {PLANTED}")
    said = storeerrors.refused("model", parse("s3://bucket/key"), reply)
    assert said is not None and PLANTED not in str(said) and "0f9e8d7c6b5a" not in str(said)
    assert "X-Amz-Credential=[masked]" in str(said) and "[TEAM_TOKEN]" in str(said)


def test_a_url_password_an_authorization_header_and_a_key_id_are_masked():
    said = secrecy.mask(
        "https://bob:hunter2@mlflow.example.com/ said no; Authorization: Bearer abc.def; "
        "key AKIAIOSFODNN7EXAMPLE",
        {},
    )
    assert said == (
        "https://bob:[masked]@mlflow.example.com/ said no; Authorization: Bearer [masked]; "
        "key [masked]"
    )


def test_a_trackers_parameters_name_the_variables_and_hold_no_value():
    ref = {"secretKeyRef": {"name": "team-tokens", "key": "api"}}
    env = [{"name": "PLAIN", "value": PLANTED}, {"name": "T", "valueFrom": ref}]
    _, spec = parse_resource(job_doc(env=env))
    params = trackers.parameters(spec)
    assert params["env"] == '["PLAIN", "T"]'
    assert PLANTED not in json.dumps(params)


def test_a_profiles_default_from_a_secret_reaches_the_pod_as_a_reference(monkeypatch):
    ref = {"secretKeyRef": {"name": "platform-tokens", "key": "hub"}}
    team = parse_profile(
        {
            "apiVersion": "ftjob.dev/v1alpha1",
            "kind": "FineTuneProfile",
            "metadata": {"name": "team"},
            "spec": {"defaults": {"env": [{"name": "HUB_TOKEN", "valueFrom": ref}]}},
        }
    )
    name, spec = parse_resource(apply(job_doc(resources={"gpusPerNode": 0}), team).doc)
    env = render.pod(name, "ns", spec, 0, 0)["spec"]["containers"][0]["env"]
    assert {"name": "HUB_TOKEN", "valueFrom": ref} in env
    monkeypatch.delenv("HUB_TOKEN", raising=False)
    assert _unset_secrets(spec) == [
        "spec.env[0]: HUB_TOKEN comes from Secret platform-tokens on a cluster; ftjob run takes "
        "it from this environment, where it is not set (export HUB_TOKEN=...)"
    ]
    monkeypatch.setenv("HUB_TOKEN", PLANTED)
    assert _unset_secrets(spec) == []
