import pytest

from edgekv.errors import EdgekvError
from edgekv.units import fmt_bytes, fmt_ctx, parse_bytes, parse_ctx, parse_ctx_list


@pytest.mark.parametrize("text,tokens", [("4000", 4000), ("4k", 4096), ("4K", 4096), ("32K", 32768),
                                         ("128k", 131072), ("1m", 1048576), (" 8k ", 8192), ("1", 1)])
def test_context_lengths_use_binary_multipliers(text, tokens):
    assert parse_ctx(text) == tokens


@pytest.mark.parametrize("bad", ["32kk", "0", "-5", "1e9", "1.5k", "", "k", "32 kb", "999999999999"])
def test_malformed_context_is_one_clear_error(bad):
    with pytest.raises(EdgekvError) as e:
        parse_ctx(bad)
    assert "\n" not in str(e.value)


def test_context_list_and_formatting():
    assert parse_ctx_list("1k,8k,32k") == [1024, 8192, 32768]
    assert [fmt_ctx(x) for x in (4096, 4000, 1048576)] == ["4k", "4000", "1m"]


def test_bytes_say_their_unit():
    assert fmt_bytes(3.5e9) == "3.50 GB"
    assert fmt_bytes(2**30, "GiB") == "1.00 GiB"
    assert parse_bytes("3GiB") == 3 * 2**30 and parse_bytes("3500MB") == 3_500_000_000
    with pytest.raises(EdgekvError, match="no unit"):  # "0.6" could be GB or MB
        parse_bytes("1500")
