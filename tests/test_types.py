"""mypy over fleet/ and worker/ passes (issue 54), with the packages they import installed (torch,
transformers, textual, pydantic, asyncssh ship their own types; types-PyYAML and pyarrow-stubs
bring PyYAML's and pyarrow's). What is checked, and the few modules left untyped, is mypy.ini's."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(600)
def test_mypy_passes_over_fleet_and_worker():
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mypy found errors:\n{done.stdout}{done.stderr}"
