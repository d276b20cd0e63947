"""A host whose wall clock steps, for the clock tests: in a process started with this folder on its
PYTHONPATH and FLEET_TEST_CLOCK_FILE=path, time.time() is shifted by the seconds written in that
file (read at most every 0.2 s), as ntpd or a VM resume would step it; time.monotonic() is left
alone, as on a real host."""

import os
import time

_path = os.environ.get("FLEET_TEST_CLOCK_FILE")
if _path:
    _wall, _mono = time.time, time.monotonic
    _state = {"read": -1.0, "shift": 0.0}

    def _stepped() -> float:
        now = _mono()
        if now - _state["read"] > 0.2:
            _state["read"] = now
            try:
                with open(_path) as f:
                    _state["shift"] = float(f.read().strip() or 0)
            except (OSError, ValueError):
                pass
        return _wall() + _state["shift"]

    time.time = _stepped
