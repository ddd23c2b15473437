"""The shape of the weights compare document: what `weights compare --json` prints, what
weights.json holds and what the reports read (built by `compare`, keys in the order written)."""

from __future__ import annotations

from typing import TypedDict

from rl_msprobe.weights.experts import ExpertDoc


class DeltaDoc(TypedDict):
    """fingerprint.Delta: how far a tensor is from its reference."""

    ratio: float | None  # largest |difference| / tolerance (None: infinite)
    norm_rel: float | None
    what: str


class _Status(TypedDict):
    status: str  # one of compare.STATUSES


class _Detail(TypedDict, total=False):
    """What a finding says beyond its status; keys present only where they say something."""

    ranks: list[int]
    faulty_ranks: list[int]
    ratio: float | None
    norm_rel: float | None
    what: str
    why: str


class FindingDoc(_Status, _Detail):
    """One stage (received / resident) of one tensor."""


class _TensorRow(TypedDict):
    sync: int
    step: int | None
    index: int | None  # the tensor's place in the model's order (None: never sent)
    order: int
    name: str
    received: FindingDoc
    resident: FindingDoc


class TensorRow(_TensorRow, total=False):
    replica: int  # the engine replica, when there are several (absent for the first)
    replicas: int  # ranks holding each element of the tensor
    how: str  # where the resident fingerprint comes from: loader-written | parameter
    expert: ExpertDoc  # a per-expert MoE tensor: its layer, expert and projection


class SyncSummary(TypedDict):
    sync: int
    step: int | None
    verdict: str
    sent_tensors: int
    model_tensors: int
    tp_size: int | None
    replicas: int
    counts: dict[str, int]  # status -> findings, over both stages
    resident_how: dict[str, int]
    resident_reused: int  # resident fingerprints the helper took from received (identical bytes)
    received_reused: int  # received fingerprints the helper took from sent (checksum equal to the sender's)
    received_implied: int  # of those, checksummed where the engine holds them (resident k64 = sent k64)
    not_synced: list[NotSynced]  # engine tensors this sync never wrote, by name, shape and rank


class NotSynced(TypedDict):
    """An engine tensor the sync did not write on RANKS: not received there, or still holding reset
    mode's pattern after the sync."""

    sync: int
    name: str
    shape: list[int] | None
    ranks: list[int]
    why: str


class Where(TypedDict):
    """Where a tensor's finding is: the step, sync, name, stage and (per expert) index."""

    step: int | None
    sync: int
    name: str
    stage: str
    index: int | None


class FirstDifference(Where, _Detail, total=False):
    """The first tensor that differs: where, and what its finding says (its status is `differs`)."""

    status: str  # only while it is built from the finding: removed before it is returned
    expert: ExpertDoc  # a per-expert MoE tensor: its layer, expert and projection


class _Document(TypedDict):
    verdict: str
    folder: str
    steps: list[SyncSummary]
    tensors: list[TensorRow]
    first_difference: FirstDifference | None
    not_synced: list[NotSynced]


class WeightsDoc(_Document, total=False):
    report: list[str]  # the report files, when --out wrote them
