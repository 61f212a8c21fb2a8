"""The CI regression test of docs/inspecting.md: a planned peak checked against a saved profile.

A saved profile makes planning deterministic (no timing noise): commit one made on the target
machine (``fxpooch plan ... --save-profile tests/data/<model>.profile.json`` or
``plan.profile.save(...)``) and assert on the plan it gives. Here the profile is saved to a
temporary folder first so the example runs anywhere.
"""
from __future__ import annotations

import zoo

import fxpooch

LIMIT = 12 * 2**20  # bytes; the in-core peak of resnet_small is about 17 MiB


def test_planned_peak_stays_under_the_limit(tmp_path):
    model, x = zoo.resnet_small()
    first = fxpooch.plan(model, x, LIMIT, profile="analytic", hardware="v100-pcie3")
    path = tmp_path / "resnet_small.profile.json"
    first.profile.save(path)  # in a real project: committed under tests/data/

    profile = fxpooch.Profile.load(path)
    plan = fxpooch.plan(model, x, LIMIT, profile=profile)

    assert plan.peak_bytes <= LIMIT
    assert plan.profile == first.profile  # the JSON round trip is exact
    assert plan.decisions == first.decisions
    assert (plan.peak_bytes, plan.step_time) == (first.peak_bytes, first.step_time)
    assert plan == first  # every field: graph, schedule, timeline, profile
