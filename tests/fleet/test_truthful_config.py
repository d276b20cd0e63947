"""Issue 21's probe, fleet.toml side: a price that is not a number of dollars is refused."""

from __future__ import annotations

import pytest

from fleet.config import ConfigError, load_config

TOML = """\
[run]
name = "r"
model = "/m"
data = "/d.jsonl"
output = "/o"

[[hosts]]
name = "box"
address = "203.0.113.7"
usd_per_hour = {price}
"""


@pytest.mark.parametrize("price", ["inf", "nan", "1e308"])
def test_an_absurd_price_is_refused_naming_the_line(tmp_path, price):
    path = tmp_path / "fleet.toml"
    path.write_text(TOML.format(price=price))
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert str(e.value).startswith(f"{path}:10:") and "usd_per_hour" in str(e.value), str(e.value)


def test_a_real_price_loads(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text(TOML.format(price="3.5"))
    assert load_config(str(path)).hosts[0].usd_per_hour == 3.5


async def test_a_notify_command_flooding_stderr_is_read_as_a_tail(tmp_path):
    """200 MB on stderr: fleet keeps its last 64 KiB (it kept all of it, and `fleet up` grew to
    GBs), still tells the command's last line, and never blocks the command on a full pipe."""
    import asyncio
    import sys
    import tracemalloc

    from fleet.config import NotifySpec
    from fleet.notify import Notifier

    flood = ("import sys\nsys.stdin.read()\nblock = b'x' * (1 << 20) + b'\\n'\n"
             "for _ in range(200):\n    sys.stderr.buffer.write(block)\n"
             "sys.stderr.write('the last line\\n')\nsys.exit(4)\n")
    (tmp_path / "flood.py").write_text(flood)
    logs: list[str] = []
    notifier = Notifier(NotifySpec(command=f"{sys.executable} {tmp_path / 'flood.py'}", timeout=120),
                        str(tmp_path), logs.append)

    class Notice:
        def to_json(self) -> str:
            return '{"event": "DONE"}'
    tracemalloc.start()
    try:
        await asyncio.wait_for(notifier.send(Notice()), 120)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert logs == [f"notify: {sys.executable} exited 4: the last line"]
    assert peak < 20 << 20, peak
