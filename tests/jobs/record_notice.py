"""A [notify] command for tests: appends what it was given (its argv and the JSON on its stdin) as
one line to the file named by its first argument; exits with the code in FLEET_TEST_NOTIFY_EXIT.

    python record_notice.py OUT.jsonl [more args...]
"""

import json
import os
import sys

notice = json.loads(sys.stdin.read())
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "notice": notice}) + "\n")
code = int(os.environ.get("FLEET_TEST_NOTIFY_EXIT", "0"))
if code:
    print("notify test: failing on purpose", file=sys.stderr)
sys.exit(code)
