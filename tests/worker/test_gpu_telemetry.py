"""GPU telemetry as a GPU host reads it, without a GPU: a stand-in `pynvml` (the NVML calls
worker/gpu.py makes, two GPUs, the second lost) on the PYTHONPATH of the real preflight and the
real agent. What they report is compared with what the stand-in says, through fleet's own reader
of the agent's lines (the typed GpuStat readings, end to end)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO
from worker import protocol
from worker.text import printable_data

FAKE_NVML = '''
import os
NVML_TEMPERATURE_GPU = 0
TOTAL = int(os.environ.get("FAKE_GPU_BYTES", 80 * 10**9))


class _Memory:
    used, total = 5 * 2**30, TOTAL


class _Rates:
    gpu = 37


def nvmlInit():
    pass


def nvmlDeviceGetCount():
    return 2


def nvmlDeviceGetHandleByIndex(i):
    if i == 1:
        raise RuntimeError("GPU is lost")
    return i


def nvmlDeviceGetMemoryInfo(h):
    return _Memory()


def nvmlDeviceGetUtilizationRates(h):
    return _Rates()


def nvmlDeviceGetPowerUsage(h):
    return 412_300


def nvmlDeviceGetEnforcedPowerLimit(h):
    return 700_000


def nvmlDeviceGetName(h):
    return b"NVIDIA Stand-in"


def nvmlDeviceGetUUID(h):
    return f"GPU-stand-in-{h}"


def nvmlDeviceGetTemperature(h, kind):
    return 61
'''


def nvml_env(tmp_path, **extra: str) -> dict:
    (tmp_path / "nvml").mkdir(exist_ok=True)
    (tmp_path / "nvml" / "pynvml.py").write_text(FAKE_NVML)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "nvml"), REPO]), **extra}


def test_preflight_reads_the_gpus_and_judges_the_fit_by_their_memory(tmp_path, dense_model):
    weights = sum(os.path.getsize(os.path.join(dense_model, f)) for f in os.listdir(dense_model)
                  if f.endswith(".safetensors"))

    def preflight(total: int) -> protocol.PreflightReport:
        r = subprocess.run([sys.executable, "-m", "worker.preflight", "--builtin", "--model", dense_model,
                            "--gpus", "0", "--max-tokens-per-batch", "16"], cwd=REPO, capture_output=True,
                           text=True, timeout=300, env=nvml_env(tmp_path, FAKE_GPU_BYTES=str(total)))
        assert r.returncode == 0, r.stderr
        return protocol.PreflightReport.from_dict(json.loads(r.stdout.strip().splitlines()[-1]))
    roomy = preflight(80 * 10**9)
    assert (roomy.telemetry, roomy.gpu_count, roomy.gpus) == ("nvml", 2, [0])
    assert roomy.gpu_uuids == ["GPU-stand-in-0"]
    assert not [e for e in roomy.errors if "GPU(s)" in e], roomy.errors
    small = preflight(weights // 2)                       # half the weights: the shard cannot fit
    assert any("of weights over 1 GPU(s)" in e for e in small.errors), small.errors


def test_the_agents_gpu_reading_reaches_fleet_as_the_driver_said(tmp_path):
    from fleet.hosts import Host
    from fleet.schema import Gpu
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    r = subprocess.run([sys.executable, "-m", "worker.agent", "--run-dir", str(run_dir), "--shards", "0", "--once"],
                       cwd=REPO, capture_output=True, text=True, timeout=120, env=nvml_env(tmp_path))
    assert r.returncode == 0, r.stderr
    readings = [m for m in (protocol.parse_message(line, printable_data) for line in r.stdout.splitlines())
                if isinstance(m, protocol.GpuReading)]
    assert len(readings) == 1, r.stdout
    host = Host("h", "h")
    host.read_gpus(readings[0])
    assert host.telemetry == "nvml"
    assert host.gpus == [Gpu(index=0, name="NVIDIA Stand-in", uuid="GPU-stand-in-0", mem_used=5 * 2**30,
                             mem_total=80 * 10**9, util=37, temp=61, power_w=412.3, power_limit_w=700.0),
                         Gpu(index=1, lost=True)]
