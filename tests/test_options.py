"""Options declared once (ExperimentConfig's field metadata): the command line, the docs and
the tags are made from it, and every source of a value goes through one parser."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from fedskew import config
from fedskew.apps.cli import main, make_parser
from fedskew.apps.options import cli_fields, cli_values, flags
from fedskew.apps.options_reference import reference
from fedskew.config import ExperimentConfig, build_config, read_config_file
from fedskew.core.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]


def subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def option_strings(command: str) -> set[str]:
    return {s for a in subparser(command)._actions for s in a.option_strings}


def test_docs_options_md_is_what_the_generator_writes():
    """Run `python -m fedskew.apps.options_reference > docs/options.md` after changing options."""
    assert (ROOT / "docs" / "options.md").read_text(encoding="utf-8") == reference()


def test_every_field_is_declared_with_help_and_reaches_the_command_line():
    for f in dataclasses.fields(ExperimentConfig):
        assert f.metadata.get("help"), f"{f.name}: give it help in config.option(...)"
        assert f.name in reference()
    run, partition, compare = (option_strings(c) for c in ("run", "partition", "compare"))
    for f in cli_fields():
        assert set(flags(f)) <= run and set(flags(f)) <= compare, f.name
        assert (f.metadata.get("command") == "experiment") == (set(flags(f)) <= partition)
    assert {"--beta", "--min-size", "--resume", "-c"} <= run
    # track_dir has no flag: fedskew compare sets it.
    assert "--track-dir" not in run and not config.FIELDS["track_dir"].metadata["cli"]


def test_cli_values_cover_every_field_with_a_flag():
    args = subparser("run").parse_args([])
    assert set(cli_values(args)) == {f.name for f in cli_fields()}
    assert all(v is None for v in cli_values(args).values())  # a config file may set them


def test_the_tags_make_the_lists_other_modules_use():
    tagged = lambda tag: {  # noqa: E731
        f.name for f in dataclasses.fields(ExperimentConfig) if f.metadata.get(tag)
    }
    assert set(config.EXECUTION_ONLY) == tagged("execution")
    assert set(config.RESUME_MAY_CHANGE) == tagged("resumable")
    assert set(config.RESUME_MAY_CHANGE) <= set(config.EXECUTION_ONLY)
    assert set(config.MEASUREMENT_ONLY) == {
        "feature_metrics_every", "local_risk_every", "tsne", "dp_delta", "dp_target_epsilon",
        "dp_accounting",
    }  # fmt: skip
    assert config.TABLES == ("model_options", "partition_params", "params")
    assert set(config.NOT_IN_FLOWER_RUN_CONFIG) == {
        "data_dir", "engine", "workers", "clients_together", "clients_together_max", "quiet",
        "track_dir",
    }  # fmt: skip
    assert all(config.NOT_IN_FLOWER_RUN_CONFIG.values())  # each with its reason


@pytest.mark.parametrize(
    "key, text, message",
    [
        ("lr", "x", "lr expects float, got 'x'"),
        ("rounds", "1.5", "rounds expects int, got '1.5'"),
        ("tf32", "maybe", "tf32 expects true or false, got 'maybe'"),
        ("workers", "many", "workers expects an integer >= 0 or auto, got 'many'"),
    ],
)
def test_one_parser_and_one_message_for_the_command_line_a_file_and_flower(
    tmp_path, capsys, key, text, message
):
    flag = "--" + key.replace("_", "-")
    assert main(["run", f"{flag}={text}", "-q"]) == 2
    assert capsys.readouterr().err == f"fedskew: error: {message}\n"
    toml = tmp_path / "c.toml"
    toml.write_text(f'{key} = "{text}"\n')
    with pytest.raises(UsageError) as from_file:
        build_config(read_config_file(toml), {})
    assert str(from_file.value) == message
    pytest.importorskip("flwr")
    import fedskew.apps.flower.run_config as flower_app

    with pytest.raises(UsageError) as from_flower:
        flower_app.config_from_run_config({key.replace("_", "-"): text}, tmp_path)
    assert str(from_flower.value) == message


def test_values_read_alike_from_every_source(tmp_path):
    args = subparser("run").parse_args(
        ["--lr", "1e-3", "--tf32", "on", "-p", "mu = 0.5", "--beta", "0.3", "-P", "min_size=2"]
    )
    values = cli_values(args)
    assert values["lr"] == 0.001 and values["tf32"] is True
    assert values["params"] == {"mu": 0.5}
    assert values["partition_params"] == {"min_size": 2, "beta": 0.3}
    # --beta and --min-size keep their types (config.json and the config hash as before).
    args = subparser("run").parse_args(["--beta", "1", "-P", "beta=3", "--min-size", "4"])
    assert cli_values(args)["partition_params"] == {"beta": 1.0, "min_size": 4}
    assert isinstance(cli_values(args)["partition_params"]["beta"], float)
    toml = tmp_path / "c.toml"
    toml.write_text('lr = "1e-3"\ntf32 = "on"\n')
    from_file = build_config(read_config_file(toml), {})
    assert (from_file.lr, from_file.tf32) == (0.001, True)


@pytest.mark.parametrize(
    "args, message",
    [
        (["-p", "mu"], "-p/--param: expected key=value, got 'mu'"),
        (["--beta", "x"], "beta expects float, got 'x'"),
        (["--min-size", "1.5"], "min-size expects int, got '1.5'"),
        (["--engine", "flower"], "engine must be one of inprocess, flower-sim, got 'flower'"),
        (["--memory-format", "x"], "memory-format must be one of auto, channels_last"),
    ],
)
def test_command_line_errors_are_one_line(capsys, args, message):
    assert main(["run", *args, "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fedskew: error: {message}") and err.count("\n") == 1


def test_the_flower_app_run_config_is_written_from_the_option_metadata(tmp_path, capsys):
    from fedskew.apps.flower import app_config

    pyproject = Path(__file__).resolve().parents[1] / "flower" / "pyproject.toml"
    assert app_config.main(["--check", str(pyproject)]) == 0, (
        "flower/pyproject.toml is stale: "
        "python -m fedskew.apps.flower.app_config flower/pyproject.toml"
    )
    stale = tmp_path / "pyproject.toml"
    stale.write_text(pyproject.read_text().replace("lr = 0.05\n", ""))
    assert app_config.main(["--check", str(stale)]) == 1
    assert "differs from the app fedskew writes" in capsys.readouterr().err
    assert app_config.main([str(stale)]) == 0
    assert stale.read_text() == pyproject.read_text()
