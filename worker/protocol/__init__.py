"""The wire format between workers, runners, the host agent and the supervisor: typed records.

Standard library only: this package travels to every GPU host and is imported by `fleet` too, so the
two sides can never disagree on a record. Every record is one JSON object on one line.

The format is one namespace, ``protocol.X`` (every public name is re-exported here), whatever
module holds X; each module is one part of it::

    layout     PROTOCOL_VERSION and the files of a run and a shard on a host (their names)
    records    Record and Reply: their JSON, their checked parsing; the event and message registries
    events     the events of a shard's record (events.jsonl), parse_event
    jsonl      JSON-lines files: append_jsonl, JsonlTail, iter_jsonl, read_events
    messages   the agent's messages (its stdout), parse_message
    actions    the supervisor's actions on a shard (ShardAction, LaunchSpec) and their ActResults
    replies    the typed replies of host commands (PreflightReport, Plan, VerifyReport, ...) and
               the typed parts records carry (GpuStat, WorkIdentity, SupervisorClaim)

Importing the package imports every module, so EVENT_TYPES and MESSAGE_TYPES hold every kind.
"""

from __future__ import annotations

from .actions import ACT_STATUSES, ActResult, LaunchSpec, RowShare, SentinelSpec, ShardAction
from .events import (ENGINE_ENDED, PROGRESS_EVENTS, TASK_ENDS, TASK_PHASES, USER_STOPS, Checked, Done, Event, Exited,
                     Failed, Launch, Leased, LeaseMoved, Loaded, Loading, Progress, Relocated, Reopened, SampleSkipped,
                     Sentinel, Shipping, Started, StopRequested, Submitted, TaskEnded, WarningEvent, parse_event)
from .jsonl import JsonlTail, append_jsonl, iter_jsonl, read_events
from .layout import (ACT_LOCK_FILE, CLAIM_FILE, CLAIM_LOCK_FILE, EVENTS_FILE, GPUS_FILE, LAUNCH_ENV, LOCK_FILE,
                     LOG_FILE, MANIFEST_DIR, META_FILE, PID_FILE, PROTOCOL_VERSION, REPLAY_RECENT_S, SAMPLE_PREFIX,
                     SAMPLE_SUFFIX, TEMP_PREFIX, sample_file_name, shard_dir)
from .messages import (AgentError, Beat, Claimed, DiskReading, End, EnginePoll, EventMessage, GpuReading, Hello, Idle,
                       Liveness, Message, RecordDamage, Replayed, TaskGpus, TaskState, parse_message)
from .records import EVENT_TYPES, MESSAGE_TYPES, CompactReply, Record, Reply, ReplyError, event, message, now
from .replies import (Cancellation, Check, DataIdentity, EngineCheck, ExportSummary, Footprint, GpuStat, ModelIdentity,
                      Plan, PlanShard, PreflightReport, Repair, Status, Submission, SupervisorClaim, Unfinished,
                      VerifyReport, WorkIdentity)

# What `from worker import protocol` gives: every public name of the modules above, in one namespace.
__all__ = ["ACT_STATUSES", "ActResult", "LaunchSpec", "RowShare", "SentinelSpec", "ShardAction", "ENGINE_ENDED",
           "PROGRESS_EVENTS", "TASK_ENDS", "TASK_PHASES", "USER_STOPS", "Checked", "Done", "Event", "Exited", "Failed",
           "Launch", "Leased", "LeaseMoved", "Loaded", "Loading", "Progress", "Relocated", "Reopened", "SampleSkipped",
           "Sentinel", "Shipping", "Started", "StopRequested", "Submitted", "TaskEnded", "WarningEvent", "parse_event",
           "JsonlTail", "append_jsonl", "iter_jsonl", "read_events", "ACT_LOCK_FILE", "CLAIM_FILE", "CLAIM_LOCK_FILE",
           "EVENTS_FILE", "GPUS_FILE", "LAUNCH_ENV", "LOCK_FILE", "LOG_FILE", "MANIFEST_DIR", "META_FILE", "PID_FILE",
           "PROTOCOL_VERSION", "REPLAY_RECENT_S", "SAMPLE_PREFIX", "SAMPLE_SUFFIX", "TEMP_PREFIX", "sample_file_name",
           "shard_dir", "AgentError", "Beat", "Claimed", "DiskReading", "End", "EnginePoll", "EventMessage",
           "GpuReading", "Hello", "Idle", "Liveness", "Message", "RecordDamage", "Replayed", "TaskGpus", "TaskState",
           "parse_message", "EVENT_TYPES", "MESSAGE_TYPES", "CompactReply", "Record", "Reply", "ReplyError", "event",
           "message", "now", "Cancellation", "Check", "DataIdentity", "EngineCheck", "ExportSummary", "Footprint",
           "GpuStat", "ModelIdentity", "Plan", "PlanShard", "PreflightReport", "Repair", "Status", "Submission",
           "SupervisorClaim", "Unfinished", "VerifyReport", "WorkIdentity"]
