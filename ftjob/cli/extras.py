"""What each optional part of ftjob needs installed, and the hint when it is not.

``pip install ftjob`` gives validate, plan, render and crd; the operator, the trainer
(``ftjob run``), QLoRA's 4-bit base and the experiment trackers' clients are extras
(pyproject.toml). A command whose extra is missing says which extra and how to install it,
instead of ending in an import traceback; so does a job whose settings need one. Which
modules are missing is read from this machine (find_spec: nothing is imported); the rest is
pure.
"""

from __future__ import annotations

import importlib.util

from ftjob.job import installed

# The top-level modules each extra provides (pyproject.toml's [project.optional-dependencies]).
MODULES = {
    "operator": ("kopf", "kubernetes", "prometheus_client"),
    "trainer": (
        "torch",
        "transformers",
        "peft",
        "datasets",
        "safetensors",
        "tokenizers",
        "huggingface_hub",
        "trl",
        "prometheus_client",
        "rich",
    ),
    "qlora": installed.QLORA,  # its own extra: ftjob.job.installed says why
    "tracking": ("mlflow", "wandb", "tensorboard"),
}
# Which extra a command needs before it can start.
COMMANDS = {"operator": "operator", "run": "trainer"}


def hint(extra: str, missing: list[str], what: str) -> str:
    """The line a user reads: what needs the extra, what is missing, and the command."""
    return (
        f"{what} needs ftjob's {extra} extra ({', '.join(missing)} not installed); install it "
        f"with: pip install 'ftjob[{extra}]'"
    )


def extra_of(module: str) -> str | None:
    """The extra that provides a top-level module (None: not one of ftjob's extras')."""
    top = module.split(".")[0]
    return next((extra for extra, mods in MODULES.items() if top in mods), None)


def not_installed(modules: tuple[str, ...] | list[str]) -> list[str]:
    """Those of ``modules`` this Python cannot import."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def command_problem(command: str) -> str | None:
    """The hint for ``ftjob COMMAND`` when its extra is missing here, else None."""
    extra = COMMANDS.get(command)
    missing = not_installed(MODULES[extra]) if extra else []
    return hint(extra, missing, f"ftjob {command}") if missing else None
