"""The plan kept by the trainer (issue 73): each training process plans its job from the
model's own config.json before anything is prepared or loaded, as `ftjob plan` does, and a
job that will not fit ends as a permanent WillNotFit with the plan's figures and fix; and
`ftjob validate` says the same verdict (a warning, an error with --strict).

In-process, on the real check and the bundled tiny model's config; the real process's record
is tests/unit/test_status.py's "will-not-fit" scenario, `ftjob run`'s tests/e2e/test_run_display.py.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml
from example_jobs import example

from ftjob.api import contract, manifest
from ftjob.api.contract import TrainerError
from ftjob.api.jobspec import parse_resource
from ftjob.cli import validate
from ftjob.cli.commands import main
from ftjob.job import machine
from ftjob.operator import lifecycle, render
from ftjob.operator import status as st
from ftjob.plan import describe
from ftjob.plan.describe import planned_condition
from ftjob.plan.layout import estimate
from ftjob.trainer.model import planned

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIG = json.loads((EXAMPLES / "tiny-model" / "config.json").read_text())


def test_a_job_the_plan_says_will_not_fit_is_refused_with_the_figures_and_the_fix():
    with pytest.raises(TrainerError) as refused:
        planned.check(example("tiny.yaml", **{"resources.memory": "300Mi"}), CONFIG, None)
    e = refused.value
    assert e.reason == contract.WILL_NOT_FIT and e.reason in contract.PERMANENT
    assert e.reason in contract.NOT_IN_PLACE  # the node agent restarts nothing in place either
    assert str(e).startswith("WILL NOT FIT: 2.5 GiB of 300.0 MiB CPU memory per pod (peak while "
                             "preparing"), str(e)  # fmt: skip
    assert e.fix.startswith("set resources.memory: 3Gi "), e.fix
    # What `ftjob run` and the operator read: the record carries the verdict and the fix.
    assert contract.rank_of(e.reason) < contract.rank_of(contract.COLLECTIVE_TIMEOUT)


def test_a_job_that_fits_runs_and_says_the_verdict():
    said = planned.check(example("tiny.yaml", **{"resources.memory": "3Gi"}), CONFIG, None)
    assert said.startswith("plan: FITS: ") and "of 3.0 GiB CPU memory per pod" in said, said


def test_unenforced_unknown_and_unread_run_with_a_line_that_says_so():
    relaxed = example("tiny.yaml", **{"resources.memory": "300Mi", "plan.enforce": False})
    said = planned.check(relaxed, CONFIG, None)
    assert said.startswith("warning: plan: WILL NOT FIT: ") and "starting anyway" in said
    # No resources.memory on CPU: the machine's memory sets the layout, not a verdict.
    said = planned.check(example("tiny.yaml"), CONFIG, 8 * 2**30)
    assert said == "plan: not checked: set resources.memory to check the CPU memory"
    assert planned.check(example("tiny.yaml"), None, None).startswith("plan: not checked (")
    # A config the planner misreads (a count given as text) is said, not a failed job.
    odd = {**CONFIG, "num_hidden_layers": "two"}
    said = planned.check(example("tiny.yaml", **{"resources.memory": "3Gi"}), odd, None)
    assert said.startswith("plan: not checked: the planner failed: TypeError("), said


def test_a_tight_gpu_fit_runs_with_a_warning():
    """Llama-3-8B LoRA on one 80 GB GPU, sequences long enough that the plan calls it tight
    (75.2 of 80 GiB): it runs, with the margin said as a warning; one step longer is refused."""
    tight = planned.check(_one_gpu(5120), LLAMA3_8B, None)
    assert tight.startswith("warning: the plan's margin is tight"), tight
    assert "FITS (tight): 75.2 GiB of 80.0 GiB per GPU (94%)" in tight
    with pytest.raises(TrainerError, match=r"WILL NOT FIT: 80.9 GiB of 80.0 GiB per GPU"):
        planned.check(_one_gpu(5632), LLAMA3_8B, None)


def test_a_tight_fit_rank_0_found_is_the_jobs_planned_condition_and_one_warning_event():
    """The operator cannot read a model on the volume (NotPlanned at the door); the gang's
    rank 0 plans it from its config.json and serves the plan in its progress. The job's
    Planned condition then says the trainer's verdict, tight, with one Warning Event, and
    keeps it when no snapshot is held (a new gang starting)."""
    spec = _one_gpu(5120)
    spec.model.source = "models/llama3-8b"  # on the volume: the operator cannot read it
    assert planned_condition(spec)["reason"] == "Unknown"
    snapshot = {"plan": planned.published(planned_condition(spec, LLAMA3_8B))}
    first = lifecycle.decide(spec, "tight", 1, None, [], T0, snapshot=snapshot)
    cond = st.condition(first.status["conditions"], "Planned")
    assert (cond["status"], cond["reason"]) == ("True", lifecycle.FITS_TIGHT), cond
    assert cond["message"].startswith("FITS (tight): 75.2 GiB of 80.0 GiB per GPU"), cond
    warned = [(kind, m) for kind, r, m in first.events if r == lifecycle.TIGHT_MARGIN]
    assert len(warned) == 1 and warned[0][0] == "Warning" and "75.2 GiB" in warned[0][1], warned
    for held in (snapshot, None):
        again = lifecycle.decide(spec, "tight", 1, first.status, [], T0, snapshot=held)
        assert st.condition(again.status["conditions"], "Planned") == cond
        assert not [r for _, r, _ in again.events if r == lifecycle.TIGHT_MARGIN]


LLAMA3_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "dtype": "bfloat16"}  # fmt: skip


def _one_gpu(seq: int):
    return example(
        "llama3-8b-lora-efa.yaml",
        **{"resources.nodes": 1, "resources.gpusPerNode": 1, "resources.gpuType": "H100-80GB",
           "training.microBatchSize": 1, "training.activationCheckpointing": "none",
           "dataset.maxSeqLength": seq},
    )  # fmt: skip


def test_keep_reads_the_models_config_beside_the_job_and_this_machines_memory(monkeypatch):
    monkeypatch.setenv("FTJOB_SOURCE_ROOT", str(EXAMPLES))  # relative sources, as the pods'
    assert planned.model_config("tiny-model") == CONFIG
    assert planned.model_config("no-such-model") is None
    monkeypatch.setattr(machine, "memory_bytes", lambda: 1.0 * 2**30)
    with pytest.raises(TrainerError, match="of 300.0 MiB"):
        planned.keep(example("tiny.yaml", **{"resources.memory": "300Mi"}))
    # What rank 0's progress serves (key "plan"): the verdict and each phase's figure.
    said, plan = planned.keep(example("tiny.yaml", **{"resources.memory": "3Gi"}))
    assert said.startswith("plan: FITS") and plan["reason"] == "Fits"
    assert plan["verdict"] == said.removeprefix("plan: ")
    phases = plan["cpuPhaseBytes"]
    assert list(phases) == ["preparing", "loading", "training", "saving", "exporting"]
    assert phases["preparing"] == max(phases.values()) and phases["preparing"] > 2.4 * 2**30


# ------------------------------------------------------------ validate says it too (item 2)


def tiny_file(tmp_path: Path, **resources) -> Path:
    """examples/tiny.yaml with absolute sources and ``resources`` (plan.enforce: enforce)."""
    doc = yaml.safe_load((EXAMPLES / "tiny.yaml").read_text())
    for key in ("model", "dataset"):
        doc["spec"][key]["source"] = str(EXAMPLES / doc["spec"][key]["source"])
    if "enforce" in resources:
        doc["spec"]["plan"] = {"enforce": resources.pop("enforce")}
    doc["spec"]["resources"].update(resources)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def checked(path: Path, strict: bool = False) -> validate.CheckedJob:
    (doc,) = manifest.load(path)
    job = validate.check(doc, job_file=str(path))
    validate.memory_verdict(job, strict)
    return job


def test_validate_warns_of_a_job_that_will_not_fit_and_strict_refuses_it(tmp_path, capsys):
    path = tiny_file(tmp_path, memory="300Mi")
    job = checked(path)
    assert job.ok and job.notes == []
    (warning,) = job.warnings
    assert warning.startswith("the plan says it will not fit: WILL NOT FIT: 2.5 GiB of 300.0 MiB")
    assert warning.endswith("fits with: resources.memory: 3Gi")
    strict = checked(path, strict=True)
    assert not strict.ok and strict.errors == [f"spec.resources: {warning}"]
    # The command: exit 0 with the warning; --strict, exit 1 with the job INVALID.
    assert main(["validate", str(path)]) == 0
    assert f"warning (tiny): {warning}" in capsys.readouterr().out.splitlines()
    assert main(["validate", "--strict", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("INVALID") and out[1] == f"  spec.resources: {warning}"


def test_validate_says_nothing_of_a_fit_a_note_where_it_cannot_tell(tmp_path):
    fits = checked(tiny_file(tmp_path, memory="3Gi"), strict=True)
    assert fits.ok and fits.warnings == [] and fits.notes == []
    # spec.plan.enforce false: the trainer would start it, so --strict only warns.
    relaxed = checked(tiny_file(tmp_path, memory="300Mi", enforce=False), strict=True)
    assert relaxed.ok and "starting anyway" in relaxed.warnings[0]
    # No resources.memory on CPU: what `ftjob run` runs here, left alone; a GPU job without
    # gpuType has no figure to hold it to, and says so.
    assert checked(tiny_file(tmp_path)).notes == []
    gpu = tiny_file(tmp_path, gpusPerNode=1, memory="64Gi")
    assert checked(gpu).notes == [
        "not checked: memory: set resources.gpuType (and resources.memory) to check the fit"
    ]
    doc = yaml.safe_load(tiny_file(tmp_path).read_text())
    doc["spec"]["model"]["source"] = "on-the-volume"  # not on this machine
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(doc))
    away = checked(tmp_path / "tiny.yaml")
    assert away.ok and away.notes[-1] == validate.MEMORY_UNCHECKED and away.warnings == []


# ------------------------------------- an OOMKilled pod held to the plan (item 3, the operator)

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def tiny_spec(memory: str, enforce: bool = False):
    doc = manifest.load(EXAMPLES / "tiny.yaml")[0]
    doc["spec"]["resources"]["memory"] = memory
    doc["spec"]["plan"] = {"enforce": enforce}
    doc["spec"]["runPolicy"] = {"backoffLimit": 3}
    return parse_resource(doc)


def gang_pod(name, spec, rank: int, oom: bool = False) -> dict:
    p = render.pod(name, "ns", spec, rank, 0, "uid")
    state = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}} if oom else {"running": {}}
    p["status"] = {"phase": "Failed" if oom else "Running",
                   "containerStatuses": [{"name": "trainer", "state": state}]}  # fmt: skip
    p["spec"]["nodeName"] = f"node-{rank}"
    return p


def oom_killed(memory: str, snapshot: dict | None) -> lifecycle.Decision:
    """Rank 1's pod OOMKilled while rank 0's progress said ``snapshot``."""
    name, spec = tiny_spec(memory)
    started = lifecycle.decide(spec, name, 1, None, [], T0)
    pods = [gang_pod(name, spec, 0), gang_pod(name, spec, 1, oom=True)]
    return lifecycle.decide(spec, name, 1, started.status, pods, T0, snapshot)


def served(memory: str, phase: str) -> dict:
    """Rank 0's progress as the trainer serves it: its phase and its plan (planned.published)."""
    _, spec = tiny_spec(memory)
    return {"phase": phase, "plan": planned.published(planned_condition(spec, CONFIG))}


def test_an_oom_the_plan_foresaw_is_not_retried_and_names_the_figure_beside_the_limit():
    d = oom_killed("300Mi", served("300Mi", "preparing-data"))
    assert d.phase == "Failed" and d.status["restarts"] == 0, d.status
    failure = d.status["failure"]
    assert failure["reason"] == "OOMKilled" and "raise resources.memory" in failure["message"]
    assert ("\nforeseen by the plan (2.5 GiB while preparing, last seen, against the limit "
            "300Mi): WILL NOT FIT: 2.5 GiB of 300.0 MiB") in failure["message"]  # fmt: skip
    running = st.condition(d.status["conditions"], "Running")
    assert running["message"].startswith("not retried: the plan foresaw it")


def test_an_oom_the_plan_did_not_foresee_is_retried_and_said_a_planner_miss():
    d = oom_killed("3Gi", served("3Gi", "training"))
    assert d.phase == "Restarting" and d.status["restarts"] == 1, d.status
    message = d.status["failure"]["message"]
    assert ("\nplanner miss: the plan said it fits (900.2 MiB while training, last seen, against "
            "the limit 3Gi): FITS: 2.5 GiB of 3.0 GiB") in message, message  # fmt: skip
    (miss,) = [e for e in d.events if e[1] == "PlannerMiss"]
    assert miss[0] == "Warning" and "planner miss: the plan said it fits" in miss[2]
    # No plan known (a model folder the operator cannot read, no progress served): as before.
    d = oom_killed("3Gi", None)
    assert d.phase == "Restarting" and "plan" not in d.status["failure"]["message"]
    assert not [e for e in d.events if e[1] == "PlannerMiss"]


# ------------------------------------------- below any model: the door refuses what no pod holds


def test_a_limit_below_what_any_model_needs_is_refused_at_the_door_before_any_pod(tmp_path):
    """On real nodes a 300Mi pod of examples/tiny.yaml was OOMKilled before its trainer read the
    model's config.json, three gangs in a row: so where the operator cannot read the model, a
    limit below what a pod needs whatever the model (the plan of a smallest model) is refused."""
    name, spec = tiny_spec("300Mi", enforce=True)
    refused = planned_condition(spec)  # the model a folder on the volume: no shape
    assert refused["reason"] == "WillNotFit" and refused["allowed"] is False
    assert refused["message"].startswith(
        "WILL NOT FIT whatever the model: at least 2.5 GiB of 300.0 MiB CPU memory per pod"
    )
    assert refused["fix"].startswith("set resources.memory: 3Gi or more")
    d = lifecycle.decide(spec, name, 1, None, [], T0)
    assert d.phase == "Failed" and d.create == [] and d.status["failure"]["reason"] == "WillNotFit"
    assert planned_condition(tiny_spec("3Gi", enforce=True)[1])["reason"] == "Unknown"
    # validate says so too where the model is not on this machine.
    doc = yaml.safe_load(tiny_file(tmp_path, memory="300Mi").read_text())
    doc["spec"]["model"]["source"] = "on-the-volume"
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(doc))
    away = checked(tmp_path / "tiny.yaml")
    assert away.warnings[0].startswith("the plan says it will not fit: WILL NOT FIT whatever")


@pytest.mark.parametrize(
    "name, edits",
    [("tiny.yaml", {"resources.memory": "300Mi"}), ("tiny.yaml", {"resources.cpu": 1}),
     ("llama3-8b-lora-efa.yaml", {}), ("llama3-8b-full-1gpu.yaml", {}),
     ("llama31-70b-qlora.yaml", {})],
)  # fmt: skip
def test_the_smallest_model_needs_no_more_in_any_phase_than_a_real_one(name, edits):
    spec = example(name, **edits)
    real = CONFIG if name == "tiny.yaml" else None
    shape = describe.shape_for(spec.model.source, real)
    least, actual = estimate(spec, describe.SMALLEST), estimate(spec, shape)
    for phase, need in least.cpu_phases.items():
        assert need <= actual.cpu_phases[phase], phase
