"""GPU telemetry that never raises: NVML when pynvml is there, `nvidia-smi` otherwise, else none.

Like nvitop's wrapper, a reading that fails becomes None ("not available"), so one lost GPU never
takes the agent down.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any, Callable

from .protocol import GpuStat


def _na(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:
        return None


class GpuReader:
    def __init__(self) -> None:
        self.source = "none"
        self.error: str | None = None
        self._nvml = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = pynvml
            self.source = "nvml"
        except Exception as e:                       # no library, no driver, no GPU
            self.error = f"NVML unavailable: {type(e).__name__}"
            if shutil.which("nvidia-smi"):
                self.source = "nvidia-smi"

    def read(self) -> list[GpuStat]:
        if self.source == "nvml":
            return self._read_nvml()
        if self.source == "nvidia-smi":
            return self._read_smi()
        return []

    def _read_nvml(self) -> list[GpuStat]:
        nv = self._nvml
        assert nv is not None, "read() comes here only where __init__ set source 'nvml' with the module"
        gpus = []
        count = _na(nv.nvmlDeviceGetCount) or 0
        for i in range(count):
            h = _na(lambda: nv.nvmlDeviceGetHandleByIndex(i))
            if h is None:
                gpus.append(GpuStat(index=i, lost=True))
                continue
            mem = _na(lambda: nv.nvmlDeviceGetMemoryInfo(h))
            util = _na(lambda: nv.nvmlDeviceGetUtilizationRates(h))
            power = _na(lambda: nv.nvmlDeviceGetPowerUsage(h))
            limit = _na(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h))
            name = _na(lambda: nv.nvmlDeviceGetName(h))
            uuid = _na(lambda: nv.nvmlDeviceGetUUID(h))
            gpus.append(GpuStat(
                index=i,
                name=name.decode() if isinstance(name, bytes) else name,
                uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                mem_used=getattr(mem, "used", None), mem_total=getattr(mem, "total", None),
                util=getattr(util, "gpu", None),
                temp=_na(lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                power_w=None if power is None else round(power / 1000, 1),
                power_limit_w=None if limit is None else round(limit / 1000, 1),
            ))
        return gpus

    def _read_smi(self) -> list[GpuStat]:
        fields = ("index,name,uuid,memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw,"
                  "power.limit")
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout
        except Exception:
            return []

        def num(x: str) -> float | None:
            try:
                return float(x)
            except ValueError:
                return None
        gpus = []
        for line in out.strip().splitlines():
            p = [x.strip() for x in line.split(",")]
            if len(p) < 8:
                continue
            used, total = num(p[3]), num(p[4])
            gpus.append(GpuStat(index=int(p[0]), name=p[1], uuid=p[2],
                                mem_used=None if used is None else int(used * 2**20),
                                mem_total=None if total is None else int(total * 2**20),
                                util=num(p[5]), temp=num(p[6]), power_w=num(p[7]),
                                power_limit_w=num(p[8]) if len(p) > 8 else None))
        return gpus
