"""A fit belongs to the machine it was measured on: the calibration record names its CPU, and the online check
refits in its own session where this machine's CPU differs from the record's (and says so)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from pagedbench.bench.costmodel.batched_cost import BATCHED_TERMS, BatchedStepCost
from pagedbench.bench.costmodel.calibration import CalibrationMachine, choose_fit, cpu_model_name, this_machine
from pagedbench.bench.studies.calibrate.config import CONFIG, load_config
from pagedbench.bench.studies.calibrate.online import fit_for_check
from pagedbench.bench.studies.calibrate.online_report import _fit_used_line

XEON = CalibrationMachine("Intel(R) Xeon(R) Processor", 2)
EPYC = CalibrationMachine("AMD EPYC 7B13", 2)


def test_this_machine_names_its_cpu_and_cores():
    here = this_machine()
    assert here.cpu_model == cpu_model_name() and here.cpu_model
    assert here.cpu_count is not None and here.cpu_count >= 1
    assert CalibrationMachine.from_record({"calibration": {"machine": here.to_record()}}) == here


def test_a_record_names_its_machine_in_the_calibration_else_in_its_environment():
    env = {"environment": {"machine": {"cpu": XEON.cpu_model, "cpu_count": 2}}}
    assert CalibrationMachine.from_record(env) == XEON  # a record from before the calibration kept it
    both = {**env, "calibration": {"machine": EPYC.to_record()}}
    assert CalibrationMachine.from_record(both) == EPYC  # the calibration's own wins
    assert CalibrationMachine.from_record({"calibration": {}}) is None
    assert CalibrationMachine.from_record(None) is None


@pytest.mark.parametrize(("published", "here", "refit", "says"), [
    (XEON, XEON, False, "measured on this CPU ('Intel(R) Xeon(R) Processor', 2 cores)"),
    (XEON, EPYC, True, "measured on 'Intel(R) Xeon(R) Processor', this machine is 'AMD EPYC 7B13'"),
    (XEON, dataclasses.replace(XEON, cpu_count=8), True, "measured with 2 cores, this machine has 8"),
    (None, XEON, True, "names no CPU"),
])
def test_choose_fit_refits_on_another_cpu_or_core_count(published, here, refit, says):
    choice = choose_fit(published, here)
    assert choice.refit is refit and says in choice.reason
    assert choice.to_record()["this_machine"] == here.to_record()


def _cost(label: str) -> BatchedStepCost:
    return BatchedStepCost(label, **{t: 1e-4 * (i + 1) for i, t in enumerate(BATCHED_TERMS)})


def _record(tmp_path, spec, machine: CalibrationMachine):
    published = _cost("published")
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({
        "config": {"engine": dataclasses.asdict(spec)},
        "calibration": {"label": published.label, "machine": machine.to_record(),
                        "coefficients": {t: getattr(published, t) for t in BATCHED_TERMS}}}))
    return path


class _Refit:
    """A stand-in for measuring the grid here: counts its calls, returns its own fit."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return _cost("refit here"), "wake measured here", "after-prefill measured here"


def test_a_record_of_another_cpu_is_refitted_before_the_check(tmp_path):
    spec = load_config(CONFIG, quick=True).engine
    refit = _Refit()
    cost, wake, after, choice = fit_for_check(_record(tmp_path, spec, XEON), spec, refit, here=EPYC)
    assert (wake, after) == ("wake measured here", "after-prefill measured here")  # not the record's
    assert refit.calls == 1 and cost.label == "refit here" and choice.refit
    assert "'AMD EPYC 7B13'" in choice.reason
    line = "\n".join(_fit_used_line({"fit_used": {"source": "refit in this session", **choice.to_record()}}))
    assert "refitted in this session" in line and "'Intel(R) Xeon(R) Processor'" in line


def test_a_record_of_this_cpu_is_checked_as_published(tmp_path):
    spec = load_config(CONFIG, quick=True).engine
    refit = _Refit()
    cost, _, _, choice = fit_for_check(_record(tmp_path, spec, XEON), spec, refit, here=XEON)
    assert refit.calls == 0 and cost.label == "published" and not choice.refit
    assert cost == _cost("published")
    # by default "here" is this machine: a record measured on it is used as it is
    cost, _, _, choice = fit_for_check(_record(tmp_path, spec, this_machine()), spec, refit)
    assert refit.calls == 0 and not choice.refit
    line = "\n".join(_fit_used_line({"fit_used": {"source": "published", **choice.to_record()}}))
    assert "the published one" in line
