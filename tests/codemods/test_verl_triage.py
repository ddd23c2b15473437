"""What the verl-triage codemods log, beyond the properties every codemod passes on its fixtures
(`fixtures/codemods/verl-triage-*/`, run in tests/codemods/test_every_codemod.py)."""

from __future__ import annotations

from rl_msprobe.codemods.verl_triage import (
    VerlTriageRayTrainer,
    VerlTriageSeparateTrainer,
    VerlTriageV1Trainer,
    measured_batch,
)
from tests.support.codemod_cases import pairs

CODEMODS = {
    "ray_fit": VerlTriageRayTrainer(),
    "v1_base": VerlTriageV1Trainer(),
    "separate": VerlTriageSeparateTrainer(),
}


def codemod_for(path):
    return CODEMODS[path.name.split(".")[0].rsplit("_", 1)[0]]


def test_the_batch_verl_measured_is_the_one_logged():
    (before, after) = next(
        p
        for p in (p for c in CODEMODS.values() for p in pairs(c.fixture_folder))
        if p[0].name.startswith("v1_base")
    )
    added = [line.strip() for line in after.read_text().splitlines() if "rl-msprobe:" in line]
    # the TransferQueue trainer measures a padded copy (`data`); its KVBatchMeta `batch` goes along
    assert added[-1].startswith("rl_msprobe_triage.log_requests(data, self, batch)")


def test_only_the_measuring_statement_matches():
    import libcst as cst

    def stmt(code):
        return cst.parse_module(code).body[0]

    assert measured_batch(stmt("metrics.update(calculate_debug_metrics(batch))\n")) == "batch"
    assert measured_batch(stmt("self.metrics.update(calculate_debug_metrics(data))\n")) == "data"
    assert measured_batch(stmt("metrics.update(calculate_debug_metrics(batch, 1))\n")) is None
    assert measured_batch(stmt("x = calculate_debug_metrics(batch)\n")) is None
    assert measured_batch(stmt("metrics.update(other(batch))\n")) is None
