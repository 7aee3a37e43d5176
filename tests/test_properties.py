"""Inputs made by Hypothesis (issue 15): random and malformed values for every option of
``fedskew run`` and ``fedskew partition``, for every key of a config file (TOML, YAML,
JSON, with its tables), and random bytes, truncations and bit flips of every file that a
resume reads. The only acceptable outcomes are a clean error (exit 1 or 2, one line on
stderr, or argparse's usage error) or a valid run; a value that is plainly wrong (NaN, a
negative count, ...) must never give a valid run.

Runs are tiny (digits, 4 clients, 2 per round, 1 round, 1 epoch, in-process) and most
generated values are invalid, so that the whole file takes well under two minutes. The
regressions found by these generators are the explicit tests at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from fedskew.algorithms import ALGORITHMS
from fedskew.apps.cli import main, make_parser
from fedskew.config import FIELDS
from fedskew.data.partition import PARTITIONS
from fedskew.runs.folder import LOCK

# Function-scoped fixtures (capsys, tmp_path) are shared by a test's examples on purpose:
# each example reads capsys clean and works in a folder of its own.
FUZZ = dict(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# FEDSKEW_FUZZ_SCALE=10 runs ten times the examples (a longer search, by hand).
SCALE = float(os.environ.get("FEDSKEW_FUZZ_SCALE", "1"))
FLOAT32_MAX = 3.4028234663852886e38
TIMING = ("seconds", "eval_seconds")


def examples(n: int) -> int:
    return max(1, int(n * SCALE))


# ----------------------------------------------------------------------------- outcomes


@contextmanager
def fresh_folder(root: Path) -> Iterator[Path]:
    """A new empty working folder for one example (relative paths land there)."""
    path = Path(tempfile.mkdtemp(dir=root))
    old = os.getcwd()
    os.chdir(path)
    try:
        yield path
    finally:
        os.chdir(old)
        shutil.rmtree(path, ignore_errors=True)
        torch.use_deterministic_algorithms(False)  # --deterministic sets it for the process


def _event(text: str) -> None:
    """Counted in --hypothesis-show-statistics (outside a Hypothesis test: nothing)."""
    try:
        event(text)
    except InvalidArgument:
        pass


def clean_outcome(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run the command line in this process; a clean error or success, else fail."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        out = capsys.readouterr()
        assert exc.code == 2, (argv, exc.code, out.err)
        assert "usage:" in out.err and "Traceback" not in out.err, (argv, out.err)
        _event("argparse usage error")
        return 2, out.out, out.err
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out, (argv, out.err)
    if code != 0:
        lines = out.err.splitlines()
        assert code in (1, 2), (argv, code, out.err)
        assert len(lines) == 1 and lines[0].startswith("fedskew: error: "), (argv, out.err)
    _event(f"exit {code}")
    return code, out.out, out.err


def check_finished_run(where: Path) -> Path:
    """After exit 0 of ``fedskew run``: one finished run folder, complete and consistent."""
    summaries = list(where.rglob("summary.json"))
    assert len(summaries) == 1, summaries
    folder = summaries[0].parent
    assert not list(where.rglob("*.incomplete"))
    config = json.loads((folder / "config.json").read_text())
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, config["rounds"] + 1))
    summary = json.loads(summaries[0].read_text())
    assert summary["rounds"] == config["rounds"]
    for key in ("lr", "momentum", "weight_decay", "grad_clip", "reply_timeout"):
        assert math.isfinite(config[key]), (key, config[key])
    return folder


# ----------------------------------------------------------------------- value makers
# Each maker gives (text, plainly_bad): plainly_bad values must never give a valid run.

TRICKY = st.sampled_from(
    ["", " ", "nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e309", "-1e309", "1e308",
     "3.5e38", "-0", "0", "-1", "1.5", "0x10", "1_0", "\u0663", "\u00b2", "1e3", "true",
     "None", "null", "=", "a=b", "--", "-", "\x00", "\n", "\u202e", "9" * 30,
     "x.incomplete"]
)  # fmt: skip
JUNK = st.one_of(
    TRICKY,
    st.text(max_size=8),
    st.floats().map(repr),
    st.integers().map(str),
)


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def int_values(valid: Callable[[int], bool], cheap_max: int | None = None) -> st.SearchStrategy:
    """Text for an ``int`` option: small valid values and junk; plainly bad when it is
    no integer or fails ``valid``. Valid values above ``cheap_max`` (slow runs) are left out."""
    small = st.integers(-3, 6).map(str)

    def keep(text: str) -> bool:
        n = _int(text)
        return cheap_max is None or n is None or not valid(n) or n <= cheap_max

    def bad(text: str) -> tuple[str, bool]:
        n = _int(text)
        return text, n is None or not valid(n)

    return st.one_of(small, JUNK).filter(keep).map(bad)


def float_values(
    valid: Callable[[float], bool], lo: float, hi: float, f32: bool = True
) -> st.SearchStrategy:
    """Text for a ``float`` option: values in [lo, hi], junk and extremes; plainly bad when
    no number, not finite, beyond float32 (for values that reach tensors: ``f32``) or
    failing ``valid``."""

    def bad(text: str) -> tuple[str, bool]:
        x = _float(text)
        if x is None or not math.isfinite(x) or not valid(x):
            return text, True
        return text, f32 and abs(x) > FLOAT32_MAX

    return st.one_of(st.floats(lo, hi).map(repr), JUNK).map(bad)


def choice_values(
    choices: list[str], avoid: tuple[str, ...] = (), strict: bool = True
) -> st.SearchStrategy:
    """One of ``choices`` or junk; plainly bad when not a choice (if ``strict``: some
    options also take other spellings)."""
    return (
        st.one_of(st.sampled_from(choices), JUNK)
        .filter(lambda t: t not in avoid)
        .map(lambda t: (t, strict and t not in choices))
    )


def free_text(bad: Callable[[str], bool] = lambda t: False) -> st.SearchStrategy:
    return JUNK.map(lambda t: (t, bad(t)))


def relative_paths(allow_nul: bool = True) -> st.SearchStrategy:
    """Path text that stays inside the example's folder (these tests run as any user,
    root included): no absolute paths, no '..'."""
    parts = st.one_of(
        st.sampled_from(["a", "b.toml", "c.yaml", "d.json", "e.npz", "x.png", "f.txt", ".",
                         "runs", "exists.file", "exists.dir", "n" * 300, "sp ace", "ü"]),
        st.text(st.characters(exclude_characters="/\\.\x00"), min_size=1, max_size=6),
    )  # fmt: skip
    text = st.lists(parts, min_size=1, max_size=3).map("/".join)
    if allow_nul:
        text = st.one_of(text, st.just("a\x00b"), st.just(""))
    return text.filter(lambda t: ".." not in t and not t.startswith(("/", "~")))


def key_values(keys: list[str], value: st.SearchStrategy) -> st.SearchStrategy:
    """KEY=VALUE items of the repeatable options: known and unknown keys, any values."""
    key = st.one_of(st.sampled_from(keys), st.text(max_size=6)) if keys else st.text(max_size=6)
    value = st.one_of(TRICKY, value)
    return st.one_of(
        st.tuples(key, value).map(lambda kv: f"{kv[0]}={kv[1]}"),
        st.text(max_size=8),  # often no '='
    )


PARAM_KEYS = sorted({f for a in ALGORITHMS.values() for f in a.Params.__dataclass_fields__})
PARTITION_KEYS = sorted({k for p in PARTITIONS.values() for k in p.params})
MODEL_OPTION_KEYS = ["hidden", "stem", "norm", "head_bias"]


def _modest(text: str) -> bool:
    """A model option value that builds a small model (hidden=10**9 would build a huge one:
    a resource limit, not a value to refuse)."""
    _, _, value = text.partition("=")
    n = _int(value) if value.strip().isdigit() else None
    return n is None or n <= 512


def float_param_value(text: str) -> bool:
    """Plainly bad as a float hyper-parameter: NaN, infinite or beyond float32."""
    x = _float(text)
    return x is not None and (not math.isfinite(x) or abs(x) > FLOAT32_MAX)


def param_items() -> st.SearchStrategy:
    value = st.one_of(st.sampled_from(["nan", "inf", "-inf", "1e308", "1e39", "0", "0.1"]), JUNK)
    known_float = {
        f for a in ALGORITHMS.values() for f, d in a.Params.__dataclass_fields__.items()
        if isinstance(d.default, float)
    }  # fmt: skip

    def bad(item: str) -> tuple[str, bool]:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        return item, not sep or (key in known_float and float_param_value(text.strip()))

    return key_values(PARAM_KEYS, value).map(bad)


def _not_a_file_name(text: str) -> bool:
    return text in {"", ".", "exists.dir"} or "\x00" in text or text.endswith("/")


def _option_values() -> dict[str, st.SearchStrategy]:
    algorithms = sorted(ALGORITHMS)
    pos = lambda n: n >= 1  # noqa: E731
    nonneg = lambda n: n >= 0  # noqa: E731
    return {
        "--config": relative_paths().map(lambda t: (t, True)),  # no such file, or junk
        "--algorithm": choice_values(algorithms),
        "--dataset": choice_values(["digits", "synthetic"]).filter(
            lambda v: v[0] not in {"mnist", "fmnist", "cifar10", "cifar100", "tinyimagenet"}
        ),
        "--data-dir": relative_paths().map(lambda t: (t, False)),
        "--no-download": st.just(None),
        "--num-clients": int_values(pos, cheap_max=100),
        "--partition": choice_values(sorted(PARTITIONS)),
        "--beta": float_values(lambda x: x > 0, 0.01, 100.0, f32=False),
        "--min-size": int_values(nonneg),
        "--partition-param": key_values(PARTITION_KEYS, JUNK).map(lambda t: (t, "=" not in t)),
        "--partition-file": relative_paths().map(lambda t: (t, True)),
        "--partition-overlap": st.just(None),
        "--seed": int_values(nonneg),
        "--synthetic-alpha": float_values(lambda x: True, 0.0, 2.0),
        "--synthetic-beta": float_values(lambda x: True, 0.0, 2.0),
        "--model": choice_values(
            ["auto", "mlp", "simple-cnn", "cnn-cifar", "fedavg-cnn"], avoid=("resnet18",)
        ),  # resnet18: seconds per run
        "--model-option": key_values(MODEL_OPTION_KEYS, JUNK)
        .filter(_modest)
        .map(lambda t: (t, "=" not in t)),
        "--participation": float_values(lambda x: 0 < x <= 1, 0.0, 1.0),
        "--clients-per-round": int_values(pos),
        "--rounds": int_values(pos, cheap_max=2),
        "--local-epochs": int_values(pos, cheap_max=2),
        "--batch-size": int_values(pos),
        "--lr": float_values(lambda x: x > 0, 1e-4, 1.0),
        "--momentum": float_values(lambda x: 0 <= x < 1, 0.0, 0.99),
        "--weight-decay": float_values(lambda x: x >= 0, 0.0, 0.1),
        "--grad-clip": float_values(lambda x: x >= 0, 0.0, 10.0),
        "--augment": st.just(None),
        "--param": param_items(),
        "--feature-matching": st.just(None),
        "--eval-every": int_values(pos),
        "--local-test-fraction": float_values(lambda x: 0 <= x < 1, 0.0, 0.5, f32=False),
        "--validation-fraction": float_values(lambda x: 0 <= x < 1, 0.0, 0.5, f32=False),
        "--feature-metrics-every": int_values(nonneg),
        "--local-risk-every": int_values(nonneg),
        "--tsne": st.just(None),
        "--memory-format": choice_values(["auto", "channels_last", "contiguous"]),
        "--precision": choice_values(["fp32", "bf16"]),
        "--denormals": choice_values(["flush", "keep"]),
        "--checkpoint-every": int_values(nonneg),
        "--device": choice_values(["auto", "cpu", "cuda", "cuda:0", "cuda:9"], strict=False),
        "--tf32": choice_values(["on", "off", "true", "false"], strict=False),
        "--deterministic": st.just(None),
        "--clients-together": choice_values(["auto", "off", "vmap", "fused"]),
        "--cuda-graphs": choice_values(["auto", "on", "off"]),
        "--clients-together-max": st.one_of(
            st.just(("auto", False)),
            int_values(pos).filter(lambda v: v[0].strip().lower() != "auto"),
        ),
        "--engine": choice_values(["inprocess"], avoid=("flower-sim",)),
        "--reply-timeout": float_values(lambda x: x >= 0, 0.0, 10.0),
        # Two or more workers start processes (seconds): only 0, 1 and junk here.
        "--workers": choice_values(["0", "1"]).filter(
            lambda v: v[0].strip().lower() != "auto" and (_int(v[0]) or 0) < 2
        ),
        "--on-divergence": choice_values(["stop", "drop"]),
        "--secure-aggregation": st.just(None),
        "--secagg-clip-range": float_values(lambda x: x > 0, 0.1, 10.0),
        "--secagg-quantization": int_values(lambda n: n >= 2),
        "--dp": choice_values(["off", "central", "local"]),
        "--dp-clip": float_values(lambda x: x > 0, 0.01, 10.0),
        "--dp-noise": float_values(lambda x: x >= 0, 0.0, 10.0),
        "--dp-clipping": choice_values(["fixed", "adaptive"]),
        "--dp-target-quantile": float_values(lambda x: 0 <= x <= 1, 0.0, 1.0),
        "--dp-clip-lr": float_values(lambda x: x >= 0, 0.0, 1.0),
        "--dp-count-noise": float_values(lambda x: x >= 0, 0.0, 5.0),
        "--dp-delta": float_values(lambda x: 0 < x < 1, 1e-9, 0.5),
        # Solving for the noise takes seconds: only values refused before any accounting.
        "--dp-target-epsilon": float_values(lambda x: x > 0, 0.0, 0.0),
        "--dp-accounting": choice_values(["replace-one", "poisson-add-remove"]),
        # TensorBoard only: MLflow and W&B keep copies of summary.json that
        # check_finished_run would count as runs. Names take other spellings (" TensorBoard").
        "--track": choice_values(["tensorboard"], strict=False),
        "--resume": relative_paths().map(lambda t: (t, True)),
        "--out-dir": relative_paths().map(lambda t: (t, "\x00" in t)),
        "--name": free_text(
            lambda t: t.strip() != t or any(c in t for c in "/\\\x00") or t in {"", ".", ".."}
        ),
        "--quiet": st.just(None),
        "--plot": relative_paths().map(lambda t: (t, _not_a_file_name(t))),
        "--save": relative_paths().map(lambda t: (t, _not_a_file_name(t))),
    }


OPTION_VALUES = _option_values()


def long_options(command: str) -> set[str]:
    parser = make_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    actions = sub.choices[command]._actions
    return {max(a.option_strings, key=len) for a in actions if a.option_strings} - {"--help"}


def test_every_option_has_a_generator():
    """A new option of run or partition must get a value maker here."""
    missing = (long_options("run") | long_options("partition")) - set(OPTION_VALUES)
    assert not missing


@st.composite
def option_fragments(draw, command: str) -> tuple[list[str], bool, set[str]]:
    """1 to 3 options with generated values: (argv fragment, any plainly bad, names)."""
    names = draw(
        st.lists(st.sampled_from(sorted(long_options(command))), min_size=1, max_size=3,
                 unique=True)
    )  # fmt: skip
    argv: list[str] = []
    any_bad = False
    for name in names:
        value = draw(OPTION_VALUES[name])
        if value is None:  # a flag: alone, or (an argparse error) with a value
            if draw(st.booleans()):
                argv.append(name)
            else:
                argv.append(f"{name}={draw(JUNK)}")
                any_bad = True
            continue
        text, bad = value
        if name in NUMBER_OPTIONS and draw(st.integers(0, 3)) == 0:
            # The option given twice, first with no number at all: the later value is the
            # one used, and the earlier one must still be refused (not silently dropped).
            earlier = draw(JUNK.filter(lambda t: _float(t) is None))
            argv.append(f"{name}={earlier}")
            any_bad = True
        argv.append(f"{name}={text}")  # '=' so that values like '-inf' reach the option
        any_bad = any_bad or bad
    return argv, any_bad, set(names)


# Options whose value is a number (int_values and float_values above): given twice in the
# fuzz, the earlier value junk.
NUMBER_OPTIONS = {"--rounds", "--local-epochs", "--num-clients", "--seed", "--batch-size",
                  "--lr", "--momentum", "--weight-decay", "--eval-every", "--grad-clip",
                  "--min-size", "--beta"}  # fmt: skip


def _setup_paths(where: Path) -> None:
    (where / "exists.file").write_text("x")
    (where / "exists.dir").mkdir()


RUN_BASE = {"--num-clients": "4", "--clients-per-round": "2", "--rounds": "1",
            "--local-epochs": "1", "--workers": "0"}  # fmt: skip


@settings(max_examples=examples(100), **FUZZ)
@given(option_fragments("run"))
def test_run_options(tmp_path, capsys, drawn):
    fragments, any_bad, names = drawn
    base = {k: v for k, v in RUN_BASE.items() if k not in names}
    if "--participation" in names:
        base.pop("--clients-per-round", None)
    argv = ["run", "--quiet", *(f"{k}={v}" for k, v in base.items()), *fragments]
    with fresh_folder(tmp_path) as where:
        _setup_paths(where)
        code, _, err = clean_outcome(argv, capsys)
        if any_bad:
            assert code != 0, (argv, "a plainly bad value gave a valid run")
        if code == 0:
            check_finished_run(where)


@settings(max_examples=examples(60), **FUZZ)
@given(option_fragments("partition"))
def test_partition_options(tmp_path, capsys, drawn):
    fragments, any_bad, names = drawn
    argv = ["partition", *([] if "--num-clients" in names else ["--num-clients=4"]), *fragments]
    with fresh_folder(tmp_path) as where:
        _setup_paths(where)
        code, out, _ = clean_outcome(argv, capsys)
        if any_bad:
            assert code != 0, (argv, "a plainly bad value gave a valid partition")
        if code == 0:
            assert "partition of" in out


# ------------------------------------------------------------------------- config files

JSONISH = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _cheap_value(key: str) -> st.SearchStrategy:
    """Valid values that keep a run tiny, per config key."""
    table = {
        "algorithm": st.sampled_from(sorted(ALGORITHMS)),
        "dataset": st.sampled_from(["digits", "synthetic"]),
        "model": st.sampled_from(["auto", "mlp"]),
        "num_clients": st.integers(2, 6),
        "participation": st.floats(0.3, 1.0),
        "clients_per_round": st.integers(1, 2),
        "partition": st.sampled_from(["iid", "dirichlet", "classes", "shards", "quantity"]),
        "rounds": st.integers(1, 2),
        "local_epochs": st.just(1),
        "batch_size": st.integers(8, 64),
        "lr": st.floats(0.001, 0.5),
        "momentum": st.floats(0.0, 0.9),
        "workers": st.sampled_from([0, 1]),
        "engine": st.just("inprocess"),
        "memory_format": st.sampled_from(["auto", "channels_last", "contiguous"]),
        "precision": st.sampled_from(["fp32", "bf16"]),
        "denormals": st.sampled_from(["flush", "keep"]),
        "local_test_fraction": st.sampled_from([0.0, 0.2]),
        "validation_fraction": st.sampled_from([0.0, 0.2]),
        "on_divergence": st.sampled_from(["stop", "drop"]),
        "partition_params": st.fixed_dictionaries({}, optional={"beta": st.floats(0.1, 5)}),
        "model_options": st.fixed_dictionaries({}, optional={"hidden": st.integers(1, 64)}),
        "params": st.just({}),
        "name": st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1,
                        max_size=8),
        "out_dir": st.sampled_from(["runs", "out/nested"]),
    }  # fmt: skip
    return table.get(key, JSONISH)


def _too_slow(values: dict) -> bool:
    """Valid values that would make a long run: many rounds or epochs, worker processes,
    downloads, Flower, a big model."""

    def num(value) -> float:
        return _float(str(value)) or 0 if isinstance(value, (int, float, str)) else 0

    options = values.get("model_options")
    workers = values.get("workers")
    return (
        num(values.get("rounds")) > 2
        or num(values.get("local_epochs")) > 2
        or num(values.get("num_clients")) > 100
        or (isinstance(workers, str) and workers.strip().lower() == "auto")
        or num(workers) >= 2
        or str(values.get("engine")) in {"flower-sim", "flower"}
        or str(values.get("dataset")) in {"mnist", "fmnist", "cifar10", "cifar100", "tinyimagenet"}
        or str(values.get("model")) == "resnet18"
        or (isinstance(options, dict) and any(num(v) > 512 for v in options.values()))
    )


@st.composite
def config_values(draw) -> dict:
    keys = draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True))
    values = {
        "num_clients": 4, "clients_per_round": 2, "rounds": 1, "local_epochs": 1, "workers": 0,
    }  # fmt: skip
    for key in keys:
        values[key] = draw(st.one_of(_cheap_value(key), JSONISH))
        if key == "participation":
            values.pop("clients_per_round", None)
    if draw(st.integers(0, 9)) == 0:  # an unknown key, or a table with junk keys
        values[draw(st.text(max_size=6))] = draw(JSONISH)
    for table in ("params", "partition_params", "model_options"):
        if draw(st.integers(0, 5)) == 0:
            keys = {"params": PARAM_KEYS, "partition_params": PARTITION_KEYS,
                    "model_options": MODEL_OPTION_KEYS}[table]  # fmt: skip
            values[table] = draw(
                st.dictionaries(st.one_of(st.sampled_from(keys), st.text(max_size=5)),
                                JSONISH, max_size=3)
            )  # fmt: skip
    if draw(st.integers(0, 3)) == 0:  # a well-formed value of the wrong kind
        key = draw(st.sampled_from(sorted(k for k in FIELDS if kind_of(k) in ("int", "text"))))
        values[key] = draw(WRONG_KIND[kind_of(key)])
    assume(not _too_slow(values))
    return values


def kind_of(key: str) -> str:
    """ "int" for integer options, "text" for text and path options, else "other"."""
    kind = str(FIELDS[key].type)
    if kind in ("int", "int | None"):
        return "int"
    if kind in ("str", "str | None"):
        return "text"
    return "other"


# Values a file can hold that are not of the option's kind: a float where an integer
# belongs (rounds = 1e3), a list or a table where text or a path belongs.
WRONG_KIND = {
    "int": st.sampled_from([1.0, 1.5, 2.0, 0.5, 1e3]),
    "text": st.sampled_from([["a", "b"], ["runs"], {"a": 1}, [], {}]),
}


def wrong_kind(values: dict) -> list[str]:
    """The keys of ``values`` whose value is not of the option's kind (WRONG_KIND)."""
    out = []
    for key, value in values.items():
        if key not in FIELDS:
            continue
        if kind_of(key) == "int" and isinstance(value, float):
            out.append(key)
        if kind_of(key) == "text" and isinstance(value, (list, dict)):
            out.append(key)
    return out


def _toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value) -> str | None:
    if value is None:
        return None  # TOML has no null: the key is left out
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return (
            "nan"
            if math.isnan(value)
            else {math.inf: "inf", -math.inf: "-inf"}.get(value, repr(value))
        )
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        items = [v for v in (_toml_value(x) for x in value) if v is not None]
        return "[" + ", ".join(items) + "]"
    items = [(k, _toml_value(v)) for k, v in value.items()]
    return "{" + ", ".join(f"{_toml_string(str(k))} = {v}" for k, v in items if v) + "}"


def write_config(values: dict, suffix: str) -> str:
    if suffix == ".toml":
        lines = [(k, _toml_value(v)) for k, v in values.items()]
        return "".join(f"{_toml_string(str(k))} = {v}\n" for k, v in lines if v is not None)
    if suffix in {".yaml", ".yml"}:
        return yaml.safe_dump(values, allow_unicode=True)
    return json.dumps(values)


@settings(max_examples=examples(80), **FUZZ)
@given(
    config_values(),
    st.sampled_from([".toml", ".yaml", ".yml", ".json"]),
    st.one_of(st.none(), st.tuples(st.integers(0, 10**6), st.binary(max_size=4))),
)
def test_config_files(tmp_path, capsys, values, suffix, damage):
    """Every config key with valid and random values, in every format; sometimes with a
    few bytes of the file replaced."""
    text = write_config(values, suffix).encode("utf-8")
    if damage is not None:
        at, junk = damage
        at %= len(text) + 1
        text = text[:at] + junk + text[at + len(junk) :]
    with fresh_folder(tmp_path) as where:
        path = where / f"experiment{suffix}"
        path.write_bytes(text)
        code, _, _ = clean_outcome(["run", "--quiet", "--config", str(path)], capsys)
        if code == 0:
            if damage is None:
                assert not wrong_kind(values), (values, "a value of the wrong kind was used")
            check_finished_run(where)


def deep(opening: str, closing: str, inner: str = "1") -> st.SearchStrategy[bytes]:
    """A value nested thousands deep (parsers recurse: a RecursionError must not escape)."""
    return st.integers(100, 60_000).map(
        lambda n: (opening * n + inner + closing * n).encode("utf-8")
    )


# Well-formed files that are hard to read: nesting thousands deep in each format, YAML
# aliases expanding exponentially ("billion laughs"), duplicate keys, integers beyond int64.
# Two values for one key: which one a run takes is a guess, so the file is refused.
DUPLICATE_KEYS = [b"rounds: 1\nrounds: 2\n", b'{"rounds": 1, "rounds": 2}', b"a: 1\na: 1\n"]
HOSTILE_CONFIG_TEXT = st.one_of(
    deep('{"rounds": ', "}"),
    deep("[", "]"),
    st.integers(100, 60_000).map(lambda n: b"x = " + b"[" * n + b"1" + b"]" * n),  # TOML
    st.integers(3, 12).map(
        lambda n: (
            "a0: &a0 [x, x]\n"
            + "".join(f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}]\n" for i in range(1, n))
            + f"rounds: *a{n - 1}\n"
        ).encode()
    ),
    st.sampled_from(DUPLICATE_KEYS),
    st.integers(2**63, 2**80).map(lambda n: f'{{"seed": {n}}}'.encode()),
)


@settings(max_examples=examples(40), **FUZZ)
@given(
    st.one_of(st.binary(max_size=200), HOSTILE_CONFIG_TEXT),
    st.sampled_from([".toml", ".yaml", ".json", ".cfg", ""]),
)
def test_config_files_of_random_bytes(tmp_path, capsys, content, suffix):
    with fresh_folder(tmp_path) as where:
        path = where / f"experiment{suffix}"
        path.write_bytes(content)
        code, _, _ = clean_outcome(["run", "--quiet", "--rounds=1", "-c", str(path)], capsys)
        if content in DUPLICATE_KEYS and suffix in (".yaml", ".json"):
            assert code != 0, (content, "a file with a key given twice was used")
        if code == 0:
            check_finished_run(where)


# ------------------------------------------------------------------ partition files


@settings(max_examples=examples(40), **FUZZ)
@given(
    st.one_of(
        st.binary(max_size=100),
        JSONISH.map(lambda v: json.dumps(v).encode()),
        st.lists(st.lists(st.integers(-5, 1500), max_size=400), max_size=5).map(
            lambda v: json.dumps(v).encode()
        ),
        # indices beyond int64, and lists nested thousands deep
        st.lists(
            st.lists(st.one_of(st.integers(0, 1500), st.integers(2**62, 2**80)), max_size=50),
            min_size=1,
            max_size=3,
        ).map(lambda v: json.dumps(v).encode()),
        deep("[", "]"),
    ),
    st.sampled_from([".json", ".npz"]),
)
def test_partition_files(tmp_path, capsys, content, suffix):
    with fresh_folder(tmp_path) as where:
        path = where / f"clients{suffix}"
        path.write_bytes(content)
        argv = ["run", "--quiet", "--rounds=1", "--local-epochs=1", "--workers=0",
                "--clients-per-round=1", f"--partition-file={path}"]  # fmt: skip
        code, _, _ = clean_outcome(argv, capsys)
        if code == 0:
            check_finished_run(where)


# -------------------------------------------------------------- files a resume reads

RESUME_FILES = ["config.json", "partition.npz", "checkpoint.npz", "metrics.jsonl",
                "processes.jsonl"]  # fmt: skip
SMALL = ["--num-clients=4", "--clients-per-round=2", "--local-epochs=1", "--workers=0",
         "--seed=3", "--quiet"]  # fmt: skip


def metrics_without_timing(folder: Path) -> list[dict]:
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.fixture(scope="module")
def unfinished_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """An unfinished 3-round run after its round 2 (made by interrupting it), and the
    metrics of the same run uninterrupted."""
    import fedskew.runs.loop as experiment

    root = tmp_path_factory.mktemp("resume")
    assert main(["run", *SMALL, "--rounds=3", f"--out-dir={root}", "--name=ref"]) == 0
    reference = metrics_without_timing(root / "ref")
    real = experiment.keep_round

    def keep_then_stop(state, rnd, record):
        real(state, rnd, record)
        if rnd == 1:
            raise KeyboardInterrupt

    experiment.keep_round = keep_then_stop
    try:
        code = main(["run", *SMALL, "--rounds=3", f"--out-dir={root}", "--name=cut"])
    finally:
        experiment.keep_round = real
    assert code == 130
    folder = root / "cut.incomplete"
    # The lock file says which process held the folder; a resume reads only the others.
    assert sorted(p.name for p in folder.iterdir()) == sorted([*RESUME_FILES, LOCK])
    return folder, reference


def _damaged(data: bytes, how: str, at: int, junk: bytes, bits: list[int]) -> bytes:
    at %= len(data) + 1
    if how == "truncate":
        return data[:at]
    if how == "replace":
        return data[:at] + junk + data[at + len(junk) :]
    if how == "insert":
        return data[:at] + junk + data[at:]
    if how == "random":
        return junk
    out = bytearray(data)  # bit flips
    for bit in bits:
        if out:
            out[(bit // 8) % len(out)] ^= 1 << (bit % 8)
    return bytes(out)


def _json_edit(data: bytes, key: str, value) -> bytes:
    """config.json with one key set to a random value (a foreign or edited file)."""
    config = json.loads(data)
    config[key] = value
    return json.dumps(config).encode()


@settings(max_examples=examples(100), **FUZZ)
@given(
    name=st.sampled_from(RESUME_FILES),
    how=st.sampled_from(["truncate", "replace", "insert", "random", "flip", "delete", "edit"]),
    at=st.integers(0, 10**6),
    junk=st.binary(min_size=1, max_size=16),
    bits=st.lists(st.integers(0, 10**7), min_size=1, max_size=4),
    edit=st.tuples(
        st.sampled_from(sorted(FIELDS) + ["resolved"]),
        st.one_of(JSONISH, st.sampled_from([0, 1, 2, 5, "fedprox", "x", [], {}])),
    ),
)
def test_resume_reads_damaged_files(tmp_path, capsys, unfinished_run, name, how, at, junk,
                                    bits, edit):  # fmt: skip
    """One file of an unfinished run damaged; resuming gives a clean error, or finishes
    with the metrics of the uninterrupted run (metrics.jsonl damage aside, whose earlier
    lines are the run's record)."""
    source, reference = unfinished_run
    key, value = edit
    if how == "edit":
        assume(name == "config.json")
        if key in {"workers", "engine"}:  # worker processes, Flower: slow, not this test
            assume(value in (0, 1, "x", [], {}, None))
    with fresh_folder(tmp_path) as where:
        folder = where / "run.incomplete"
        shutil.copytree(source, folder)
        target = folder / name
        if how == "delete":
            target.unlink()
        elif how == "edit":
            target.write_bytes(_json_edit(target.read_bytes(), key, value))
        else:
            target.write_bytes(_damaged(target.read_bytes(), how, at, junk, bits))
        code, _, _ = clean_outcome(["run", "--resume", str(folder), "--quiet"], capsys)
        if code != 0:
            return
        finished = where / "run"
        assert (finished / "summary.json").exists()
        rows = metrics_without_timing(finished)
        assert [r["round"] for r in rows] == [1, 2, 3]
        if name == "metrics.jsonl":
            assert rows[2] == reference[2]  # rerun from the checkpoint
        else:
            assert rows == reference


@settings(max_examples=examples(40), **FUZZ)
@given(
    st.one_of(relative_paths(), st.sampled_from(["run.incomplete", "done", "run.incomplete/x"])),
    st.lists(
        st.sampled_from(["--workers=0", "--workers=x", "--data-dir=d", "--quiet", "--lr=0.1",
                         "--seed=1", "--config=c.toml", "--name=n", "--rounds=9"]),
        max_size=2, unique=True,
    ),
)  # fmt: skip
def test_resume_paths_and_options(tmp_path, capsys, unfinished_run, path, extra):
    """--resume with random paths (missing, a file, a finished run, inside a run) and the
    options it may or may not take."""
    source, reference = unfinished_run
    with fresh_folder(tmp_path) as where:
        _setup_paths(where)
        shutil.copytree(source, where / "run.incomplete")
        (where / "done").mkdir()
        (where / "done" / "summary.json").write_text("{}")
        code, _, _ = clean_outcome(["run", f"--resume={path}", *extra], capsys)
        if code == 0:
            assert metrics_without_timing(where / "run") == reference


# ------------------------------------------------- regressions found by the generators


def one_clean_error(argv: list[str], capsys) -> str:
    code, _, err = clean_outcome(argv, capsys)
    assert code in (1, 2) and err.count("\n") == 1, (argv, code, err)
    return err


TINY = ["--num-clients=4", "--clients-per-round=2", "--rounds=1", "--local-epochs=1",
        "--workers=0", "--quiet"]  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [
        ["--algorithm=a\nb"],  # user text with a newline in the message: escaped
        ["--dataset=x\u2028y"],
        ["--name=\u0085"],
    ],
)
def test_errors_quoting_user_text_stay_one_line(tmp_path, capsys, args):
    with fresh_folder(tmp_path):
        one_clean_error(["run", *TINY, *args], capsys)


@pytest.mark.parametrize(
    "args",
    [
        ["--lr=1e39"],  # finite, but torch fails converting it to float32 mid-round
        ["--weight-decay=3.5e38"],
        ["--algorithm=creff", "--param=lr_feature=1e308"],
        ["--algorithm=fedntd", "--param=tau=1e308"],  # OverflowError in tau**2
        ["--algorithm=fedfm", "--param=lam=nan"],  # was a valid run
        ["--algorithm=moon", "--param=tau=inf"],  # was a valid run
        ["--algorithm=fedproto", "--param=ld=nan"],  # was a valid run
        ["--algorithm=fedavg", "--param=server_lr=nan"],  # was a divergence in round 1
    ],
)
def test_non_finite_or_float32_overflowing_values_are_refused(tmp_path, capsys, args):
    with fresh_folder(tmp_path) as where:
        err = one_clean_error(["run", *TINY, *args], capsys)
        assert "finite number" in err
        assert not list(where.rglob("config.json"))  # refused before the run started


def test_float_hyper_parameters_from_a_config_file_are_checked_too(tmp_path, capsys):
    with fresh_folder(tmp_path) as where:
        (where / "c.toml").write_text('algorithm = "fedprox"\n[params]\nmu = nan\n')
        assert "finite number" in one_clean_error(["run", *TINY, "-c", "c.toml"], capsys)


@pytest.mark.parametrize(
    "args",
    [
        ["run", *TINY, "--out-dir=a\x00b"],
        ["run", *TINY, "--data-dir=a\x00b"],
        ["run", *TINY, "--name=a\x00b"],
        ["partition", "--save=a\x00b"],
        ["partition", "--plot=a\x00b"],
    ],
)
def test_nul_in_a_path_is_a_clean_error(tmp_path, capsys, args):
    with fresh_folder(tmp_path):
        one_clean_error(args, capsys)


@pytest.mark.parametrize(
    "args",
    [
        ["run", *TINY, "--name=" + "n" * 300],
        ["run", *TINY, "--out-dir=" + "n" * 300],
        ["run", "--resume=" + "n" * 300 + ".incomplete"],
        ["run", *TINY, "--config=" + "n" * 300 + ".toml"],
        ["partition", "--save=" + "n" * 300],
    ],
)
def test_a_path_the_file_system_refuses_is_a_clean_error(tmp_path, capsys, args):
    with fresh_folder(tmp_path):
        one_clean_error(args, capsys)


@pytest.mark.parametrize(
    "args",
    [
        ["run", "--resume="],  # was a new 30-round run
        ["run", *TINY, "--config="],  # was a run without the config file
        ["partition", "--plot="],  # was no plot, silently
        ["partition", "--save="],
        ["partition", "--save=."],
    ],
)
def test_an_empty_path_is_an_error_not_an_absent_option(tmp_path, capsys, args):
    with fresh_folder(tmp_path) as where:
        one_clean_error(args, capsys)
        assert not list(where.rglob("config.json"))


def test_model_option_of_unicode_digits_is_a_clean_error(tmp_path, capsys):
    with fresh_folder(tmp_path):
        args = ["run", *TINY, "--model=mlp", "--model-option=hidden=\u00b2"]
        assert "hidden" in one_clean_error(args, capsys)  # '²'.isdigit(), but not int('²')


def test_damaged_files_found_by_the_generators(tmp_path, capsys, unfinished_run):
    """processes.jsonl that is not UTF-8 (a traceback at the end of the resumed run) and a
    metrics line that parses but lost a field (a traceback in the summary)."""
    source, reference = unfinished_run
    with fresh_folder(tmp_path) as where:
        folder = where / "a.incomplete"
        shutil.copytree(source, folder)
        (folder / "processes.jsonl").write_bytes(
            b"\x80" + (folder / "processes.jsonl").read_bytes()
        )
        assert clean_outcome(["run", "--resume", str(folder)], capsys)[0] == 0
        assert metrics_without_timing(where / "a") == reference

        folder = where / "b.incomplete"
        shutil.copytree(source, folder)
        metrics = folder / "metrics.jsonl"
        metrics.write_text(metrics.read_text().replace('"bytes_up"', '"bytes_u "', 1))
        err = one_clean_error(["run", "--resume", str(folder)], capsys)
        assert "metrics.jsonl: line 1" in err
