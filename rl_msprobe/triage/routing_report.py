"""The MoE routing section of `mismatch report` (markdown, HTML, --json) and its proposal line.

Fed by `rl_msprobe.triage.routing.read_routing`; absent when the triage folder has no routing
records (a dense model, or a run without the verl-routing set).
"""

from __future__ import annotations

from typing import Any

from rl_msprobe.triage.report import Section, fmt
from rl_msprobe.triage.routing import POSITION_BUCKETS, Routing, StepRouting

REPLAY_KEYS = (
    "actor_rollout_ref.rollout.enable_rollout_routing_replay=True with "
    "actor_rollout_ref.actor.<megatron|veomni>.router_replay.mode=R3 (verl's FSDP engine has no router replay)"
)


def _pct(x: float) -> str:
    return fmt(100.0 * x, 3) + "%" if x == x else "–"


def verdict(routing: Routing) -> str | None:
    """One sentence naming the layer and replay when routing differs; None when it agrees."""
    steps = [s for s in routing.step_list() if s.differ]
    if not steps:
        return None
    worst = max(steps, key=lambda s: s.share())
    layer = worst.cause_layer()
    names = routing.layer_names.get("train") or routing.layer_names.get("rollout") or []
    name = f" ({names[layer]})" if layer is not None and layer < len(names) else ""
    ls = worst.layers.get(layer) if layer is not None else None
    state = routing.replay_state()
    fix = (
        "routing replay is on but did not hold: the trainer did not use the rollout's experts"
        if state.startswith("on")
        else f"routing replay is off; to take routing out of the gap turn it on ({REPLAY_KEYS})"
    )
    others = [f"step {s.step}: from layer {s.cause_layer()}" for s in steps if s is not worst]
    also = f" (also {', '.join(others[:5])}{' …' if len(others) > 5 else ''})" if others else ""
    return (
        f"MoE routing differs from layer {layer}{name} at step {worst.step}{also}: "
        f"{_pct(ls.share() if ls else float('nan'))} of its tokens flipped "
        f"({ls.differ - ls.differ_near_tie if ls else 0} beyond near-ties), "
        f"{_pct(worst.share())} of tokens routed differently in some layer, at response positions "
        f"{_positions(worst)}; {fix}; a consistency dump of layer {layer}'s gate (its input and its router logits) shows where it differs."
    )


def _positions(s: StepRouting, limit: int = 12) -> str:
    flipped = s.flipped_positions()
    shown = ", ".join(map(str, flipped[:limit]))
    return shown + (f" … ({len(flipped)} in all)" if len(flipped) > limit else "")


def sections(routing: Routing, image: str | None = None) -> list[Section]:
    text = [
        f"{routing.requests} request(s) with both sides' router decisions ({len(routing.files)} file(s); "
        f"top-k {routing.top_k}); unmatched: {routing.unmatched['rollout']} without rollout rows, "
        f"{routing.unmatched['train']} without training rows.",
        "A response token's routing is that of the row predicting it (prompt length + position − 1), on "
        "both sides. A flip: the layer's top-k expert SET differs; a near-tie: the smaller margin between "
        f"the k-th and (k+1)-th router logit is below {fmt(routing.near_tie)}.",
        f"Routing replay: {routing.replay_state()} (trainer: {routing.replay.get('train', {})}; "
        f"rollout: {routing.replay.get('rollout', {})}).",
    ]
    found = verdict(routing)
    text.append(found or "Routing agrees: every compared token has the same experts in every layer.")
    text += [f"error line: {e}" for e in routing.errors]
    rows = []
    for s in routing.step_list():
        for layer, ls in sorted(s.layers.items()):
            rows.append(
                [
                    fmt(s.step),
                    str(layer),
                    str(ls.compared),
                    str(ls.differ),
                    _pct(ls.share()),
                    str(ls.differ_near_tie),
                    str(ls.near_tie),
                    str(s.first_layers.get(layer, 0)),
                ]
            )
    out = [
        Section(
            "MoE routing",
            text,
            (
                [
                    "step",
                    "layer",
                    "tokens",
                    "flipped",
                    "share",
                    "flipped near-ties",
                    "near-ties",
                    "first layer of",
                ],
                rows,
            ),
        )
    ]
    step_rows = [
        [
            fmt(s.step),
            str(s.tokens),
            _pct(1.0 - s.share()) if s.tokens else "–",
            fmt(s.mean_dlogp(True)),
            fmt(s.mean_dlogp(False)),
            _positions(s) or "–",
        ]
        for s in routing.step_list()
    ]
    out.append(
        Section(
            "MoE routing by step and position",
            ["Mean |Δ log p| of the tokens routed differently (some layer) against those routed alike."],
            (
                [
                    "step",
                    "tokens",
                    "agreement",
                    "mean |Δ log p| flipped",
                    "mean |Δ log p| alike",
                    "flipped positions",
                ],
                step_rows,
            ),
            image,
        )
    )
    flips = [
        [
            fmt(f.step),
            str(f.request_id or "–"),
            str(f.position),
            str(f.layer),
            str(f.rollout),
            str(f.train),
            fmt(f.margin),
            fmt(f.dlogp),
        ]
        for f in routing.flips[:FLIP_ROWS]
    ]
    if flips:
        out.append(
            Section(
                "MoE routing flips",
                [
                    f"The first {len(flips)} of {len(routing.flips)} kept (`--json`: all kept, up to 50 a step)."
                ],
                (
                    [
                        "step",
                        "request id",
                        "position",
                        "layer",
                        "rollout experts",
                        "trainer experts",
                        "margin",
                        "|Δ log p|",
                    ],
                    flips,
                ),
            )
        )
    return out


FLIP_ROWS = 12


def plot(routing: Routing, plt: Any) -> bytes | None:
    """Routing disagreement by response position, one line per step (None: nothing compared)."""
    steps = [s for s in routing.step_list() if s.tokens]
    if not steps:
        return None
    import io

    fig, ax = plt.subplots(figsize=(10, 3.2))
    for s in steps:
        xs = sorted(s.positions)
        ax.plot(xs, [s.positions[p][1] / s.positions[p][0] for p in xs], marker=".", label=f"step {s.step}")
    ax.set_xlabel("response position")
    ax.set_ylabel("share routed differently")
    ax.legend()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def parts(routing: Routing, pngs: dict[str, bytes]) -> list[Section]:
    """The routing sections, with the plot added to PNGS when matplotlib is there."""
    from rl_msprobe.reporting.plot import pyplot

    plt, _why = pyplot()
    data = plot(routing, plt) if plt is not None else None
    if data is not None:
        pngs[PLOT] = data
    return sections(routing, PLOT if data is not None else None)


PLOT = "routing_by_position.png"
__all__ = ["POSITION_BUCKETS", "parts", "plot", "sections", "verdict"]
