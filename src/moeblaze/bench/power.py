"""Energy and SM clock of the GPU over a stretch of steps, from NVML (``pynvml``, the ``nvidia-ml-py`` package).

Why: a training step at tens of thousands of tokens keeps an H200 at its 700 W power limit, where the SM clock
follows the energy of whatever runs (1,515-1,950 MHz while a transformers Qwen3-MoE trained; 1,380-1,470
MHz with one GEMM replayed for seconds). There two implementations of equal kernel time at equal clocks can differ in
step time, and the energy per step says which of them spends more (docs/benchmarks.md, "Method": the
power limit). NVML's total energy counter (millijoules since the driver loaded) gives the joules of a stretch; a
thread reads the SM clock every ``interval_s`` meanwhile. Read-only: nothing of the card's settings is changed.

Used by ``benchmarks/bench_hf.py --energy`` (joules per step) and ``benchmarks/profile_layer.py --energy N``.
The sampling thread takes the GIL from the thread that queues the GPU's work: at the default interval it
lengthened the transformers Qwen3-MoE step of ``bench_hf.py`` from 277.1 to 283.8 ms for SonicMoE and moeblaze
alike (H200; ``--energy`` against without, one run), so a benchmark whose figure is step time
leaves it off.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
import warnings
from dataclasses import dataclass
from types import ModuleType

__all__ = ["EnergyMeter", "EnergyReading", "nvml"]


def nvml() -> ModuleType | None:
    """``pynvml``, initialised, or None where it is not installed, finds no driver (a CPU machine) or cannot read
    the first GPU's energy counter (GPUs before Volta have none)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        pynvml.nvmlDeviceGetTotalEnergyConsumption(pynvml.nvmlDeviceGetHandleByIndex(0))
    except Exception:  # pynvml.NVMLError and its subclasses: no driver, no library, not supported
        return None
    return pynvml


@dataclass
class EnergyReading:
    """What :class:`EnergyMeter` measured over one stretch.

    Attributes:
        joules: energy the GPU used (J). seconds: wall time of the stretch (s).
        watts: mean power, ``joules / seconds`` (W). sm_clock_mhz: mean of the SM clock samples (MHz; nan
        without samples). power_limit_w: the enforced power limit (W).
    """

    joules: float
    seconds: float
    watts: float
    sm_clock_mhz: float
    power_limit_w: float


class EnergyMeter:
    """``with meter: ...`` measures the GPU's energy and mean SM clock over the block; ``meter.reading`` then holds
    an :class:`EnergyReading`, or None (with a warning) where NVML failed to answer at the block's end: a benchmark
    loses that reading, not its run. Synchronise the device before entering and before leaving the block, so that
    the block's work and nothing else falls inside it.

    Args:
        device_index: the NVML index of the GPU (the CUDA device index where ``CUDA_VISIBLE_DEVICES`` is unset).
        interval_s: seconds between SM clock samples.

    Raises:
        RuntimeError: NVML is not available (:func:`nvml` returned None); check :meth:`available` first.
    """

    def __init__(self, device_index: int = 0, interval_s: float = 0.05) -> None:
        self._nvml = nvml()
        if self._nvml is None:
            raise RuntimeError("EnergyMeter needs NVML: install nvidia-ml-py on a machine with an NVIDIA driver")
        self._handle = self._nvml.nvmlDeviceGetHandleByIndex(device_index)
        self.interval_s = interval_s
        self.reading: EnergyReading | None = None

    @staticmethod
    def available() -> bool:
        """Whether NVML can be read here."""
        return nvml() is not None

    def _millijoules(self) -> int:
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(Exception):  # a failed read leaves a gap in the samples (nan if none is left)
                self._clocks.append(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM))

    def __enter__(self) -> EnergyMeter:
        self._clocks: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._t0, self._mj0 = time.perf_counter(), self._millijoules()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        seconds = time.perf_counter() - self._t0
        self._stop.set()
        self._thread.join()
        try:
            joules = (self._millijoules() - self._mj0) / 1e3
            limit = self._nvml.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1e3  # milliwatts
        except Exception as e:  # pynvml.NVMLError: the driver did not answer
            warnings.warn(f"EnergyMeter: NVML read failed ({e}); no energy reading for this block", stacklevel=2)
            self.reading = None
            return
        clock = statistics.mean(self._clocks) if self._clocks else float("nan")
        self.reading = EnergyReading(joules, seconds, joules / seconds if seconds > 0 else float("nan"), clock, limit)
