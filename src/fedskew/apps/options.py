"""The command-line options of ``fedskew run``, ``partition`` and ``compare``, built from the
option metadata of :class:`~fedskew.config.ExperimentConfig` (see ``config.option``).

Argparse only collects the raw strings: every value is parsed by
:func:`fedskew.config.parse_value`, as values of config files and of Flower's run config
are, so that all sources accept the same spellings and refuse the others with one message.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from fedskew.config import FIELDS, TABLES, ExperimentConfig, parse_number, parse_value
from fedskew.core.errors import UsageError


def cli_fields(command: str | None = None) -> list[dataclasses.Field]:
    """The config fields that have command-line options (of ``command``: "experiment" for
    those that ``fedskew partition`` takes too, "run" for the others; None: all)."""
    return [
        f
        for f in dataclasses.fields(ExperimentConfig)
        if f.metadata.get("cli", True)
        and (command is None or f.metadata.get("command", "run") == command)
    ]


def long_flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def flags(f: dataclasses.Field) -> list[str]:
    """The option strings of a field, short one first (as --help shows them)."""
    short = f.metadata.get("short")
    return [short, long_flag(f)] if short else [long_flag(f)]


def default_text(f: dataclasses.Field) -> str:
    """How the default of a field reads in --help and the docs ("" when none is stated:
    flags, tables, unset values, and defaults that the help text explains itself)."""
    meta = f.metadata
    if "default_text" in meta:
        return meta["default_text"]
    if meta.get("action") in ("true", "false", "append", "pairs") or f.default is None:
        return ""
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


def help_text(f: dataclasses.Field) -> str:
    text = f.metadata["help"]
    default = default_text(f)
    return f"{text} (default {default})" if default else text


def metavar(f: dataclasses.Field) -> str | None:
    meta = f.metadata
    if "metavar" in meta:
        return meta["metavar"]
    if meta.get("action") == "pairs":
        return "KEY=VALUE"
    choices = meta.get("cli_choices") or meta.get("choices")
    return "{" + ",".join(choices) + "}" if choices else None


OVERRIDDEN = "_overridden_values"  # the namespace attribute RepeatedStore keeps them in


class RepeatedStore(argparse._StoreAction):
    """Stores the last value given, as argparse does, and keeps the earlier ones of the same
    option (``--rounds abc -r 1``), so that they are checked too (``raw_cli_values``)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        earlier = getattr(namespace, self.dest, None)
        if earlier is not None:
            kept = getattr(namespace, OVERRIDDEN, [])
            setattr(namespace, OVERRIDDEN, [*kept, (self.dest, earlier)])
        setattr(namespace, self.dest, values)


def _add(p: Any, f: dataclasses.Field) -> None:
    # Every option defaults to None, so that a config file can set what the command line
    # leaves out; argparse keeps the text as given (parse_value reads it).
    action = f.metadata.get("action")
    kwargs: dict[str, Any] = {"dest": f.name, "help": help_text(f).replace("%", "%%")}
    if action in ("true", "false"):
        kwargs.update(action="store_const", const=action == "true")
    else:
        kwargs["metavar"] = metavar(f)
        kwargs["action"] = "append" if action in ("append", "pairs") else RepeatedStore
    p.add_argument(*flags(f), **kwargs)


def add_field_options(p: argparse.ArgumentParser, command: str) -> None:
    """The options of the config fields of ``command`` ("experiment" or "run"), in the
    order the fields are declared; fields of one ``exclusive`` group exclude each other."""
    groups: dict[str, Any] = {}
    for f in cli_fields(command):
        target: Any = p
        group = f.metadata.get("exclusive")
        if group is not None:
            if group not in groups:
                groups[group] = p.add_mutually_exclusive_group()
            target = groups[group]
        for key, (_, text) in f.metadata.get("shortcuts", {}).items():
            target.add_argument(
                "--" + key.replace("_", "-"), dest=key, help=text, action=RepeatedStore
            )
        _add(target, f)


def add_experiment_options(p: argparse.ArgumentParser) -> None:
    """Options shared by ``run``, ``partition`` and ``compare``."""
    p.add_argument("-c", "--config", help="experiment file (.toml or .yaml); options override it")
    add_field_options(p, "experiment")


def add_run_options(p: argparse.ArgumentParser) -> None:
    add_field_options(p, "run")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an unfinished run folder")


def raw_cli_values(args: argparse.Namespace) -> dict[str, Any]:
    """The config values as given on the command line, unparsed (None: not given); a
    table's shortcut flags (``--beta``) count as values of the table. A value a later one of
    the same option overrode must still be one the option takes: a one-line UsageError
    otherwise (``--rounds abc -r 1`` would run with an error nobody saw)."""
    shortcuts = {
        name: kind
        for table in TABLES
        for name, (kind, _) in FIELDS[table].metadata.get("shortcuts", {}).items()
    }
    for key, earlier in getattr(args, OVERRIDDEN, []):
        if key in FIELDS:
            parse_cli_value(key, earlier)
        elif key in shortcuts:  # --beta x --beta 0.5
            parse_number(key.replace("_", "-"), shortcuts[key], earlier)
    values: dict[str, Any] = {}
    for f in cli_fields():
        if hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
            if values[f.name] is None and any(
                getattr(args, key, None) is not None for key in f.metadata.get("shortcuts", {})
            ):
                values[f.name] = []
    return values


def cli_values(args: argparse.Namespace) -> dict[str, Any]:
    """The config values given on the command line, parsed (None: not given)."""
    values = {key: parse_cli_value(key, value) for key, value in raw_cli_values(args).items()}
    for key in TABLES:
        for name, (kind, _) in FIELDS[key].metadata.get("shortcuts", {}).items():
            if getattr(args, name, None) is not None:  # --beta wins over -P beta=...
                values[key][name] = parse_number(name.replace("_", "-"), kind, getattr(args, name))
    return values


def parse_cli_value(key: str, value: Any) -> Any:
    if value is None:
        return None
    f = FIELDS[key]
    parsed = parse_value(key, value, where="/".join(flags(f)))
    allowed = f.metadata.get("cli_choices")
    if allowed is not None and parsed not in allowed:  # values only an app may set
        raise UsageError(
            f"{key.replace('_', '-')} must be one of {', '.join(allowed)}, got {parsed!r}"
        )
    return parsed
