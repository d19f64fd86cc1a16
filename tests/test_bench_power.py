"""``moeblaze.bench.power``: the NVML energy meter of bench_hf.py and profile_layer.py --energy, against a fake
``pynvml`` (the CPU machine has no driver)."""

from __future__ import annotations

import math
import sys
import time
import types

import pytest

from moeblaze.bench import power


def _fake_pynvml(energy_mj: list[int], clock_mhz: int = 1500, limit_mw: int = 700_000, init_error=None):
    """A module with the five pynvml functions the meter uses; the energy counter returns ``energy_mj`` in turn."""
    fake = types.ModuleType("pynvml")
    counter = iter(energy_mj)
    fake.NVML_CLOCK_SM = 1

    def init():
        if init_error is not None:
            raise init_error

    fake.nvmlInit = init
    fake.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    fake.nvmlDeviceGetTotalEnergyConsumption = lambda handle: next(counter)
    fake.nvmlDeviceGetClockInfo = lambda handle, kind: clock_mhz if kind == fake.NVML_CLOCK_SM else -1
    fake.nvmlDeviceGetEnforcedPowerLimit = lambda handle: limit_mw
    return fake


def test_meter_reads_the_energy_counter_and_clock(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([0, 0, 1_000, 4_500]))  # two probes
    assert power.EnergyMeter.available()
    meter = power.EnergyMeter(device_index=0, interval_s=0.005)
    with meter:
        time.sleep(0.05)
    r = meter.reading
    assert r.joules == pytest.approx(3.5) and r.power_limit_w == pytest.approx(700.0)
    assert r.seconds >= 0.05 and r.watts == pytest.approx(r.joules / r.seconds)
    assert r.sm_clock_mhz == pytest.approx(1500.0)


def test_meter_without_clock_samples_says_nan(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([0, 0, 10]))  # one probe
    meter = power.EnergyMeter(interval_s=60.0)  # no sample falls inside the block
    with meter:
        pass
    assert meter.reading.joules == pytest.approx(0.01) and math.isnan(meter.reading.sm_clock_mhz)


def test_no_nvml_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: the import fails
    assert power.nvml() is None and not power.EnergyMeter.available()
    with pytest.raises(RuntimeError, match="nvidia-ml-py"):
        power.EnergyMeter()
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([], init_error=OSError("no driver")))
    assert power.nvml() is None


def test_a_failed_read_costs_the_reading_not_the_run(monkeypatch):
    fake = _fake_pynvml([0, 0, 5])  # two probes and the block's start; the end's read fails

    def fail(handle):
        raise OSError("driver gone")

    monkeypatch.setitem(sys.modules, "pynvml", fake)
    meter = power.EnergyMeter(interval_s=60.0)
    with pytest.warns(UserWarning, match="NVML read failed"), meter:
        fake.nvmlDeviceGetTotalEnergyConsumption = fail
    assert meter.reading is None
