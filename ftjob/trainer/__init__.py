"""The trainer: runs in every pod under torchrun (``python -m ftjob.trainer --spec FILE``)."""

from ftjob.trainer.quiet import silence_torchao

# Before any trainer module imports torchao (model.py, through peft): see quiet.py.
silence_torchao()
