"""The demo's assets: a demo model made before the chat template had a generation prompt gets the
current one, and a current one is found current from its files alone (no transformers import:
2.5 s of every `fleet up` of the demo)."""

from __future__ import annotations

import shutil
import subprocess
import sys

from tests.conftest import REPO
from worker.demo import CHAT_TEMPLATE, saved_template, update_chat_template


def test_an_old_chat_template_is_brought_up_to_date_and_a_current_one_left_alone(tmp_path, dense_model):
    model = tmp_path / "model"
    shutil.copytree(dense_model, model)
    assert saved_template(str(model)) == CHAT_TEMPLATE
    old = CHAT_TEMPLATE.split("{% if add_generation_prompt %}")[0]
    (model / "chat_template.jinja").write_text(old)
    assert saved_template(str(model)) == old
    update_chat_template(str(model))
    assert saved_template(str(model)) == CHAT_TEMPLATE
    # Current: `python -m worker.demo` on existing assets imports no transformers.
    data = tmp_path / "chat.jsonl"
    data.write_text('{"conversations": []}\n')
    probe = ("import runpy, sys; sys.argv = ['demo', '--model', sys.argv[1], '--data', sys.argv[2]];"
             "runpy.run_module('worker.demo', run_name='__main__');"
             "print('transformers' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe, str(model), str(data)], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "False", r.stdout + r.stderr
