"""Durable writes from several writers at once: each keeps its own temp file, so the file
ends whole (one writer's bytes) and no writer fails on another's rename."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from fedskew.core.durable import remove_stale_temps, temp_name, write_bytes_durably


def test_temp_names_differ_per_write_and_end_in_tmp(tmp_path: Path) -> None:
    target = tmp_path / "compare.json"
    first, second = temp_name(target), temp_name(target)
    assert first != second
    assert first.parent == second.parent == tmp_path
    assert first.name.startswith("compare.json.") and first.name.endswith(".tmp")


def test_concurrent_threads_write_one_file_whole(tmp_path: Path) -> None:
    target = tmp_path / "table.csv"
    payloads = [(f"writer {i}\n" * 2000).encode() for i in range(8)]
    errors: list[BaseException] = []

    def write(data: bytes) -> None:
        try:
            for _ in range(20):
                write_bytes_durably(target, data)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert target.read_bytes() in payloads
    assert list(tmp_path.glob("*.tmp")) == []


def test_concurrent_processes_write_one_file_whole(tmp_path: Path) -> None:
    # Two `fedskew compare` on one grid both rewrite compare.json; with one shared temp name
    # the slower one failed with "compare.json.tmp: No such file or directory".
    target = tmp_path / "compare.json"
    script = (
        "import sys; from pathlib import Path\n"
        "from fedskew.core.durable import write_bytes_durably\n"
        "for _ in range(200): write_bytes_durably(Path(sys.argv[1]), sys.argv[2].encode() * 500)\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(target), tag], stderr=subprocess.PIPE)
        for tag in ("a", "b", "c")
    ]
    failures = [p.stderr.read().decode() for p in procs if p.wait() != 0]
    assert failures == []
    assert target.read_bytes() in {tag.encode() * 500 for tag in ("a", "b", "c")}
    assert list(tmp_path.glob("*.tmp")) == []


def test_stale_temps_of_dead_writers_go_live_ones_stay(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"compare.json.{dead_pid}-0.tmp"
    old_style = tmp_path / "compare.json.tmp"
    live = temp_name(tmp_path / "compare.json")  # this process's: a write in progress
    keep = tmp_path / "compare.json"
    for f in (stale, old_style, live, keep):
        f.write_bytes(b"x")
    remove_stale_temps(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, keep.name])
