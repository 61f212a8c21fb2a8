"""Link calibration: the latency/bandwidth fit of timed copies and its place in a saved profile."""
from __future__ import annotations

import json
import random

import pytest
import torch

import fxpooch
from fxpooch.hardware import Link, LinkCalibration, fit_link
from zoo import ZOO

SIZES = (1 << 16, 1 << 20, 1 << 23, 1 << 26)


def copies(latency: float, bandwidth: float, noise: float = 0.0, seed: int = 0) -> tuple[float, ...]:
    rng = random.Random(seed)
    return tuple((latency + n / bandwidth) * (1 + rng.uniform(-noise, noise)) for n in SIZES)


@pytest.mark.parametrize("latency, bandwidth", [(10e-6, 25e9), (2e-6, 50e9), (0.0, 12e9), (30e-6, 400e9)])
def test_fit_recovers_latency_and_bandwidth(latency, bandwidth):
    lat, bw = fit_link(SIZES, copies(latency, bandwidth))
    assert bw == pytest.approx(bandwidth, rel=1e-9)
    assert lat == pytest.approx(latency, abs=1e-12)


def test_fit_with_noise_stays_close_and_never_gives_negative_latency():
    lat, bw = fit_link(SIZES, copies(1e-6, 20e9, noise=0.03, seed=3))
    assert bw == pytest.approx(20e9, rel=0.05)
    assert lat >= 0.0


@pytest.mark.parametrize("sizes, seconds, match", [
    ((1 << 20, 1 << 20), (1e-4, 1e-4), "two distinct sizes"),
    ((1 << 16, 1 << 26), (1e-3, 1e-4), "do not grow"),
    ((1 << 16, 1 << 26), (1e-3,), "2 sizes but 1"),
    ((1 << 16, 1 << 26), (1e-3, float("nan")), "finite"),
])
def test_fit_rejects_samples_without_a_bandwidth(sizes, seconds, match):
    with pytest.raises(ValueError, match=match):
        fit_link(sizes, seconds)


def calibration() -> LinkCalibration:
    return LinkCalibration("gpu", SIZES, d2h=copies(5e-6, 24e9), h2d=copies(5e-6, 26e9),
                           d2h_concurrent=copies(6e-6, 20e9), h2d_concurrent=copies(8e-6, 22e9))


def test_calibrated_link_times_each_direction_next_to_compute():
    link = Link.calibrated("measured:gpu", calibration())
    assert link.bandwidth == pytest.approx(20e9) and link.latency == pytest.approx(8e-6)
    assert link.directed("d2h").transfer_time(10**9) == pytest.approx(6e-6 + 0.05)
    assert link.directed("h2d").transfer_time(10**9) == pytest.approx(8e-6 + 10**9 / 22e9)
    alone = calibration().fit("h2d", concurrent=False)
    assert alone.bandwidth == pytest.approx(26e9)
    plain = Link("p", 1e9, 0.0)
    assert plain.directed("d2h") is plain


def test_calibration_is_saved_in_the_profile_and_old_profiles_still_load(tmp_path):
    model, x = ZOO["mlp"]()
    link = Link.calibrated("measured:gpu", calibration())
    cm = fxpooch.compile(model, x, "1TiB", planner="swap-all", profile="analytic", hardware="cpu", link=link)
    profile = cm.plan.profile
    assert profile.link == link
    costs = profile.costs(cm.plan.graph)
    assert any(costs.d2h_time) and all(d > h for d, h in zip(costs.d2h_time, costs.h2d_time) if d)  # d2h is slower
    path = tmp_path / "p.json"
    profile.save(path)
    assert json.loads(path.read_text())["link"]["calibration"]["sizes"] == list(SIZES)
    assert fxpooch.Profile.load(path) == profile
    old = json.loads(path.read_text())
    old["link"] = {"name": "pcie3", "bandwidth": 12e9, "latency": 1e-5}  # a profile saved before calibrations
    path.write_text(json.dumps(old))
    assert fxpooch.Profile.load(path).link == Link("pcie3", 12e9, 1e-5)


def test_a_calibrated_host_link_keeps_its_copies_on_the_compute_stream(tmp_path):
    cal = LinkCalibration("cpu", SIZES, copies(0.0, 10e9), copies(0.0, 5e9), copies(0.0, 10e9), copies(0.0, 5e9))
    link = Link.calibrated("measured:cpu", cal, on_compute_stream=True)
    for direction in ("d2h", "h2d"):
        assert link.directed(direction).on_compute_stream
    assert link.directed("h2d").transfer_time(10**9) == pytest.approx(0.2)
    assert Link.from_json(json.loads(json.dumps(link.to_json()))) == link


def test_host_copies_that_do_not_grow_with_size_fall_back_to_the_host_preset(caplog):
    """On a busy host every copy can wait a time slice whatever its size: no line fits, and the
    link is the preset's, said in a warning, instead of an error that stops compile."""
    from fxpooch.calibrate import host_link
    from fxpooch.hardware import LinkCalibration, get_link

    sizes = (1 << 16, 1 << 20, 1 << 22, 1 << 24)
    flat = (0.012, 0.012, 0.012, 0.011)  # as measured at load 6 (the largest copy got the luckiest slice)
    with caplog.at_level("WARNING", logger="fxpooch.profile"):
        link = host_link(LinkCalibration("cpu", sizes, flat, flat, flat, flat))
    assert link == get_link("host") and link.on_compute_stream
    assert "could not be fitted" in caplog.text
    growing = tuple(1e-5 + n / 5e9 for n in sizes)
    fitted = host_link(LinkCalibration("cpu", sizes, growing, growing, growing, growing))
    assert fitted.name == "measured:cpu" and fitted.on_compute_stream
    assert fitted.bandwidth == pytest.approx(5e9) and fitted.latency == pytest.approx(1e-5)


def test_measured_host_link_times_the_copies_a_cpu_run_makes():
    from fxpooch.calibrate import HOST_LINK_SIZES, measure_host_link
    from fxpooch.timing import ProfileOptions

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the thread clock times one intra-op thread (a copy split over more spins here)
    try:
        link = measure_host_link(options=ProfileOptions(clock="thread"))
        assert link.on_compute_stream and link.name == "measured:cpu"
        assert link.calibration is not None and link.calibration.sizes == HOST_LINK_SIZES
        assert link.bandwidth > 0 and link.latency >= 0
        assert measure_host_link(options=ProfileOptions(clock="thread")) is link  # once per process and clock
        # a CPU step compiled with a measured profile swaps over it: its copies add to the step
        model, x = ZOO["mlp"]()
        cm = fxpooch.compile(model, x, "1TiB", planner="swap-all", profile="measure")
    finally:
        torch.set_num_threads(previous)
    assert cm.plan.profile.link.on_compute_stream and cm.plan.profile.link.name == "measured:cpu"
    assert cm.plan.profile.costs(cm.plan.graph).serial_copies
