"""The trainer: runs in every pod under torchrun (``python -m ftjob.trainer --spec FILE``)."""
