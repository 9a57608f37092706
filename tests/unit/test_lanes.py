"""scripts/tests.py, the suite as two pytest sessions side by side: what each lane is given,
and what its exit status says.

    python -m pytest tests/unit/test_lanes.py -q
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("lanes", ROOT / "scripts" / "tests.py")
lanes = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(lanes)


def test_the_trainer_lane_is_every_test_the_planes_lane_does_not_name():
    argv = lanes.lanes(["-x"])
    planes = [a for a in argv["planes"][3:] if not a.startswith("-")]
    assert planes == list(lanes.PLANES) and all((ROOT / p).exists() for p in planes)
    trainer = argv["trainer"][3:]
    assert trainer[0] == "tests"
    ignored = {a.removeprefix("--ignore=") for a in trainer if a.startswith("--ignore=")}
    assert ignored == set(planes)
    for lane, args in argv.items():  # options reach both; each writes its own JUnit XML
        assert args[-1] == "-x" and f"--junitxml={lanes.RESULTS / lane}.xml" in args


def test_an_e2e_module_in_the_planes_lane_shares_no_session_fixture_with_the_other_lane():
    """A session fixture of tests/e2e/conftest.py (a reference run, the QLoRA base) used in
    both lanes would be made twice: such modules stay together in the trainer lane."""
    conftest = (ROOT / "tests" / "e2e" / "conftest.py").read_text()
    shared = re.findall(r'@pytest\.fixture\(scope="session"\)\ndef (\w+)\(', conftest)
    assert {"recovery_reference", "qlora", "dpo"} <= set(shared)
    for path in (p for p in lanes.PLANES if p.startswith("tests/e2e/")):
        tree = ast.parse((ROOT / path).read_text())
        asked = {
            a.arg for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) for a in f.args.args
        }
        assert not asked & set(shared), path


def test_the_exit_status_is_the_worse_lanes_and_a_lane_that_selected_nothing_is_no_failure():
    assert lanes.status({"planes": 0, "trainer": 0}) == 0
    assert lanes.status({"planes": 1, "trainer": 0}) == 1
    assert lanes.status({"planes": lanes.NO_TESTS, "trainer": 0}) == 0
    assert lanes.status({"planes": lanes.NO_TESTS, "trainer": 1}) == 1
    assert lanes.status({"planes": lanes.NO_TESTS, "trainer": lanes.NO_TESTS}) == lanes.NO_TESTS
