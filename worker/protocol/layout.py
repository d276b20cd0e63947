"""The names both sides give the same things on a host: the protocol's version, the files of a run's
folder and of a shard's, and the variable a shard's process is handed its launch in. One place, so
the supervisor and every host command can never name a file differently, and a new protocol is one
line here (the agent's hello carries it; fleet refuses a host that speaks another)."""

from __future__ import annotations

import os

PROTOCOL_VERSION = 4

# --- a shard's folder (<run dir>/shards/<k>/) and the output's ---------------------------------
EVENTS_FILE = "events.jsonl"
REPLAY_RECENT_S = 120.0      # an agent's replay keeps every progress event this recent (older: thinned)
LOG_FILE = "log"
PID_FILE = "pid"
LOCK_FILE = "lock"
GPUS_FILE = "gpus.json"      # an engine task's latest reading of its own GPUs (replaced, not appended)
MANIFEST_DIR = "manifest"
META_FILE = "meta.json"
SAMPLE_PREFIX = "hs_"
SAMPLE_SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp-"        # temp files start with a dot: no `hs_*.safetensors` glob matches them
LAUNCH_ENV = "FLEET_LAUNCH"  # the launch number, handed to the shard process by its runner
ACT_LOCK_FILE = "act.lock"   # held by whoever carries out a shard's stop or restart

# --- the run's folder ---------------------------------------------------------------------------
CLAIM_LOCK_FILE = "supervisor.lock"   # in the run dir: held by the supervising agent (worker/agent.py)
CLAIM_FILE = "supervisor.json"        # beside it: who holds it (SupervisorClaim)


def sample_file_name(index: int) -> str:
    return f"{SAMPLE_PREFIX}{index}{SAMPLE_SUFFIX}"


def shard_dir(run_dir: str, shard: int) -> str:
    return os.path.join(run_dir, "shards", str(shard))
