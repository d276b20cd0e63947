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
