"""A signal is a checkpoint: the pure parts. Whether a save fits the time a SIGTERM leaves,
the grace period the operator gives the pods, the gang's vote, and the record through the
contract. The whole mechanism with real processes: tests/e2e/test_preemption.py."""

import json
import os
import signal
from pathlib import Path

from ftjob.api import contract, manifest
from ftjob.api.jobspec import parse_resource
from ftjob.operator import render
from ftjob.plan import saving
from ftjob.trainer.gang import preempt

ROOT = Path(__file__).resolve().parents[2]


def tiny(**checkpoint):
    doc = manifest.load(ROOT / "examples" / "tiny.yaml")[0]
    doc["spec"]["checkpoint"].update(checkpoint)
    return parse_resource(doc)


def test_a_save_fits_only_with_room_to_spare():
    assert preempt.save_fits(time_left=10, save_seconds=5)
    assert not preempt.save_fits(time_left=10, save_seconds=9)  # no room for the exit
    assert not preempt.save_fits(time_left=-1, save_seconds=0.1)  # SIGKILL is due already
    assert preempt.save_fits(time_left=float("inf"), save_seconds=1e9)  # a rank not signalled


def test_the_grace_period_comes_from_the_environment_or_kubernetes_default():
    assert preempt.grace_seconds({contract.GRACE_ENV: "12.5"}) == 12.5
    assert preempt.grace_seconds({}) == 30.0
    assert preempt.grace_seconds({contract.GRACE_ENV: "soon"}) == 30.0


def test_the_pods_grace_period_is_the_planners_save_time_with_a_margin_or_the_spec():
    assert saving.grace_period_seconds(0, 2) == saving.MIN_GRACE_SECONDS
    big = 3 * 8e9 * 4  # an 8B full fine-tune's weights and moments
    assert saving.grace_period_seconds(big, 2) == 2 * int(
        saving.SAVE_FIXED_SECONDS + big / (2 * saving.SAVE_BYTES_PER_SECOND_PER_NODE)
    )
    assert saving.grace_period_seconds(big, 2, given=90) == 90


def test_the_pod_and_its_trainer_are_told_the_same_grace_period():
    for name, spec in (tiny(), tiny(gracePeriodSeconds=300)):
        pod = render.pod(name, "ns", spec, 1, 0, "uid")
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        grace = pod["spec"]["terminationGracePeriodSeconds"]
        assert env[contract.GRACE_ENV] == str(grace)
    assert grace == 300
    known = tiny()[1]
    known.model.source = "hf://meta-llama/Meta-Llama-3-8B"
    known.method.type = "full"
    assert render.grace_seconds(known) > saving.MIN_GRACE_SECONDS


def test_the_vote_is_the_gangs_sum_and_stays_agreed():
    request = preempt.Request(grace=30)
    vote = preempt.Vote(request)
    assert vote.ballot() == 0.0
    vote.cast(0.0)  # step 1: nobody signalled
    assert not vote.agreed()
    request.arm()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # noted, not fatal
    finally:
        request.disarm()
    assert request.asked and 0 < request.time_left() <= 30
    assert vote.ballot() == 1.0
    vote.cast(1.0)  # step 2: the all-reduced sum of two ranks, one of them signalled
    assert vote.agreed()  # at the same step, on every rank (each reads the same sum)
    vote.cast(0.0)
    assert vote.agreed()  # an agreement is not taken back


def test_a_preempted_record_is_neither_success_nor_failure():
    rec = contract.preempted_record(26, "/ftjob/j/checkpoints/step-00000026", "stopped")
    parsed = contract.parse(contract.dumps(rec))
    assert parsed["outcome"] == "preempted" and parsed["step"] == 26
    failure = {"outcome": "failed", "reason": contract.NCCL_ERROR, "message": "x"}
    assert contract.keep(rec, failure) == failure  # a rank that failed still says so
    assert contract.keep(failure, rec) == failure
    assert contract.EXIT_PREEMPTED not in (0, 1) and contract.EXIT_PREEMPTED < 128


def test_the_plan_states_the_grace_period_the_pods_get_and_why():
    from ftjob.cli import output
    from ftjob.plan import describe, options
    from ftjob.plan.modelshape import shape_for

    big = parse_resource(manifest.load(ROOT / "examples" / "llama2-70b-full.yaml")[0])
    cases = {"floor": tiny(), "checkpoint.gracePeriodSeconds": tiny(gracePeriodSeconds=300),
             "margin": big}  # fmt: skip
    for why, (name, spec) in cases.items():
        source = spec.model.source
        config = (
            None
            if "://" in source
            else json.loads((ROOT / "examples" / source / "config.json").read_text())
        )
        result = options.plan(spec, shape_for(source, config))
        rendered = render.pod(name, "ns", spec, 1, 0, "uid")["spec"][
            "terminationGracePeriodSeconds"
        ]
        stated = output.plan_result("f.yaml", name, spec, result)["gracePeriod"]
        assert stated["seconds"] == rendered and why in stated["why"]
        line = next(x for x in describe.describe(spec, result) if x.startswith("grace"))
        assert f"terminationGracePeriodSeconds {rendered} (" in line and why in line
    assert rendered > saving.MIN_GRACE_SECONDS  # the 70B job: the save, not the floor
