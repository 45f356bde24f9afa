"""`parse_size` (the sizes commands accept, e.g. `d9d plan --device-memory`) and `format_size`."""

import pytest

from d9d.cli.commands._text import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 1024**3),
        ("24GB", 24 * 1000**3),
        ("512MiB", 512 * 1024**2),
        ("512 mib", 512 * 1024**2),  # a space and any case
        ("4KiB", 4 * 1024),
        ("3KB", 3000),
        ("2TiB", 2 * 1024**4),
        ("1.5GiB", 3 * 1024**3 // 2),
        ("0.1GB", 10**8),  # exact, not float-rounded
        ("123456789", 123456789),
        ("100B", 100),
        (" 7 B ", 7),
    ],
)
def test_parse_size_reads_binary_and_decimal_units_and_bytes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("80G", "ambiguous: write 80GiB .* or 80GB"),
        ("8m", "ambiguous: write 8MiB"),
        ("12XB", "unknown unit 'XB'"),
        ("lots", "is not a size"),
        ("", "is not a size"),
        ("1.5", "whole number"),
        ("0", "above zero"),
        ("-3GiB", "above zero"),
        ("0.0001B", "whole number"),
    ],
)
def test_parse_size_refuses_what_is_not_a_size_saying_what_to_write(text, match):
    with pytest.raises(ValueError, match=match):
        parse_size(text)


@pytest.mark.parametrize("n", [1, 1023, 1024, 5 * 1024**2 + 7, 80 * 1024**3 + 12345])
def test_a_formatted_size_parses_back_within_its_rounding(n):
    number, unit = format_size(n).split()
    per_unit = parse_size(f"1{unit}")
    assert abs(parse_size(number + unit) - n) <= per_unit // 20  # one decimal: half of 0.1 unit
