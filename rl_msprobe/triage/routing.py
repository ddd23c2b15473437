"""MoE routing in a triage folder: the rollout's and the trainer's router decisions, token by token.

The verl-routing set writes ``<folder>/<pid>/routing.jsonl`` beside verl-triage's lines (its
helper's docstring has the schema): per row, each MoE layer's top-k expert ids and the margin
between the k-th and (k+1)-th router logit. Rollout rows are keyed by vLLM's request id (the
triage line's ``request_id`` once vLLM's suffix is stripped), training rows by the sequence's
token ids (prompt + response, what the actor's log-prob recompute ran).

A response token j (0-based) is predicted by the row at absolute position ``prompt_len + j - 1``:
that row's routing is the one compared at response position j, on both sides, and lined up with
the token's |Δ log p|. Per layer: the share of compared tokens whose expert SET differs, and
among them how many are near-ties (the smaller of the two margins below ``near_tie``: a flip
that any rounding can make); per response position: the share of tokens routed differently in
at least one layer; the first layer that differs (the cause; later layers see its changed
output) and the mean |Δ log p| of tokens routed differently versus the others.

Replay: the trainer's header says verl's router-replay mode (Megatron / VeOmni engines; the FSDP
engine has none) and whether the batch carried the rollout's routed experts, the rollout's whether
vLLM returns them. Replay ON and every compared token's experts equal: it held.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_msprobe import bounded
from rl_msprobe.dumps.correlate import strip_request_id
from rl_msprobe.dumps.layout import walk_files
from rl_msprobe.errors import UserError
from rl_msprobe.triage.stream import log_files

LOG_NAME = "routing.jsonl"
NEAR_TIE = 0.01  # router-logit margin below which a flip is a near-tie
KEEP_FLIPS = 50  # per step
POSITION_BUCKETS = 16

Row = tuple[tuple[frozenset[int], ...], tuple[float, ...]]  # per layer: the expert set, the margin
RolloutRows = dict[str, dict[int, Row]]  # request id (suffix stripped) -> position -> row
TrainRows = dict[tuple[int, ...], list[tuple[int, dict[int, Row]]]]  # tokens -> (call, position -> row)


@dataclass
class LayerStats:
    compared: int = 0
    differ: int = 0
    differ_near_tie: int = 0
    near_tie: int = 0

    def share(self) -> float:
        return self.differ / self.compared if self.compared else math.nan

    def to_json(self) -> dict[str, Any]:
        return {
            "compared": self.compared,
            "differ": self.differ,
            "share_differ": self.share(),
            "differ_near_tie": self.differ_near_tie,
            "near_tie": self.near_tie,
        }


@dataclass
class Flip:
    step: Any
    request_id: str | None
    position: int  # 0-based in the response
    layer: int
    rollout: list[int]
    train: list[int]
    margin: float  # the smaller of the two sides' margins
    dlogp: float

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class StepRouting:
    step: Any
    tokens: int = 0  # response tokens compared (both sides' rows found)
    differ: int = 0  # ... routed differently in at least one layer
    layers: dict[int, LayerStats] = field(default_factory=dict)
    positions: dict[int, list[int]] = field(default_factory=dict)  # position -> [compared, differ]
    first_layers: dict[int, int] = field(default_factory=dict)  # first differing layer -> tokens
    dlogp_differ: list[float] = field(default_factory=list)  # [sum, count]
    dlogp_same: list[float] = field(default_factory=list)
    kept: int = 0  # flips of this step kept in Routing.flips

    def share(self) -> float:
        return self.differ / self.tokens if self.tokens else math.nan

    def cause_layer(self) -> int | None:
        """The lowest layer whose expert sets differ beyond near-ties (else beyond none)."""
        real = [k for k, s in self.layers.items() if s.differ > s.differ_near_tie]
        some = real or [k for k, s in self.layers.items() if s.differ]
        return min(some) if some else None

    def mean_dlogp(self, differ: bool) -> float:
        acc = self.dlogp_differ if differ else self.dlogp_same
        return acc[0] / acc[1] if acc and acc[1] else math.nan

    def flipped_positions(self) -> list[int]:
        return sorted(p for p, (_c, d) in self.positions.items() if d)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "differ": self.differ,
            "share_differ": self.share(),
            "agreement": 1.0 - self.share() if self.tokens else math.nan,
            "cause_layer": self.cause_layer(),
            "first_layers": {str(k): v for k, v in sorted(self.first_layers.items())},
            "layers": {str(k): v.to_json() for k, v in sorted(self.layers.items())},
            "flipped_positions": self.flipped_positions(),
            "by_position": [
                {"position": p, "compared": c, "differ": d} for p, (c, d) in sorted(self.positions.items())
            ],
            "mean_dlogp_routed_differently": self.mean_dlogp(True),
            "mean_dlogp_routed_alike": self.mean_dlogp(False),
        }


@dataclass
class Routing:
    files: list[str] = field(default_factory=list)
    layer_names: dict[str, list[str]] = field(default_factory=dict)  # side -> gate module names
    top_k: int | None = None
    replay: dict[str, dict[str, Any]] = field(default_factory=dict)  # side -> its header's replay
    steps: dict[Any, StepRouting] = field(default_factory=dict)
    requests: int = 0  # triage requests with both sides' routing
    unmatched: dict[str, int] = field(default_factory=lambda: {"rollout": 0, "train": 0})
    errors: list[str] = field(default_factory=list)
    flips: list[Flip] = field(default_factory=list)
    near_tie: float = NEAR_TIE

    def step_list(self) -> list[StepRouting]:
        return [self.steps[k] for k in sorted(self.steps, key=lambda s: (isinstance(s, str), s))]

    def replay_state(self) -> str:
        """'off', 'on, held', 'on, NOT held' or 'on (nothing compared)'."""
        train = self.replay.get("train", {})
        on = bool(train.get("enabled")) or str(train.get("mode", "none")) not in ("none", "disabled")
        if not on:
            return "off"
        tokens = sum(s.tokens for s in self.steps.values())
        if not tokens:
            return "on (nothing compared)"
        return "on, held" if not any(s.differ for s in self.steps.values()) else "on, NOT held"

    def to_json(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "layers": self.layer_names,
            "top_k": self.top_k,
            "near_tie": self.near_tie,
            "replay": {**self.replay, "state": self.replay_state()},
            "requests": self.requests,
            "unmatched_requests": self.unmatched,
            "errors": self.errors,
            "steps": [s.to_json() for s in self.step_list()],
            "flips": [f.to_json() for f in self.flips],
        }


def routing_files(root: Path) -> list[Path]:
    if root.is_file():
        root = root.parent
    return sorted(walk_files(root, {LOG_NAME}, max_depth=3))


def read_routing(root: Path, near_tie: float = NEAR_TIE) -> Routing | None:
    """The routing comparison of the triage folder ROOT; None when no routing.jsonl is under it."""
    files = routing_files(root)
    if not files:
        return None
    out = Routing(files=[str(p) for p in files], near_tie=near_tie)
    rollout: RolloutRows = defaultdict(dict)
    train: TrainRows = defaultdict(list)
    for path in files:
        with bounded.open_regular(path, "routing log") as f:
            for number, raw in enumerate(bounded.lines(f, path, "routing"), 1):
                if not raw.strip():
                    continue
                try:
                    doc = json.loads(raw)
                    _take(doc, out, rollout, train)
                except (ValueError, KeyError, TypeError, IndexError) as exc:
                    raise UserError(
                        f"{path}:{number}: not a routing line rl-msprobe's verl-routing helper writes "
                        f"({type(exc).__name__}: {exc}); remove the line or the file and rerun"
                    ) from None
    _compare(root, out, rollout, train)
    return out


def _rows(doc: dict[str, Any]) -> dict[int, Row]:
    rows: dict[int, Row] = {}
    for pos, experts, margins in zip(doc["positions"], doc["experts"], doc["margins"], strict=True):
        rows[int(pos)] = (
            tuple(frozenset(int(e) for e in ids) for ids in experts),
            tuple(map(float, margins)),
        )
    return rows


def _take(doc: dict[str, Any], out: Routing, rollout: RolloutRows, train: TrainRows) -> None:
    side = doc["side"]
    if "error" in doc:
        if len(out.errors) < 5:
            out.errors.append(f"{side}: {doc['error']}")
        return
    if doc.get("kind") == "header":
        out.layer_names.setdefault(side, list(doc.get("layers") or []))
        out.top_k = out.top_k or doc.get("top_k")
        replay = doc.get("replay") or {}
        if replay or side not in out.replay:
            out.replay[side] = replay
        return
    if side == "rollout":
        rollout[strip_request_id(str(doc["request_id"]))].update(_rows(doc))
    elif side == "train":
        train[tuple(int(t) for t in doc["tokens"])].append((int(doc.get("call") or 0), _rows(doc)))


def _triage_lines(root: Path) -> Iterator[dict[str, Any]]:
    for path in log_files(root if root.is_dir() else root.parent):
        with bounded.open_regular(path, "triage log") as f:
            for raw in bounded.lines(f, path, "triage"):
                try:
                    doc = json.loads(raw)
                except ValueError:
                    continue  # the triage report counts it
                if isinstance(doc, dict) and "error" not in doc and doc.get("response_ids") is not None:
                    yield doc


def _compare(root: Path, out: Routing, rollout: RolloutRows, train: TrainRows) -> None:
    steps_seen: list[Any] = []
    lines = list(_triage_lines(root))
    for doc in lines:
        if doc.get("step") not in steps_seen:
            steps_seen.append(doc.get("step"))
    order = {s: i + 1 for i, s in enumerate(sorted(steps_seen, key=lambda s: (isinstance(s, str), s)))}
    for doc in lines:
        try:
            prompt = [int(t) for t in doc.get("prompt_ids") or []]
            response = [int(t) for t in doc["response_ids"]]
        except (TypeError, ValueError):
            continue  # a line the triage report counts as unreadable
        rid = doc.get("request_id")
        got_rollout = rollout.get(strip_request_id(str(rid))) if rid is not None else None
        calls = train.get(tuple(prompt + response))
        if got_rollout is None:
            out.unmatched["rollout"] += 1
        if not calls:
            out.unmatched["train"] += 1
        if got_rollout is None or not calls:
            continue
        # the recompute of this step: the call whose rank is the step's (one recompute per step)
        want = order.get(doc.get("step"), 0)
        got_train = next((rows for call, rows in calls if call == want), calls[-1][1])
        out.requests += 1
        _compare_request(out, doc, len(prompt), len(response), got_rollout, got_train)


def _compare_request(
    out: Routing, doc: dict[str, Any], prompt_len: int, n: int, ro: dict[int, Row], tr: dict[int, Row]
) -> None:
    step = doc.get("step")
    stats = out.steps.setdefault(step, StepRouting(step))
    rlp, tlp = doc.get("rollout_log_probs") or [], doc.get("train_log_probs") or []
    for j in range(n):
        row = prompt_len + j - 1
        if row < 0 or row not in ro or row not in tr:
            continue
        (r_sets, r_margins), (t_sets, t_margins) = ro[row], tr[row]
        stats.tokens += 1
        dlogp = _gap(rlp, tlp, j)
        first = None
        for layer, (a, b) in enumerate(zip(r_sets, t_sets)):
            s = stats.layers.setdefault(layer, LayerStats())
            s.compared += 1
            margin = min(r_margins[layer], t_margins[layer])
            tie = margin < out.near_tie
            s.near_tie += tie
            if a != b:
                s.differ += 1
                s.differ_near_tie += tie
                first = layer if first is None else first
                if stats.kept < KEEP_FLIPS:  # the first flips of each step
                    stats.kept += 1
                    out.flips.append(
                        Flip(step, doc.get("request_id"), j, layer, sorted(a), sorted(b), margin, dlogp)
                    )
        counts = stats.positions.setdefault(j, [0, 0])
        counts[0] += 1
        acc = stats.dlogp_same
        if first is not None:
            stats.differ += 1
            counts[1] += 1
            stats.first_layers[first] = stats.first_layers.get(first, 0) + 1
            acc = stats.dlogp_differ
        if math.isfinite(dlogp):
            if not acc:
                acc += [0.0, 0]
            acc[0] += dlogp
            acc[1] += 1


def _gap(rollout: list[Any], train: list[Any], j: int) -> float:
    try:
        return abs(float(train[j]) - float(rollout[j]))
    except (IndexError, TypeError, ValueError):
        return math.nan
