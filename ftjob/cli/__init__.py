"""ftjob's command line (``ftjob = ftjob.cli:main``): commands (validate, plan, render, crd,
run, operator), run (``ftjob run``: the pods as local processes), validate, output, screen,
failure."""

from ftjob.cli.commands import main

__all__ = ["main"]
