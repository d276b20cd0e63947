"""A user's per-GPU job whose behaviour the test scripts, one list of steps per launch.

    python scripted_job.py SCRIPT.json SHARD

SCRIPT.json: {"<shard>": [[step, ...] for launch 1, [step, ...] for launch 2, ...]}; a launch past
the end repeats the last list. The launch number comes from FLEET_LAUNCH (set by fleet's runner).
Steps: ["print", text] · ["progress", done, total] (prints "processed done/total") ·
["cr_progress", done, total] (a \\r-redrawn progress bar) · ["file", path] · ["wait", path] (block
until it exists) · ["sleep", s] · ["ignore_term"] · ["exit", code] · ["hang"] · ["chatter"] (prints a
line every 0.1 s for ever, never progress: a hung shard that still logs) · ["fork", "group" | "setsid"]
(a child that ignores SIGTERM and hangs, in the job's process group or in a session of its own,
keeping the job's open files; the parent goes on) · ["ticks", total, every] (prints "processed i/total"
every `every` seconds, i = 1..total).
"""

import json
import os
import signal
import sys
import time

script, shard = json.load(open(sys.argv[1])), sys.argv[2]
launches = script[shard]
steps = launches[min(int(os.environ.get("FLEET_LAUNCH", "1")), len(launches)) - 1]
for step in steps:
    kind, args = step[0], step[1:]
    if kind == "print":
        print(args[0], flush=True)
    elif kind == "progress":
        print(f"processed {args[0]}/{args[1]}", flush=True)
    elif kind == "cr_progress":
        sys.stdout.write(f"\rprocessed {args[0]}/{args[1]}")
        sys.stdout.flush()
    elif kind == "file":
        open(args[0], "w").close()
    elif kind == "wait":
        while not os.path.exists(args[0]):
            time.sleep(0.05)
    elif kind == "sleep":
        time.sleep(args[0])
    elif kind == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif kind == "exit":
        sys.exit(args[0])
    elif kind == "hang":
        while True:
            time.sleep(1)
    elif kind == "ticks":
        for i in range(1, args[0] + 1):
            print(f"processed {i}/{args[0]}", flush=True)
            time.sleep(args[1])
    elif kind == "chatter":
        while True:
            print("still here, working on it", flush=True)
            time.sleep(0.1)
    elif kind == "fork":
        if os.fork() == 0:
            if args[0] == "setsid":
                os.setsid()
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:
                time.sleep(1)
