"""The one reader of users' TOML, YAML and JSON files: strict, bounded, one-line errors."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedskew.apps.cli import main
from fedskew.core.errors import UsageError
from fedskew.core.structured_text import MAX_DEPTH, parse_structured_text

LAUGHS = "\n".join(
    ["a: &a [x, x, x, x, x, x, x, x, x]"]
    + [f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}" + f", *{chr(97 + i)}" * 8 + "]"
       for i in range(8)]
)  # fmt: skip


def test_yaml_aliases_and_duplicate_keys_are_refused():
    start = time.perf_counter()
    with pytest.raises(UsageError, match="aliases"):
        parse_structured_text(LAUGHS, ".yaml", "laughs.yaml")
    assert time.perf_counter() - start < 5  # refused, not expanded (9**9 leaves)
    with pytest.raises(UsageError, match="duplicate key 'rounds'"):
        parse_structured_text("rounds: 2\nlr: 0.1\nrounds: 3\n", ".yml", "f.yml")
    with pytest.raises(UsageError, match="duplicate key 'rounds'"):
        parse_structured_text('{"rounds": 2, "rounds": 3}', ".json", "f.json")
    with pytest.raises(UsageError, match="f.toml"):
        parse_structured_text("rounds = 2\nrounds = 3\n", ".toml", "f.toml")
    assert parse_structured_text("a: {b: [1, 2]}\n", ".yaml", "ok.yaml") == {"a": {"b": [1, 2]}}


@pytest.mark.parametrize(
    "suffix,text",
    [
        (".json", "[" * 100_000 + "]" * 100_000),
        (".json", '{"a":' * 100_000 + "1" + "}" * 100_000),
        (".toml", "a = " + "[" * 100_000 + "]" * 100_000),
        (".yaml", "a: " + "[" * 100_000 + "]" * 100_000),
        (".json", '{"a":' * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1)),
    ],
)
def test_deep_nesting_is_one_error(suffix, text):
    with pytest.raises(UsageError, match="nested"):
        parse_structured_text(text, suffix, "deep" + suffix)


@settings(max_examples=150, deadline=None)
@given(
    suffix=st.sampled_from([".toml", ".yaml", ".json"]),
    text=st.text(alphabet=st.sampled_from(list("ab:=-[]{}&*!,\"'\n #0.1") + ["\t"]), max_size=60),
)
def test_any_text_parses_or_gives_a_usage_error(suffix, text):
    try:
        parse_structured_text(text, suffix, "fuzz" + suffix)
    except UsageError as exc:
        assert "\n" not in str(exc)


def test_the_cli_refuses_hostile_files_in_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text('{"rounds":' * 50_000 + "1" + "}" * 50_000)
    laughs = tmp_path / "laughs.yaml"
    laughs.write_text(LAUGHS)
    huge = tmp_path / "clients.json"
    huge.write_text(json.dumps([[0, 1], [2, 2**70]]))
    for argv in (
        ["run", "-c", str(deep)],
        ["run", "-c", str(laughs)],
        ["compare", "-c", str(laughs)],
        ["run", "--partition-file", str(huge), "-n", "2", "-r", "1", "-o", str(tmp_path)],
    ):
        assert main(argv) != 0
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, (argv, err)
