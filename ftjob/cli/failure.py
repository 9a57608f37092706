"""PURE: why a local run failed, in one line first: which node and rank, what, and the fix.

``ftjob run`` calls :func:`summarize` once every node has stopped. Each node's termination
record (:mod:`ftjob.api.contract`, written by the trainer) is the first source; a node killed
from outside, or a crash below Python, leaves none, and then its log is read: the trainer's
own ``error:`` lines, a few well-known messages, the last exception, or torchrun's exit code.

When one rank fails the others fail after it (a collective that never completes, a store
that closed), so the node whose failure explains the others is chosen, not the first to exit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ftjob.api import contract

# What a person can do about each reason (the spec's field names, the command that helps).
FIXES = {
    contract.BAD_DATA: "fix spec.dataset as the message above says",
    contract.BAD_MODEL: "check spec.model.source: a folder with config.json, or hf://org/name",
    contract.BAD_SPEC: "`ftjob validate FILE` names every invalid field",
    contract.WILL_NOT_FIT: "`ftjob plan FILE` shows the memory the job needs and what fits",
    contract.HUB_UNREACHABLE: "check this machine's network (proxy, DNS, HF_ENDPOINT), then "
    "run it again: nothing is wrong with the job, and what was downloaded is kept",
    contract.STORE_UNREACHABLE: "check AWS_ENDPOINT_URL and this machine's network, then run it "
    "again: nothing is wrong with the job, and the download resumes where it stopped",
    contract.CUDA_OOM: "lower spec.training.microBatchSize or spec.dataset.maxSeqLength, or set "
    "spec.training.activationCheckpointing: all; `ftjob plan FILE` estimates the memory",
    contract.HOST_OOM: "this machine ran out of memory: `ftjob plan FILE` estimates it per "
    "process; use fewer processes (resources.nodes) or a smaller model",
    contract.DISK_FULL: "free space where the job folder is, or lower spec.checkpoint.keep",
    contract.PUSH_FAILED: "check that the credentials may write to spec.output.push (HF_TOKEN "
    "for the Hub, the key pair for s3://) and the network, then run it again: the export is "
    "kept and only the push is retried",
    contract.HUB_PUSH_FAILED: "check HF_TOKEN (write access to spec.output.push) and the "
    "network, then run it again: the export is kept and only the push is retried",
    contract.COLLECTIVE_TIMEOUT: "a rank stopped answering (named above when its heartbeat "
    "told): its node's log says why; a rank that hangs for good needs a restart (run it again)",
    contract.NCCL_TIMEOUT: "a rank stopped answering: the other nodes' logs say why",
}
# BadData naming one record (a JSONL line, a record number): that record is the thing to fix.
RECORD_FIX = "fix the record named above in spec.dataset.source"
NAMES_A_RECORD = re.compile(r" (?:line|record) \d+\b")
NO_GPU = (
    "no usable GPU here: run the job on a cluster (kubectl apply), or on CPU with "
    "resources.gpusPerNode: 0"
)
# Consequences rather than causes: another node's failure explains them.
SECONDARY = {
    contract.COLLECTIVE_TIMEOUT,
    contract.NCCL_TIMEOUT,
    contract.NCCL_ERROR,
    contract.INTERNAL,
}

# (pattern in a log line, reason, fix): the messages worth recognising without a record.
# The operator reads a pod's log tail for the same signs (contract.LOG_SIGNS).
KNOWN = [
    *((sign, reason, None) for sign, reason in contract.LOG_SIGNS),
    (r"No space left on device", contract.DISK_FULL, None),
    (
        r"no NVIDIA driver|No CUDA GPUs are available|not compiled with CUDA|"
        r"asks for GPUs \(resources.gpusPerNode\) but none is visible",
        contract.INTERNAL,
        NO_GPU,
    ),
]
# The trainer's own line: "error: rank R: <Reason>: message (where)" (ftjob.trainer.__main__).
ERROR_LINE = re.compile(r"^error: (?:rank (\d+): )?(?:([A-Z][A-Za-z0-9]+): )?(.*)$")
EXCEPTION = re.compile(r"^(?:\[rank(\d+)\]: )?((?:[\w.]+\.)?\w*(?:Error|Exception)\b.*)$")
TORCHRUN_RANK = re.compile(r"^\s+rank\s+: (\d+)")
TORCHRUN_EXIT = re.compile(r"^\s+exitcode\s+: (-?\d+)")
TORCHRUN_SIGNAL = re.compile(r"Signal \d+ \((SIG\w+)\) received")


@dataclass
class NodeOutcome:
    """One node after the run: its exit code, its record (if any) and its log's lines."""

    node: int
    exit_code: int | None
    record: dict | None
    lines: list[str]
    log: str  # where the full log is


@dataclass
class Summary:
    node: int
    rank: int | None
    cause: str
    reason: str | None
    fix: str | None
    log: str
    details: list[str]  # a few more lines of the cause (a multi-line error), may be empty

    def headline(self) -> str:
        rank = f" (rank {self.rank})" if self.rank is not None else ""
        return f"node {self.node}{rank} failed: {self.cause}"


def summarize(outcomes: list[NodeOutcome]) -> Summary | None:
    """The failure that explains the run's end, or None if every node succeeded."""
    failed = [_summary(o) for o in outcomes if o.exit_code not in (None, 0)]
    failed += [
        _summary(o)
        for o in outcomes
        if o.exit_code in (None, 0) and (o.record or {}).get("outcome") == "failed"
    ]
    if not failed:
        return None
    # A named primary cause beats a consequence (a peer's timeout) and an unnamed exit.
    return min(failed, key=lambda s: (s.reason is None, s.reason in SECONDARY))


def _summary(o: NodeOutcome) -> Summary:
    record = o.record if (o.record or {}).get("outcome") == "failed" else None
    if record is not None:
        reason = record.get("reason")
        where = f" ({record['where']})" if record.get("where") else ""
        return Summary(
            node=o.node,
            rank=record.get("rank"),
            cause=f"{reason}: {record.get('message', '')}{where}",
            reason=reason,
            fix=record.get("fix") or _fix(reason, record.get("message", "")),
            log=o.log,
            details=[],
        )
    return _from_log(o)


def _from_log(o: NodeOutcome) -> Summary:
    lines = o.lines
    rank = next((int(m[1]) for x in lines if (m := TORCHRUN_RANK.match(x))), None)
    # 1. The trainer's own error (it names the file, line or field), with its indented lines.
    for i, line in enumerate(lines):
        m = ERROR_LINE.match(line)
        if m:
            reason = m[2] if m[2] in contract.REASONS else None
            details = [x.strip() for x in _indented(lines, i + 1)]
            # The trainer's own fix for this cause, when it printed one ("  fix: ...").
            fixes = [x.removeprefix("fix: ") for x in details if x.startswith("fix: ")]
            details = [x for x in details if not x.startswith("fix: ")]
            rank = int(m[1]) if m[1] is not None else rank
            cause = f"{m[2]}: {m[3]}" if m[2] else m[3]
            if not m[3] and details:  # "error: FILE: invalid FineTuneJob:" then the fields
                cause = details.pop(0)
            fix = fixes[0] if fixes else _fix(reason, cause)
            return Summary(o.node, rank, cause, reason, fix, o.log, details)
    # 2. A message worth knowing, then the first exception a rank raised.
    for pattern, reason, fix in KNOWN:
        hit = next((x for x in lines if re.search(pattern, x)), None)
        if hit:
            return Summary(o.node, rank, _strip(hit), reason, fix or FIXES.get(reason), o.log, [])
    for line in lines:
        m = EXCEPTION.match(line)
        if m and not m[2].startswith("torch.distributed.elastic"):
            rank = int(m[1]) if m[1] is not None else rank
            return Summary(o.node, rank, m[2], None, None, o.log, [])
    # 3. Only an exit code: say what it means.
    code = next((int(m[1]) for x in lines if (m := TORCHRUN_EXIT.match(x))), o.exit_code)
    sig = next((m[1] for x in lines if (m := TORCHRUN_SIGNAL.search(x))), None)
    if sig == "SIGKILL":
        return Summary(
            o.node,
            rank,
            "killed (SIGKILL), often by the kernel's out-of-memory killer",
            contract.HOST_OOM,
            FIXES[contract.HOST_OOM],
            o.log,
            [],
        )
    cause = f"exit code {code}" + (f" ({sig})" if sig else "")
    return Summary(o.node, rank, cause, None, None, o.log, [])


def _fix(reason: str | None, message: str) -> str | None:
    """The reason's fix, unless the message says more precisely what to fix (a record)."""
    if reason == contract.BAD_DATA and NAMES_A_RECORD.search(message):
        return RECORD_FIX
    return FIXES.get(reason)


def _indented(lines: list[str], start: int) -> list[str]:
    out = []
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        out.append(line)
    return out


def _strip(line: str) -> str:
    return re.sub(r"^\[rank\d+\]: ", "", line).strip()
