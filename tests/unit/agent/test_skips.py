"""agent.skips: the windows of data the ranks leave out, as RESURGO_SKIP_SAMPLES writes them."""

from __future__ import annotations

import pytest

from agent.skips import format_skip_samples, parse_skip_samples
from agent.wire.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "ranges"),
    [
        ("", ()),
        ("  ", ()),
        ("0:8", ((0, 8),)),
        ("1024:2048, 64:128", ((1024, 2048), (64, 128))),
    ],
)
def test_windows_parse_in_their_order_and_empty_means_none(
    text: str, ranges: tuple[tuple[int, int], ...]
) -> None:
    assert parse_skip_samples(text) == ranges


@pytest.mark.parametrize(
    "text", ["8", "8:8", "9:3", "-1:4", "+1:4", "1_0:20", "0:4,", "a:b", "0:4;8:9", "0:4:8"]
)
def test_a_malformed_value_names_the_variable_and_the_expected_format(text: str) -> None:
    with pytest.raises(ConfigError, match=r"RESURGO_SKIP_SAMPLES=.*expected START:END\[,START:END"):
        parse_skip_samples(text)


def test_formatting_is_what_parsing_reads() -> None:
    ranges = ((0, 8), (4096, 8192))
    assert format_skip_samples(ranges) == "0:8,4096:8192"
    assert parse_skip_samples(format_skip_samples(ranges)) == ranges
    assert format_skip_samples(()) == ""
