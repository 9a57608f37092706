"""The trainer's start-up imports torch and its own modules, and what a later phase needs is
imported by that phase (ftjob/trainer/report/startup.py): the ``imports`` figure of the
start-up line is the interpreter, torch and ftjob, not transformers or FSDP (issue 70).

    python -m pytest tests/unit/test_startup_imports.py -q
"""

import json
import subprocess
import sys

# Each imported by the phase that uses it: transformers, pyarrow, datasets and trl by the data
# phase; torch._dynamo (torch.compile's), peft and torchao by the model's build; FSDP and
# DTensor by sharding; DCP by the first checkpoint; the trackers' clients once tracking starts.
LATER = (
    "transformers",
    "torch._dynamo",
    "torch._inductor",
    "sympy",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "pyarrow",
    "datasets",
    "peft",
    "trl",
    "torchao",
    "mlflow",
    "wandb",
)


ENTRIES = ("ftjob.trainer.train", "ftjob.trainer.__main__", "ftjob.trainer.agent")
# One fresh interpreter imports each entry in turn and notes what each added: pytest's own
# process has imported everything already, and one start serves the three.
PROBE = f"""
import importlib, json, sys
print(json.dumps({{e: [m for m in {LATER!r} if m in sys.modules]
                  for e in {ENTRIES!r} if importlib.import_module(e)}}))
"""


def test_the_trainers_entry_points_import_no_later_phases_library():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {e: [] for e in ENTRIES}
