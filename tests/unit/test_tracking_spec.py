"""spec.tracking: its rules, the pods it renders (credentials only as secretKeyRefs), what it
leaves alone (the job folder's fingerprint), and progress's trackingWarnings in status."""

import re
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
from test_jobfolder import RAW

from ftjob.api.jobspec import parse_spec
from ftjob.api.schema import SpecError
from ftjob.job import folder as jobfolder
from ftjob.job import launch
from ftjob.operator import render, status
from ftjob.trainer.report import trackers

MLFLOW = {
    "trackingUri": "https://mlflow.example.com",
    "experiment": "llama",
    "username": {"name": "mlflow", "key": "user"},
    "password": {"name": "mlflow", "key": "password"},
}
WANDB = {"project": "llama", "entity": "team", "apiKey": {"name": "wandb", "key": "key"}}
UID = "0f3c9a52-7d4e-4b1a-9c55-3f2b8e1d6a70"
CHART = Path(__file__).resolve().parents[2] / "charts" / "ftjob"


def spec(tracking=None, **extra):
    return parse_spec({**RAW, **extra, "tracking": tracking or {}})


def errors_of(tracking) -> list[str]:
    with pytest.raises(SpecError) as e:
        spec(tracking)
    return [str(x) for x in e.value.errors]


def test_every_tracker_is_declared_with_its_defaults():
    t = spec({"mlflow": {"trackingUri": "http://mlflow:5000"}, "wandb": {"project": "p",
              "mode": "offline"}, "tensorboard": {}}).tracking  # fmt: skip
    assert t.mlflow.experiment == "ftjob" and t.mlflow.token is None
    assert t.wandb.mode == "offline" and t.wandb.api_key is None
    assert t.tensorboard.enabled is True
    assert spec().tracking.mlflow is None  # nothing is tracked unless the job says so


@pytest.mark.parametrize(
    ("tracking", "error"),
    [
        (
            {"mlflow": {"trackingUri": "http://m", "username": {"name": "s", "key": "u"}}},
            "spec.tracking.mlflow.password: username and password go together",
        ),
        (
            {"mlflow": {**MLFLOW, "token": {"name": "s", "key": "t"}}},
            "spec.tracking.mlflow.token: set token or username and password, not both",
        ),
        ({"mlflow": {"trackingUri": "mlflow:5000"}}, "spec.tracking.mlflow.trackingUri: must be"),
        ({"wandb": {"project": "p"}}, "spec.tracking.wandb.apiKey: online mode needs apiKey"),
        ({"wandb": {"project": "a/b", "mode": "offline"}}, "spec.tracking.wandb.project: must"),
    ],
)
def test_a_wrong_tracker_is_refused_naming_the_field_and_the_fix(tracking, error):
    found = errors_of(tracking)
    assert any(e.startswith(error) for e in found), found


@pytest.mark.parametrize("path", ["tensorboard", "wandb/x", "tracking.json", "pushed.json"])
def test_the_export_may_not_overwrite_what_the_trackers_keep(path):
    found = [str(e) for e in pytest.raises(SpecError, spec, output={"path": path}).value.errors]
    assert any(e.startswith("spec.output.path: path may not be") for e in found), found


def test_tracking_changes_nothing_trained_so_a_job_folder_takes_it():
    before = jobfolder.record("j", spec())
    after = spec({"mlflow": MLFLOW, "wandb": WANDB, "tensorboard": {"enabled": True}})
    assert jobfolder.changes(before, after) == []
    assert jobfolder.fingerprint(jobfolder.training_fields(after)) == before["fingerprint"]


def test_credentials_travel_only_as_secret_references_in_valid_pods():
    s = spec({"mlflow": MLFLOW, "wandb": WANDB})
    cmd = launch.node_command(s, "j", 0, "j-node-0.j", "j-1", "/etc/ftjob/spec.json")
    assert not {"MLFLOW_TRACKING_USERNAME", "WANDB_API_KEY"} & set(cmd.env)
    pod = render.pod("j", "ns", s, 0, 0, UID)
    kubernetes_validate.validate(pod, "1.37", strict=True)
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["MLFLOW_TRACKING_USERNAME"] == {
        "name": "MLFLOW_TRACKING_USERNAME",
        "valueFrom": {"secretKeyRef": {"name": "mlflow", "key": "user"}},
    }
    assert env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "password"
    assert env["WANDB_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "wandb", "key": "key"}}
    assert "MLFLOW_TRACKING_TOKEN" not in env
    token = spec({"mlflow": {"trackingUri": "databricks", "token": {"name": "db"}}})
    assert launch.tracking_secrets(token)["MLFLOW_TRACKING_TOKEN"].key == "token"


def test_status_carries_the_trackers_the_run_went_on_without():
    said = ["tracking: mlflow is off for this run: ...; training goes on"]
    assert status.progress({"step": 3, "trackingWarnings": said})["trackingWarnings"] == said
    assert "trackingWarnings" not in status.progress({"step": 3, "trackingWarnings": []})


def test_the_spec_is_logged_flat_as_the_runs_parameters():
    params = trackers.parameters(spec({"mlflow": MLFLOW}))
    assert params["training.learningRate"] == "0.003"
    assert params["dataset.source"] == "data/train.jsonl"
    assert params["resources.nodes"] == "2"
    assert params["tracking.mlflow.username.name"] == "mlflow"  # a Secret's name, no value
    assert all(isinstance(v, str) for v in params.values())


def test_an_error_names_no_credentials_from_an_address():
    said = trackers.redact("cannot reach https://bob:s3cret@mlflow.example.com/api")
    assert "s3cret" not in said and "https://***@mlflow.example.com/api" in said


# -- the chart's cluster-wide default (trainer.tracking) ---------------------------------


def operator_env(values: dict) -> dict[str, str]:
    """The operator container's environment as the real chart renders it with ``values``."""
    import helm_python as helm
    import yaml

    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name="ftjob", namespace="ftjob-system", is_install=True)
    (deployment,) = [
        doc
        for path, text in out.items()
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc and doc["kind"] == "Deployment"
    ]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_the_charts_default_trackers_reach_jobs_that_name_none():
    """trainer.tracking -> the operator's FTJOB_DEFAULT_TRACKING -> its settings -> the pods
    and the spec of a job without spec.tracking; a job that names a tracker keeps its own."""
    from ftjob.operator import handlers

    default = {"mlflow": {**MLFLOW, "experiment": "cluster"}}
    settings = handlers.Settings.from_env(operator_env({"trainer": {"tracking": default}}))
    job = render.with_tracking(spec(), settings.default_tracking)
    assert job.tracking.mlflow.experiment == "cluster"
    pod = render.pod("j", "ns", job, 0, 0, UID)
    kubernetes_validate.validate(pod, "1.37", strict=True)
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "mlflow"
    assert '"experiment": "cluster"' in render.config_map("j", "ns", job, UID)["data"]["spec.json"]
    own = spec({"tensorboard": {"enabled": False}})  # an opt-out names a tracker
    assert render.with_tracking(own, settings.default_tracking) is own
    # Unset (the chart's default), nothing is added.
    assert handlers.Settings.from_env(operator_env({})).default_tracking is None


def test_the_chart_refuses_a_default_tracker_a_job_could_not_have():
    import helm_python as helm

    bad = {"trainer": {"tracking": {"mlflow": {"trackingUri": "mlflow:5000"}}}}
    with pytest.raises(helm.HelmValuesError, match="/trainer/tracking/mlflow/trackingUri"):
        operator_env(bad)
    with pytest.raises(helm.HelmValuesError, match="additional properties 'mlfow'"):
        operator_env({"trainer": {"tracking": {"mlfow": {}}}})
    # What JSON Schema cannot say (the CEL rules), the operator refuses when it starts.
    with pytest.raises(SpecError, match="trainer.tracking.wandb.apiKey: online mode needs"):
        render.default_tracking('{"wandb": {"project": "p"}}')


# -- docs/progress.md's copy-paste examples -------------------------------------------------


def tracker_section() -> str:
    text = (CHART.parents[1] / "docs" / "progress.md").read_text()
    return text.split("## Experiment trackers", 1)[1].split("\n## ", 1)[0]


def test_the_docs_examples_are_jobs_the_spec_takes():
    import yaml

    blocks = re.findall(r"```yaml\n(.*?)```", tracker_section(), flags=re.DOTALL)
    found = set()
    for block in blocks:
        tracking = yaml.safe_load(block)["spec"]["tracking"]
        found |= set(spec(tracking).tracking.__dict__) & set(tracking)
    assert found == {"mlflow", "wandb", "tensorboard"}


def test_the_docs_helm_command_renders_the_default_the_operator_reads():
    import helm_python as helm

    from ftjob.operator import handlers

    (command,) = re.findall(r"^(helm upgrade (?:.*\\\n)*.*)$", tracker_section(), re.MULTILINE)
    args = shlex.split(command.replace("\\\n", " "))
    assert "charts/ftjob" in args, command
    mlflow = {}
    for i, arg in enumerate(args):
        if args[i - 1] == "--set":
            mlflow |= helm.parse_set_string(arg)["trainer"]["tracking"]["mlflow"]
    env = operator_env({"trainer": {"tracking": {"mlflow": mlflow}}})
    default = handlers.Settings.from_env(env).default_tracking
    assert default.mlflow.tracking_uri == "http://mlflow.mlflow:5000"
    assert default.mlflow.experiment == "fine-tunes"
