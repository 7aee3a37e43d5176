"""The names modules had before the packages by layer still import, as the moved modules
themselves, with a DeprecationWarning naming the new place."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from fedskew.core.moved_modules import MOVED, new_names

SRC = Path(__file__).resolve().parents[1] / "src"


def _fresh_import(name: str):
    sys.modules.pop(name, None)
    with pytest.warns(DeprecationWarning, match=f"{name} moved to"):
        return importlib.import_module(name)


SPLIT = {o for o, targets in MOVED.items() if len(targets) > 1}


@pytest.mark.parametrize("old", sorted(o for o in MOVED if o not in {"fedskew.flower_app", *SPLIT}))
def test_an_old_name_is_the_moved_module(old):
    (new,) = MOVED[old]
    moved = importlib.import_module(new)
    assert _fresh_import(old) is moved
    assert moved.__spec__.name == new  # the import of the old name left the module as it was


def test_the_old_name_of_a_split_module_answers_for_all_its_parts():
    assert SPLIT == {"fedskew.algorithms.local"}
    from fedskew.training import aggregation, local

    old = _fresh_import("fedskew.algorithms.local")
    assert old.train_client is local.train_client
    assert old.weighted_average is aggregation.weighted_average
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        old.nothing  # noqa: B018


def test_no_old_name_is_still_a_file():
    for old in MOVED:
        relative = Path(*old.split("."))
        assert not (SRC / relative.with_suffix(".py")).exists(), old
        assert not (SRC / relative).is_dir(), old


def test_a_submodule_of_a_moved_package_is_not_run_twice():
    assert new_names("fedskew.engine.workers") == ("fedskew.engines.workers",)
    import fedskew.engines.workers as workers

    assert _fresh_import("fedskew.engine.workers") is workers


def test_names_that_did_not_move_are_left_to_the_ordinary_import():
    assert new_names("fedskew.config") is None
    assert new_names("fedskew.algorithms.fedavg") is None
    assert new_names("fedskew.engines") is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("fedskew.no_such_module")


def test_code_written_against_the_old_names_runs(tmp_path):
    """An own algorithm as the earlier docs showed it, in a fresh interpreter."""
    script = tmp_path / "old_style.py"
    script.write_text(
        "import warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "try:\n"
        "    import fedskew.protocol\n"
        "except DeprecationWarning as w:\n"
        "    print('warned:', w)\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "from fedskew.algorithm_interface import ClientContext\n"
        "from fedskew.algorithms.local import train_client, weighted_average\n"
        "from fedskew.errors import UsageError\n"
        "from fedskew.training.interface import ClientContext as New\n"
        "assert ClientContext is New\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "warned: fedskew.protocol moved to fedskew.training.protocol" in done.stdout
    assert done.stdout.strip().endswith("ok")


def test_the_old_flower_app_entry_points_resolve():
    pytest.importorskip("flwr")
    import fedskew.apps.flower as flower

    old = _fresh_import("fedskew.flower_app")
    assert old.server_app is flower.server_app and old.client_app is flower.client_app
