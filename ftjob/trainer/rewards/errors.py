"""The one error the rewards raise: a reward that cannot score, named with its file and line."""

from __future__ import annotations

from ftjob.api.contract import BAD_SPEC, TrainerError


class RewardError(TrainerError):
    """A reward failed: a user function that is missing, raised, hung or returned the wrong
    shape, or a record without the reward's field. The message names the reward, the file
    and the line (also ``where``); ``fix`` says what to change, which the failure record, the
    operator and ``ftjob run`` show beside the message, as for every TrainerError.

    Its reason is BadSpec: the same completions (the sampler's generator is checkpointed) meet
    the same function again after a restart, so retrying cannot help until the job changes.
    """

    def __init__(self, message: str, *, fix: str, where: str | None = None):
        super().__init__(message, reason=BAD_SPEC, where=where, fix=fix)
