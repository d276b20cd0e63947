"""Fault injection for the worker's fault tests, in a process started with this folder on its
PYTHONPATH. The model itself is real and untouched; the embedding lookup fails as a GPU would:

- FLEET_INJECT_OOM_ABOVE=N: every lookup over N tokens raises CUDA's out-of-memory error;
- FLEET_INJECT_OOM_WHILE=PATH: with FLEET_INJECT_OOM_ABOVE, only while PATH exists (memory that
  another process held until the test removes PATH);
- FLEET_INJECT_OOM_TIMES=N: the first N lookups of the process raise it (memory that was short
  for a moment);
- FLEET_INJECT_ERROR_TOKEN=T: every lookup holding token id T raises a RuntimeError (a sample
  that trips a kernel bug, a bad shape, anything a single sample can cause);
- FLEET_INJECT_ABORT_TOKEN=T: a lookup holding token id T kills the process with SIGABRT, as a
  CUDA device-side assert does (nothing to catch);
- FLEET_INJECT_CUDA_ASSERT_TOKEN=T: a lookup holding token id T indexes out of bounds on the
  device: a real device-side assert on a GPU (reported asynchronously, later);
- FLEET_INJECT_DEAD_GPU=G: in the process whose CUDA_VISIBLE_DEVICES is G (the shard fleet put
  on GPU G), every lookup raises a sticky CUDA error, as a card that fell off the bus does;
- FLEET_INJECT_SLOW_GPU=G:S: in that process every lookup first sleeps S seconds (a throttled or
  older card).
"""

import os

_VARS = ("FLEET_INJECT_OOM_ABOVE", "FLEET_INJECT_OOM_TIMES", "FLEET_INJECT_ERROR_TOKEN",
         "FLEET_INJECT_ABORT_TOKEN", "FLEET_INJECT_CUDA_ASSERT_TOKEN", "FLEET_INJECT_DEAD_GPU",
         "FLEET_INJECT_SLOW_GPU")

if any(os.environ.get(v) for v in _VARS):
    import torch
    import torch.nn.functional as F

    _limit = int(os.environ.get("FLEET_INJECT_OOM_ABOVE") or 0)
    _while = os.environ.get("FLEET_INJECT_OOM_WHILE")
    _times = [int(os.environ.get("FLEET_INJECT_OOM_TIMES") or 0)]
    _token = int(os.environ.get("FLEET_INJECT_ERROR_TOKEN") or -1)
    _abort = int(os.environ.get("FLEET_INJECT_ABORT_TOKEN") or -1)
    _assert = int(os.environ.get("FLEET_INJECT_CUDA_ASSERT_TOKEN") or -1)
    _dead = os.environ.get("FLEET_INJECT_DEAD_GPU") not in (None, "") and \
        os.environ.get("FLEET_INJECT_DEAD_GPU") == os.environ.get("CUDA_VISIBLE_DEVICES")
    _slow_gpu, _, _slow_s = (os.environ.get("FLEET_INJECT_SLOW_GPU") or "").partition(":")
    _slow = float(_slow_s) if _slow_gpu and _slow_gpu == os.environ.get("CUDA_VISIBLE_DEVICES") else 0.0
    _embedding = F.embedding

    def embedding(input, weight, *args, **kwargs):
        if _slow:
            import time
            time.sleep(_slow)
        if _dead:
            raise RuntimeError("CUDA error: unspecified launch failure (injected: this GPU is dead)")
        if _limit and input.numel() > _limit and (not _while or os.path.exists(_while)):
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected above {_limit} tokens)")
        if _times[0] > 0:
            _times[0] -= 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected, passing)")
        if _token >= 0 and bool((input == _token).any()):
            raise RuntimeError(f"injected failure on token {_token}\nsecond line")
        if _abort >= 0 and bool((input == _abort).any()):
            os.abort()
        out = _embedding(input, weight, *args, **kwargs)
        if _assert >= 0:                 # no sync here: the index is checked on the device
            hit = (input == _assert).any().long() * (weight.shape[0] + 5)
            out = out + weight[hit.reshape(1)].sum() * 0
        return out

    F.embedding = embedding
