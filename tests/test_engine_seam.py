"""The engine seam holds: the modules every engine shares name no engine, and import none of the
engine packages' own modules (issue 54). An engine's words live in its own module under
fleet/engine/ and worker/engine/, translated into neutral ones where they enter."""

from __future__ import annotations

import ast
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ["fleet/store.py", "fleet/record.py", "fleet/judge.py", "fleet/hosts.py", "fleet/snapshot.py",
        "fleet/schema.py", "fleet/state.py", "fleet/supervisor.py", "worker/agent.py", "worker/hostctl.py",
        "worker/launches.py", "worker/protocol/__init__.py", "worker/protocol/layout.py",
        "worker/protocol/records.py", "worker/protocol/events.py", "worker/protocol/jsonl.py",
        "worker/protocol/messages.py", "worker/protocol/actions.py", "worker/protocol/replies.py"]
# An engine's name, or a command only one engine has.
ENGINE_WORDS = re.compile(r"\b(slurm|ray|sbatch|squeue|scancel|sacct|kuberay)\b", re.IGNORECASE)


@pytest.mark.parametrize("path", CORE)
def test_a_core_module_names_no_engine(path):
    with open(os.path.join(REPO, path)) as f:
        lines = f.read().splitlines()
    named = [f"{path}:{n}: {line.strip()}" for n, line in enumerate(lines, 1) if ENGINE_WORDS.search(line)]
    assert not named, "\n".join(named)


@pytest.mark.parametrize("path", CORE)
def test_a_core_module_imports_no_engines_own_module(path):
    """Only the registries (fleet.engine, worker.engine) may be imported, never one engine's module."""
    with open(os.path.join(REPO, path)) as f:
        tree = ast.parse(f.read())
    own = []
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [f"{'.' * node.level}{node.module or ''}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else []
        own += [n for n in names if re.search(r"engine\.(?!tasks\b|base\b|load\b|Launcher\b|make_launcher\b)\w+", n)]
    assert not own, own


def test_the_check_sees_an_engine_named():
    """The word check is not vacuous: it finds the names it is meant to."""
    assert ENGINE_WORDS.search("squeue -h") and ENGINE_WORDS.search("Ray's actors") and \
        not ENGINE_WORDS.search("an array of tasks, a tray")


def test_the_ends_an_engine_is_blamed_for_are_one_set_on_both_sides():
    """The agent records an engine's final word after the task's own end only for these; the
    record gives each its words: the two must be the same set."""
    from fleet.record import ENGINE_ENDS
    from worker import protocol
    assert set(ENGINE_ENDS) == protocol.ENGINE_ENDED and protocol.ENGINE_ENDED < set(protocol.TASK_ENDS)
