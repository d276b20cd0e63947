"""worker/text.py's fast paths against the full rewrite they skip: text with nothing to take out
is returned as it is, and a JSON line `plain_json` passes decodes to strings printable as they are."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.text import _CONTROL, _SEQUENCE, plain_json, printable, printable_data

# Text drawn to hit what printable takes out: C0/C1 controls, ESC sequences, bidi marks, line breaks.
NASTY = st.sampled_from(["\x1b", "\x1b[31m", "\x1b]0;title\x07", "\x9b2J", "\n", "\r\n", "\t", "\x7f",
                         "\x85", "\u202e", "\u2066", "\u061c", "\\", '"', "é", "日本"])
TEXT = st.lists(st.one_of(st.text(max_size=6), NASTY), max_size=8).map("".join)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                    max_leaves=12)


def rewritten(text: str) -> str:
    """printable without its fast path: the whole rewrite, always."""
    return _CONTROL.sub("", _SEQUENCE.sub("", text.replace("\r\n", " ").replace("\n", " ")))


@settings(max_examples=400, deadline=None)
@given(TEXT)
def test_printable_is_the_rewrite_whether_or_not_it_skips_it(text):
    assert printable(text) == rewritten(text)


@settings(max_examples=400, deadline=None)
@given(JSON, st.booleans())
def test_a_plain_json_line_decodes_to_data_printable_as_it_is(obj, ascii_only):
    line = json.dumps({"type": "x", "data": obj}, ensure_ascii=ascii_only) + "\n"
    decoded = json.loads(line)
    if plain_json(line):
        assert printable_data(decoded) == decoded
    else:                             # (not plain: escapes or unsafe code points somewhere in it)
        assert "\\" in line or any(rewritten(ch) != ch for ch in line.rstrip("\n"))


def test_a_line_of_telemetry_is_plain_and_one_with_an_escape_sequence_is_not():
    assert plain_json('{"type": "beat", "t": 1.5, "shard": 3, "why": "RUNNING 10/20"}\n')
    assert not plain_json(json.dumps({"why": "\x1b[2J"}))
    assert not plain_json(json.dumps({"why": "\u202eevil"}, ensure_ascii=False))
