"""`fedskew report` on folders it cannot trust (issue 40): a report is a file people share,
so it must not leak or run anything, and a damaged input must not stop it.

Hypothesis makes run folders as `fedskew compare` and `fedskew run` lay them out (made by
hand, no training), names them with hostile strings and damages them (cut or garbled JSON,
values of the wrong type, a missing key, a FIFO, a link to a file or a run outside the
folder, a compare.json naming a run outside it). The property: the report exits 0 with
every undamaged run in it and the damaged ones named, or, when no run is left, exits 1
with one ``fedskew: error:`` line; never a traceback; and report.html, report.md and the
LaTeX table carry no markup of the names (no ``<script``, no ``javascript:`` link, no LaTeX
command) and nothing of a file outside the folder. The unit tests after it pin each case.

In the test the pictures are tiny stand-in PNGs (drawing them costs most of a second per
report; hostile labels in pictures have a test of their own). :func:`count_failure_kinds`
runs the same search with the pictures drawn (their text laid out, not rendered to pixels)
and counts the kinds of failure instead of stopping at the first: 26 kinds on the code
before issue 40's fix (300 examples, seed 0), none after.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import stat
import struct
import sys
import tempfile
import threading
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from fake_runs import write_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from matplotlib.figure import Figure
from matplotlib.text import Text

from fedskew.apps import reporting
from fedskew.apps.cli import main
from fedskew.report.document import (
    Link,
    Para,
    markdown_text,
    one_line,
    safe_file_name,
    safe_url,
    to_html,
    to_markdown,
)

SECRET = "SECRET-8c1f0e"  # in every file outside the report's folder
SRC = Path(reporting.__file__).resolve().parents[1]  # src/fedskew
FUZZ = dict(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
EXAMPLES = int(30 * float(os.environ.get("FEDSKEW_FUZZ_SCALE", "1")))


def tiny_png(extra: bytes = b"") -> bytes:
    """A valid 1x1 PNG, ``extra`` appended after its end (readers ignore it)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00\x00"))
        + chunk(b"IEND", b"")
        + extra
    )


# ------------------------------------------------------------------------------ names

HOSTILE = (
    "<script>alert(1)</script>",
    "[x](javascript:alert(1))",
    "<img src=x onerror=alert(1)>",
    '" onmouseover="alert(1)',
    "pipe|in|name",
    "`tick`",
    "```",
    "two\nlines",
    "**bold**",
    "_under_",
    "back\\slash",
    "&lt;script&gt;",
    "\\input{/etc/passwd}",
    "\\write18{id}",
    "50% & $x$ #1 {a} ~ ^",
    "$\\frac{1}{0}$",
    "$\\nosuchcommand$",
    "]",
    "\u202egnp.exe",
    "javascript:alert(1)",
    "<javascript:alert(1)>",
    "data:text/html,<script>alert(1)</script>",
    "# heading",
    "- item",
    "é ü 中文",
    "x" * 120,
    "\udcff",  # a folder name that is not UTF-8, as Python spells it
)
# Names only a JSON file can hold (a NUL, a lone surrogate, a slash).
JSON_ONLY = ("nul\x00byte", "\ud800", "a/b", "../..", "")


def _folder_safe(name: str) -> bool:
    try:
        size = len(os.fsencode(name))
    except UnicodeEncodeError:  # a lone surrogate that is no byte of a file name
        return False
    return "/" not in name and "\x00" not in name and name not in ("", ".", "..") and size <= 150


TEXT = st.text(st.characters(exclude_characters="/\x00"), min_size=1, max_size=8)
FOLDER_NAMES = (
    st.lists(st.one_of(st.sampled_from(HOSTILE), TEXT), min_size=1, max_size=2)
    .map("".join)
    .filter(_folder_safe)
)
JSON_NAMES = st.one_of(FOLDER_NAMES, st.sampled_from(JSON_ONLY), st.text(max_size=10))


# ---------------------------------------------------------------------------- folders


@dataclass
class Folder:
    """A generated report folder and what its report must show."""

    root: Path
    layout: str
    runs: list[Path] = field(default_factory=list)  # every run folder, damaged or not
    damaged: set[Path] = field(default_factory=set)  # to be left out and named
    manifest: dict | None = None

    @property
    def expected(self) -> int:
        return len(self.runs) - len(self.damaged)


def write_extras(folder: Path, classes: list[str], reason: str, cpu: str) -> None:
    """What real runs also record: per-class accuracy, class names, an inactive mechanism,
    the machine, a t-SNE picture."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["num_clients"] = 4  # a small partition heatmap
    config["resolved"] = {
        "class_names": classes,
        "inactive_mechanisms": [{"mechanism": "m", "options": {"k": reason}, "reason": reason}],
    }
    path.write_text(json.dumps(config))
    path = folder / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for i, row in enumerate(rows):
        row.update(bytes_down=1000, bytes_up=500, seconds=0.1, clients=[0, 1])
        row["per_class_accuracy"] = [0.5, None, 0.1 * i]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    process = {"from_round": 1, "cpu": cpu, "cores": 2, "git_commit": reason, "torch": cpu}
    (folder / "processes.jsonl").write_text(json.dumps(process) + "\n")
    (folder / "tsne.png").write_bytes(tiny_png())


def make_outside(base: Path) -> Path:
    """Files outside the report's folder, each holding SECRET where a report would show
    it: a JSON file, a metrics file, a PNG and a run folder (its algorithm)."""
    outside = base / "outside"
    (outside / "run").mkdir(parents=True)
    (outside / "secret.json").write_text(json.dumps({"final_accuracy": 0.5, "x": SECRET}))
    (outside / "secret.png").write_bytes(tiny_png(SECRET.encode()))
    line = {"round": 1, "accuracy": 0.5, SECRET: 0.5}  # an extra metric: a table shows it
    (outside / "secret.jsonl").write_text(json.dumps(line) + "\n")
    write_run(outside / "run" / "elsewhere-s0", SECRET, [50, 60])  # algorithm SECRET
    return outside


@st.composite
def folders(draw, base: Path) -> Folder:
    layout = draw(st.sampled_from(["flat", "settings", "compare", "single"]))
    root = base / draw(FOLDER_NAMES)
    if layout != "single":
        root.mkdir()
    names = draw(st.lists(FOLDER_NAMES, min_size=1, max_size=2, unique=True))
    settings = draw(st.lists(FOLDER_NAMES, min_size=1, max_size=2, unique=True))
    folder = Folder(root, layout)
    entries = []
    for i, name in enumerate(names):
        for seed in range(draw(st.integers(1, 2))):
            if layout == "single":
                where = root
            elif layout == "flat":
                where = root / f"{name}-s{seed}"
            else:
                where = root / settings[i % len(settings)] / f"{name}-s{seed}"
            if where.exists():
                continue
            write_run(where, name, [40 + seed, 50, 45 + 10 * i], seed=seed)
            classes = [draw(JSON_NAMES) for _ in range(3)]
            write_extras(where, classes, draw(JSON_NAMES), draw(JSON_NAMES))
            folder.runs.append(where)
            entries.append(
                {
                    "setting": draw(JSON_NAMES),
                    "method": draw(JSON_NAMES),
                    "seed": seed,
                    "folder": where.relative_to(root).as_posix(),
                }
            )
            if layout == "single":
                return folder
    if layout == "compare":
        folder.manifest = {
            "format": "fedskew-compare-1",
            "reference": entries[0]["method"],
            "last": 10,
            "target": None,
            "runs": entries,
        }
        (root / "compare.json").write_text(json.dumps(folder.manifest))
    return folder


# --------------------------------------------------------------------------- damages

# (file, key, wrong values) the report reads as a number, a list or an object.
WRONG_TYPES = {
    ("config.json", "seed"): ["x", 1.5, None, [], True],
    ("config.json", "rounds"): ["3", None, {}],
    ("config.json", "params"): ["mu=1", [1]],
    ("config.json", "resolved"): ["x", [1]],
    ("summary.json", "last_k_per_class_accuracy"): ["x", ["a", "b", "c"], {"0": 1}],
    ("summary.json", "per_class_last_k"): ["x"],
    ("metrics.jsonl", "round"): ["x", None, 1.5, [1]],
    ("metrics.jsonl", "accuracy"): ["x", [0.5], {}],
    ("metrics.jsonl", "bytes_down"): ["x", None, []],
    ("metrics.jsonl", "seconds"): ["x", None],
    ("metrics.jsonl", "clients"): [5, "ab", {"a": 1}],
    ("metrics.jsonl", "per_class_accuracy"): ["x", [0.1, "y", 0.3], [0.1], 7],
    ("metrics.jsonl", "client_accuracy"): ["x", [0.5, "y"]],
    ("processes.jsonl", "from_round"): ["x", None, 1.5],
}
GARBLES = ("cut", "bytes", "utf8", "list", "string", "number", "null", "deep", "bigint")


def garbled(how: str, text: str) -> bytes:
    return {
        "cut": text[: max(1, len(text) // 2)].encode(),
        "bytes": b"\x00\xff{]]garbage",
        "utf8": b'{"seed": "\xff\xfe"}',
        "list": b"[1, 2]",
        "string": b'"text"',
        "number": b"7",
        "null": b"null",
        "deep": b"[" * 100_000 + b"]" * 100_000,
        "bigint": b'{"seed": ' + b"9" * 5000 + b"}",
    }[how]


def damage(draw, folder: Folder, outside: Path) -> None:
    """One damage to one run folder, or to the folder's compare.json."""
    kinds = ["garble", "garble line", "wrong type", "no round", "fifo", "link", "run link"]
    kinds += ["harmless"]
    if folder.manifest is not None:
        kinds += ["manifest garble", "manifest types", "manifest outside"]
    kind = draw(st.sampled_from(kinds))
    # One damage to a run at most: the files of a damaged run are no longer what a later
    # damage expects (and a linked run is the outside run).
    runs = [r for r in folder.runs if r not in folder.damaged]
    if not runs:
        return
    run = draw(st.sampled_from(runs))
    if kind == "garble":
        name = draw(st.sampled_from(["config.json", "summary.json"]))
        path = run / name
        path.write_bytes(garbled(draw(st.sampled_from(GARBLES)), path.read_text()))
        folder.damaged.add(run)
    elif kind == "garble line":
        path = run / draw(st.sampled_from(["metrics.jsonl", "processes.jsonl"]))
        path.write_bytes(b"{not json\n" + path.read_bytes())
        folder.damaged.add(run)
    elif kind == "wrong type":
        (name, key), values = draw(st.sampled_from(sorted(WRONG_TYPES.items(), key=str)))
        value = draw(st.sampled_from(values))
        path = run / name
        if name.endswith(".jsonl"):
            rows = [json.loads(x) for x in path.read_text().splitlines()]
            rows[draw(st.integers(0, len(rows) - 1))][key] = value
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            data = json.loads(path.read_text())
            data[key] = value
            path.write_text(json.dumps(data))
        folder.damaged.add(run)
    elif kind == "no round":
        path = run / "metrics.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        del rows[0]["round"]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        folder.damaged.add(run)
    elif kind == "fifo":
        name = draw(
            st.sampled_from(
                ["config.json", "summary.json", "metrics.jsonl", "processes.jsonl",
                 "partition.npz", "tsne.png"]
            )
        )  # fmt: skip
        (run / name).unlink(missing_ok=True)
        os.mkfifo(run / name)
        if name != "tsne.png":
            folder.damaged.add(run)
    elif kind == "link":
        name, target = draw(
            st.sampled_from(
                [("config.json", "run/elsewhere-s0/config.json"),
                 ("summary.json", "secret.json"), ("metrics.jsonl", "secret.jsonl"),
                 ("tsne.png", "secret.png"), ("t-sne-extra.png", "secret.png")]
            )
        )  # fmt: skip
        (run / name).unlink(missing_ok=True)
        (run / name).symlink_to(outside / target)
        if not name.endswith(".png"):
            folder.damaged.add(run)
    elif kind == "run link" and run != folder.root:
        shutil.rmtree(run)
        run.symlink_to(outside / "run" / "elsewhere-s0", target_is_directory=True)
        folder.damaged.add(run)
    elif kind == "manifest garble":
        path = folder.root / "compare.json"
        path.write_bytes(garbled(draw(st.sampled_from(GARBLES)), path.read_text()))
    elif kind == "manifest types":
        key, value = draw(
            st.sampled_from(
                [("runs", "x"), ("runs", [1]), ("last", "x"), ("last", -3), ("target", "x"),
                 ("reference", 5), ("runs", [{"folder": 5}]), ("format", None)]
            )
        )  # fmt: skip
        folder.manifest[key] = value
        (folder.root / "compare.json").write_text(json.dumps(folder.manifest))
    elif kind == "manifest outside" and isinstance(folder.manifest.get("runs"), list):
        target = draw(st.sampled_from(["../outside/run", str(outside / "run"), ".."]))
        entry = {"setting": "", "method": "outside", "seed": 0, "folder": f"{target}/elsewhere-s0"}
        folder.manifest["runs"].append(entry)
        (folder.root / "compare.json").write_text(json.dumps(folder.manifest))


# --------------------------------------------------------------------------- the run


@dataclass
class Outcome:
    code: int | None
    err: str
    raised: str | None = None  # a traceback out of main: "Type at file:function"
    stopped: str | None = None  # the error behind a non-zero exit, same form
    hung: str | None = None  # where the report waited on a FIFO


def place(exc: BaseException) -> str:
    """``Type at file:function`` of the innermost frame in fedskew's source."""
    where = "?"
    for frame in traceback.extract_tb(exc.__traceback__):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(SRC):
            where = f"{path.relative_to(SRC).as_posix()}:{frame.name}"
    return f"{type(exc).__name__} at {where}"


def _fake_savefig(self: Figure, fname, *args, **kwargs) -> None:
    """Lay out every text that Matplotlib could read as mathematics (where a label that is
    not plain text fails) and write a tiny PNG instead of rendering pixels."""
    renderer = self.canvas.get_renderer()
    for text in self.findobj(Text):
        if "$" in text.get_text():
            text.get_window_extent(renderer)
    if hasattr(fname, "write"):
        fname.write(tiny_png())
    else:
        Path(fname).write_bytes(tiny_png())


def _release_fifos(base: Path, stop: threading.Event, where: list[str]) -> None:
    """While the report runs: a FIFO under ``base`` that can be opened for writing has a
    reader, the report waiting on it (a read that does not block, as
    fedskew.report.files makes, holds it for microseconds and is not counted): note where
    the report waits and release it (the reader gets an empty file)."""
    main_thread = threading.main_thread()
    while not stop.wait(0.25):
        for dirpath, _, files in os.walk(base):
            for name in files:
                path = os.path.join(dirpath, name)
                try:
                    if not stat.S_ISFIFO(os.lstat(path).st_mode):
                        continue
                    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:  # gone, or no reader
                    continue
                frame = sys._current_frames().get(main_thread.ident)
                stack = traceback.extract_stack(frame) if frame is not None else []
                inside = [f for f in stack if Path(f.filename).resolve().is_relative_to(SRC)]
                place = "?"
                if inside:
                    found = Path(inside[-1].filename).resolve().relative_to(SRC).as_posix()
                    place = f"{found}:{inside[-1].name}"
                if place != "report/files.py:read_bytes":
                    where.append(place)
                os.close(fd)


def _cheap_figures(monkeypatch) -> None:
    """The pictures of a report as a tiny PNG each, the dataset read once per process: what
    the report makes of hostile labels in pictures is tested on its own
    (test_pictures_take_labels_as_plain_text); here it would cost most of the time."""
    from fedskew.report import per_class

    for module, name in ((reporting, "curves_png"), (reporting, "partition_png"),
                         (per_class, "per_class_png")):  # fmt: skip
        monkeypatch.setattr(module, name, lambda *args, **kwargs: tiny_png())
    monkeypatch.setattr(reporting, "load_experiment_data", _cached_dataset)


_DATASETS: dict[str, object] = {}


def _cached_dataset(cfg):
    key = repr((cfg.dataset, cfg.seed))
    if key not in _DATASETS:
        from fedskew.assembly.prepare import load_experiment_data

        _DATASETS[key] = load_experiment_data(cfg)
    return _DATASETS[key]


def run_report(
    root: Path, out: Path, base: Path, capsys, monkeypatch, figures: bool = False
) -> Outcome:
    """The command line on ``root``; ``figures``: draw the pictures (their text laid out,
    not rendered), else tiny PNGs in their place."""
    seen: list[BaseException] = []
    real = reporting.make_report

    def spy(*args, **kwargs):
        try:
            return real(*args, **kwargs)
        except BaseException as exc:
            seen.append(exc)
            raise

    monkeypatch.setattr(reporting, "make_report", spy)
    if figures:
        monkeypatch.setattr(Figure, "savefig", _fake_savefig)
    else:
        _cheap_figures(monkeypatch)
    capsys.readouterr()
    stop, hung = threading.Event(), []
    watchdog = threading.Thread(target=_release_fifos, args=(base, stop, hung), daemon=True)
    watchdog.start()
    try:
        code = main(["report", str(root), "-o", str(out), "--latex"])
        raised = None
    except Exception as exc:  # the property's failure: recorded, judged by the caller
        code, raised = None, place(exc)
    finally:
        stop.set()
        watchdog.join()
    err = capsys.readouterr().err
    stopped = place(seen[0]) if seen and code not in (0, None) else None
    return Outcome(code, err, raised, stopped, hung[0] if hung else None)


# ----------------------------------------------------------------------- the checks

ALLOWED_TAGS = {
    "html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "h4", "h5", "h6",
    "p", "ul", "li", "table", "thead", "tbody", "tr", "th", "td", "figure", "img",
    "figcaption", "pre", "code", "strong", "a",
}  # fmt: skip


def safe_link(url: str) -> bool:
    """http(s) or a relative link (what a report may point to)."""
    cleaned = re.sub(r"[\x00-\x20\x7f]", "", url)
    scheme = urlsplit(cleaned).scheme.lower()
    return scheme in ("", "http", "https") and not cleaned.startswith("//")


class _Tags(HTMLParser):
    """Every tag and attribute of a page; ``embedded``: pictures are data: URLs (report.html)
    rather than relative links (report.md)."""

    def __init__(self, embedded: bool = True) -> None:
        super().__init__(convert_charrefs=True)
        self.embedded = embedded
        self.problems: list[str] = []
        self.styles = 0
        self.images: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in ALLOWED_TAGS:
            self.problems.append(f"<{tag}> in the page")
        self.styles += tag == "style"
        for name, value in attrs:
            value = value or ""
            if name.startswith("on"):
                self.problems.append(f"{name}= attribute")
            if name == "href" and not safe_link(value):
                self.problems.append(f"href to {value.split(':')[0]}:")
            if name == "src" and not self.embedded:
                if tag != "img" or not safe_link(value) or not value.startswith("report_files/"):
                    self.problems.append(f"src={value[:20]}")
            elif name == "src":
                if tag != "img" or not value.startswith("data:image/png;base64,"):
                    self.problems.append(f"src={value[:20]}")
                else:
                    self.images.append(value.split(",", 1)[1])


def html_problems(page: str) -> tuple[list[str], list[bytes]]:
    parser = _Tags()
    parser.feed(page)
    problems = parser.problems + (["more than one <style>"] if parser.styles > 1 else [])
    if re.search(r"<\s*script", page, re.IGNORECASE):
        problems.append("<script in report.html")
    return problems, [base64.b64decode(x) for x in parser.images]


def markdown_problems(text: str) -> list[str]:
    """What a Markdown renderer (CommonMark, raw HTML allowed, tables) makes of the text."""
    from markdown_it import MarkdownIt

    page = MarkdownIt("commonmark", {"html": True}).enable("table").render(text)
    parser = _Tags(embedded=False)
    parser.feed(page)
    problems = [f"report.md renders {p}" for p in parser.problems]
    if re.search(r"<\s*script", page, re.IGNORECASE):
        problems.append("report.md renders <script")
    return problems


LATEX_COMMANDS = re.compile(
    r"\\(input|include|write|immediate|openout|openin|read|def|catcode|csname|frac)\b"
)


def latex_problems(tex: str) -> list[str]:
    problems = []
    if LATEX_COMMANDS.search(tex):
        problems.append(f"LaTeX command from a name: {LATEX_COMMANDS.search(tex).group(0)}")
    body = tex.split("\\begin{tabular}", 1)[-1].split("\\end{tabular}", 1)[0]
    if "\n\n" in body:
        problems.append("blank line inside the LaTeX table")
    unescaped = re.sub(r"\\.", "", tex)  # \{ \} \\ and the like
    if unescaped.count("{") != unescaped.count("}"):
        problems.append("unbalanced braces in the LaTeX table")
    return problems


def violations(folder: Folder, outcome: Outcome, out: Path) -> list[str]:
    """Each way the outcome breaks the property, as a short kind (empty: it holds)."""
    found = []
    if outcome.hung:
        found.append(f"waited on a FIFO at {outcome.hung}")
    if outcome.raised:
        return found + [f"traceback: {outcome.raised}"]
    errors = [x for x in outcome.err.splitlines() if x.startswith("fedskew: error:")]
    if outcome.code != 0:
        if len(errors) != 1 or "Traceback" in outcome.err:
            found.append(f"exit {outcome.code} without exactly one error line")
        if folder.expected:
            found.append(f"stopped with usable runs left: {outcome.stopped}")
        return found
    if folder.expected == 0:
        found.append("exit 0 with no usable run")
    page = (out / "report.html").read_text(encoding="utf-8")
    md = (out / "report.md").read_text(encoding="utf-8")
    tex = (out / "report.tex").read_text(encoding="utf-8")
    runs = re.search(r"<h2>Runs</h2>\s*<table>.*?<tbody>(.*?)</tbody>", page, re.DOTALL)
    rows = runs.group(1).count("<tr>") if runs else 0
    if rows > folder.expected:
        found.append("a damaged run reported as a run")
    elif rows < folder.expected:
        found.append("an undamaged run left out")
    warnings = [x for x in outcome.err.splitlines() if x.startswith("fedskew: warning:")]
    named = re.search(r"<h2>Left out</h2>.*?<ul>(.*?)</ul>", page, re.DOTALL)
    if folder.damaged and (not named or named.group(1).count("<li>") < len(folder.damaged)):
        found.append("a damaged run not named in the report")
    if folder.damaged and len(warnings) < len(folder.damaged):
        found.append("a damaged run not named on stderr")
    problems, images = html_problems(page)
    found += problems + markdown_problems(md) + latex_problems(tex)
    files = [p.read_bytes() for p in out.rglob("*") if p.is_file()]
    if any(SECRET.encode() in data for data in [*files, *images]):
        found.append("content of a file outside the folder in the report")
    return found


@settings(max_examples=EXAMPLES, **FUZZ)
@given(data=st.data())
def test_report_of_damaged_and_hostile_folders(data, capsys, monkeypatch, tmp_path):
    base = Path(tempfile.mkdtemp(dir=tmp_path))
    try:
        outside = make_outside(base)
        folder = data.draw(folders(base))
        for _ in range(data.draw(st.integers(0, 2))):
            damage(data.draw, folder, outside)
        outcome = run_report(folder.root, base / "out", base, capsys, monkeypatch)
        assert violations(folder, outcome, base / "out") == [], outcome.err
    finally:
        shutil.rmtree(base, ignore_errors=True)


FIRST: dict[str, str] = {}  # kind -> the first example that showed it (for a look by hand)


def count_failure_kinds(examples: int, seed: int = 0, figures: bool = True) -> dict[str, int]:
    """Run the fuzz without stopping at the first failure: how often each kind of failure
    (exception type and place, or the part of the property broken) came up, the first
    example of each in FIRST. From tests/: ``python -c 'import test_report_safety as t;
    print(t.count_failure_kinds(300))'``; for the code before the fix, from a copy of this
    file cut before the unit tests (they import what the fix added)."""
    from hypothesis import Phase
    from hypothesis import seed as hseed

    kinds: dict[str, int] = {}

    @hseed(seed)
    @settings(max_examples=examples, phases=[Phase.generate], **FUZZ)
    @given(data=st.data())
    def probe(data):
        base = Path(tempfile.mkdtemp())
        with pytest.MonkeyPatch.context() as monkeypatch:
            try:
                outside = make_outside(base)
                folder = data.draw(folders(base))
                for _ in range(data.draw(st.integers(0, 2))):
                    damage(data.draw, folder, outside)
                outcome = run_report(
                    folder.root, base / "out", base, _Capture(), monkeypatch, figures
                )
                for kind in violations(folder, outcome, base / "out"):
                    kinds[kind] = kinds.get(kind, 0) + 1
                    FIRST.setdefault(kind, f"{folder}\n{outcome.err}")
            finally:
                shutil.rmtree(base, ignore_errors=True)

    probe()
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


class _Capture:
    """capsys's readouterr outside pytest: what the command line wrote to stderr."""

    def __init__(self) -> None:
        import io

        self.buffer = io.StringIO()
        self.old: Callable | None = None

    def readouterr(self):
        if self.old is None:
            self.old = sys.stderr
            sys.stderr = self.buffer
            return None
        sys.stderr = self.old
        self.old = None
        text, self.buffer = self.buffer.getvalue(), type(self.buffer)()

        class Out:
            err = text

        return Out


# ------------------------------------------------------------------------ each case


def _grid(root: Path, names=("fedavg", "fedprox")) -> list[Path]:
    """Two methods, one seed each, as `fedskew compare` lays them out without settings."""
    runs = []
    for i, name in enumerate(names):
        folder = write_run(root / f"{name}-s0", name, [40, 50 + i])
        write_extras(folder, ["a", "b", "c"], "reason", "cpu")
        runs.append(folder)
    return runs


def _report(root: Path, tmp_path: Path, capsys, monkeypatch) -> tuple[Outcome, str, str]:
    outcome = run_report(root, tmp_path / "out", tmp_path, capsys, monkeypatch)
    assert outcome.raised is None and outcome.hung is None, outcome
    if outcome.code != 0:
        return outcome, "", ""
    out = tmp_path / "out"
    return outcome, (out / "report.md").read_text(), (out / "report.html").read_text()


def _rows(page: str) -> int:
    found = re.search(r"<h2>Runs</h2>\s*<table>.*?<tbody>(.*?)</tbody>", page, re.DOTALL)
    return found.group(1).count("<tr>") if found else 0


DAMAGES: dict[str, Callable[[Path], None]] = {
    "summary.json not JSON": lambda f: (f / "summary.json").write_text('{"final_accuracy": 0.'),
    "config.json a list": lambda f: (f / "config.json").write_text("[1, 2]"),
    "config.json seed a string": lambda f: (f / "config.json").write_text('{"seed": "x"}'),
    "metrics.jsonl round 'x'": lambda f: (f / "metrics.jsonl").write_text(
        '{"round": "x", "accuracy": 0.5}\n'
    ),
    "metrics.jsonl accuracy a string": lambda f: (f / "metrics.jsonl").write_text(
        '{"round": 1, "accuracy": "0.5"}\n'
    ),
    "metrics.jsonl without round": lambda f: (f / "metrics.jsonl").write_text(
        '{"accuracy": 0.5}\n'
    ),
    "metrics.jsonl garbled line": lambda f: (f / "metrics.jsonl").write_text(
        '{"round": 1, "accuracy": 0.5}\n{garbage\n{"round": 2, "accuracy": 0.6}\n'
    ),
    "summary.json per-class list of strings": lambda f: (f / "summary.json").write_text(
        '{"last_k_per_class_accuracy": ["a", "b", "c"], "per_class_last_k": 2}'
    ),
    "processes.jsonl from_round a string": lambda f: (f / "processes.jsonl").write_text(
        '{"from_round": "x"}\n'
    ),
    "partition.npz not a partition": lambda f: (f / "partition.npz").write_bytes(b"PK\x03\x04"),
    "metrics.jsonl a value nested 900 deep": lambda f: (f / "metrics.jsonl").write_text(
        '{"round": 1, "accuracy": ' + "[" * 900 + "]" * 900 + "}\n"
    ),
    "metrics.jsonl nested past the parser": lambda f: (f / "metrics.jsonl").write_text(
        '{"round": 1}\n{"round": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n{}\n"
    ),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_file_leaves_its_run_out_named(damage, tmp_path, capsys, monkeypatch):
    root = tmp_path / "grid"
    good, bad = _grid(root)
    DAMAGES[damage](bad)
    outcome, md, page = _report(root, tmp_path, capsys, monkeypatch)
    assert outcome.code == 0, outcome.err
    warnings = [x for x in outcome.err.splitlines() if x.startswith("fedskew: warning:")]
    assert len(warnings) == 1 and "run fedprox-s0 left out" in warnings[0], outcome.err
    assert "## Left out" in md and "run fedprox\\-s0 left out" not in md
    assert "run fedprox-s0 left out" in md
    assert _rows(page) == 1 and "fedavg" in page


def test_a_damaged_compare_json_is_named_and_the_runs_found_by_name(tmp_path, capsys, monkeypatch):
    root = tmp_path / "grid"
    _grid(root)
    (root / "compare.json").write_text('{"format": "fedskew-compare-1", "runs": [')
    outcome, md, page = _report(root, tmp_path, capsys, monkeypatch)
    assert outcome.code == 0 and "compare record compare.json is not JSON" in outcome.err
    assert "looked for by name" in md and _rows(page) == 2


def test_nothing_usable_is_one_error_line(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "run-s0", "fedavg", [40, 50])
    (run / "summary.json").write_text("{")
    outcome, _, _ = _report(run, tmp_path, capsys, monkeypatch)
    assert outcome.code == 1
    assert outcome.err.splitlines() == [
        "fedskew: error: no usable run in "
        f"{run}: run run-s0 left out: run summary summary.json is not JSON "
        "(Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"
    ]


def test_a_metrics_line_cut_at_the_end_is_not_damage(tmp_path, capsys, monkeypatch):
    """A run killed mid-write (or being written now) leaves a last line without its end."""
    root = tmp_path / "grid"
    _, running = _grid(root)
    with open(running / "metrics.jsonl", "a") as fh:
        fh.write('{"round": 3, "accur')
    outcome, md, page = _report(root, tmp_path, capsys, monkeypatch)
    assert outcome.code == 0 and "warning" not in outcome.err and _rows(page) == 2


def test_links_out_of_the_folder_and_fifos_are_not_read(tmp_path, capsys, monkeypatch):
    outside = make_outside(tmp_path)
    root = tmp_path / "grid"
    linked, fifo, _ = _grid(root, ("linked", "fifo", "fine"))
    (linked / "summary.json").unlink()
    (linked / "summary.json").symlink_to(outside / "secret.json")
    (fifo / "metrics.jsonl").unlink()
    os.mkfifo(fifo / "metrics.jsonl")
    (root / "fine-s0" / "tsne.png").unlink()
    (root / "fine-s0" / "tsne.png").symlink_to(outside / "secret.png")
    (root / "elsewhere-s0").symlink_to(outside / "run" / "elsewhere-s0")
    outcome, md, page = _report(root, tmp_path, capsys, monkeypatch)
    assert outcome.code == 0, outcome.err
    assert _rows(page) == 1  # fine-s0, without its picture
    err = outcome.err
    assert "run summary linked-s0/summary.json leads outside" in err
    assert "metrics file fifo-s0/metrics.jsonl is not a regular file" in err
    assert "picture fine-s0/tsne.png leads outside" in err
    assert "run elsewhere-s0 leads outside" in err
    files = [p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert not any(SECRET.encode() in data for data in files)
    assert not [p for p in (tmp_path / "out").rglob("*tsne*")]  # the picture not copied


def test_a_compare_record_naming_a_run_outside_is_not_read(tmp_path, capsys, monkeypatch):
    make_outside(tmp_path)
    root = tmp_path / "grid"
    runs = _grid(root)
    manifest = {
        "format": "fedskew-compare-1",
        "reference": "fedavg",
        "runs": [
            *({"setting": "", "method": r.name[:-3], "seed": 0, "folder": r.name} for r in runs),
            {"setting": "", "method": "x", "seed": 0, "folder": "../outside/run/elsewhere-s0"},
        ],
    }
    (root / "compare.json").write_text(json.dumps(manifest))
    outcome, md, page = _report(root, tmp_path, capsys, monkeypatch)
    assert outcome.code == 0 and _rows(page) == 2 and SECRET not in page
    assert "compare.json names the run folder '../outside/run/elsewhere-s0'" in outcome.err


HOSTILE_METHODS = [
    "<script>alert(1)</script>",
    "[x](javascript:alert(1))",
    "pipe|name",
    "`tick`",
    "two\nlines",
    '" onmouseover="alert(1)',
    "\\input{/etc/passwd} [1] 100% $x$",
]


def test_names_are_escaped_for_each_format(tmp_path, capsys, monkeypatch):
    root = tmp_path / "grid"
    runs = _grid(root, [f"m{i}" for i in range(len(HOSTILE_METHODS))])
    manifest = {
        "format": "fedskew-compare-1",
        "reference": HOSTILE_METHODS[0],
        "runs": [
            {"setting": "<b>s|1</b>", "method": name, "seed": 0, "folder": run.name}
            for name, run in zip(HOSTILE_METHODS, runs, strict=True)
        ],
    }
    (root / "compare.json").write_text(json.dumps(manifest))
    outcome, md, page = _report(root, tmp_path, capsys, monkeypatch)
    assert outcome.code == 0, outcome.err
    tex = (tmp_path / "out" / "report.tex").read_text()
    assert html_problems(page)[0] == [] and markdown_problems(md) == []
    assert latex_problems(tex) == []
    # Shown as written: HTML entities, Markdown backslashes, LaTeX's own commands.
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "pipe|name" in page
    assert "&quot; onmouseover=&quot;alert(1)" in page and "two lines" in page
    assert "\\<script\\>alert(1)\\</script\\>" in md and "[x\\](javascript:alert(1))" in md
    assert "| pipe\\|name |" in md and "\\`tick\\`" in md
    assert "\\textbackslash{}input\\{/etc/passwd\\} {[}1{]} 100\\% \\$x\\$" in tex
    assert "\\textless{}script\\textgreater{}" in tex
    # Every row of a Markdown table has as many cells as its header.
    for table in re.findall(r"(?:^\|.*\|$\n?)+", md, re.MULTILINE):
        widths = {len(re.findall(r"(?<!\\)\|", line)) for line in table.splitlines()}
        assert len(widths) == 1, table


def test_links_go_only_to_http_or_relative_addresses():
    for bad in ("javascript:alert(1)", " JaVaScRiPt:alert(1)", "java\tscript:x", "data:text/html,x",
                "vbscript:x", "file:///etc/passwd", "//evil.example", "\\\\evil\\share",
                "javascript&colon;alert(1)"):  # fmt: skip
        assert safe_url(bad) is None, bad
        blocks = [Para(["see ", Link("here", bad)])]
        assert "href" not in to_html(blocks, "t") and "](" not in to_markdown(blocks, "f")[0]
    assert safe_url("https://example.org/a b") == "https://example.org/a%20b"
    assert safe_url("report_files/x.png") == "report_files/x.png"
    blocks = [Para(Link("docs", "https://example.org/(x)"))]
    assert '<a href="https://example.org/%28x%29">docs</a>' in to_html(blocks, "t")
    assert "[docs](https://example.org/%28x%29)" in to_markdown(blocks, "f")[0]


@settings(max_examples=150, deadline=None, database=None)
@given(text=st.text(max_size=30) | st.lists(st.sampled_from(HOSTILE), max_size=3).map("".join))
def test_markdown_escape_shows_the_characters(text):
    """A CommonMark renderer shows escaped text as the characters it holds (control
    characters as spaces), in a paragraph and in a table cell."""
    from html import unescape

    from markdown_it import MarkdownIt

    renderer = MarkdownIt("commonmark", {"html": True}).enable("table")
    shown = one_line(text).strip()
    page = renderer.render(markdown_text(text) + "\n")
    assert unescape(re.sub(r"</?p>\n?", "", page)).strip() == shown, page
    table = renderer.render(f"| h |\n|---|\n| {markdown_text(text, in_table=True)} |\n")
    cell = re.search(r"<td>(.*?)</td>", table, re.DOTALL)
    assert unescape(cell.group(1) if cell else "").strip() == shown, table


def test_picture_file_names_are_safe_and_distinct():
    taken: set[str] = set()
    names = [safe_file_name(n, taken) for n in ("a/b.png", "a_b.png", "../x\x00.png", "é" * 300)]
    assert names == ["a_b.png", "a_b-2.png", "x.png", "picture.png"]


def test_pictures_take_labels_as_plain_text():
    """Matplotlib would typeset a label between two $ (and stop at an unknown command),
    leave out of a legend a line whose label starts with _ (a legend of none fails), and
    refuse a lone surrogate (a folder name that is not UTF-8)."""
    import numpy as np
    from fake_runs import record

    from fedskew.report.per_class_plot import per_class_png
    from fedskew.report.plots import curves_png, partition_png

    odd = ["$\\nosuchcommand$", "_under", "\ud800", "a$b$c", "<script>"]
    png = per_class_png(np.full((3, 3), 50.0), odd[:3], odd[:3], "$\\frac{$")
    assert png.startswith(b"\x89PNG")
    assert curves_png([record(odd[1], 0, [40, 50])], title=odd[2]).startswith(b"\x89PNG")
    assert partition_png(np.array([[1, 2, 3], [3, 2, 1]]), odd[0], odd[:3]).startswith(b"\x89PNG")


def test_a_dataset_named_by_reference_is_not_imported(tmp_path, capsys, monkeypatch):
    """config.json may name a dataset ``module:loader``: a run imports and calls it, a report
    (of a folder someone shared) does not."""
    (tmp_path / "evilmod.py").write_text(
        "import pathlib\npathlib.Path('imported').write_text('x')\n"
        "def loader(**kwargs):\n    pathlib.Path('called').write_text('x')\n"
    )
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "grid"
    for folder in _grid(root):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "dataset": "evilmod:loader"}))
    outcome, md, _ = _report(root, tmp_path, capsys, monkeypatch)
    assert outcome.code == 0, outcome.err
    assert not (tmp_path / "imported").exists() and not (tmp_path / "called").exists()
    assert "is not built into fedskew, and a report runs no code" in md


def test_the_report_writes_nothing_through_a_link(tmp_path, capsys, monkeypatch):
    """The report goes into the folder by default: links left there under its names are
    replaced, not written through."""
    root = tmp_path / "grid"
    _grid(root)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "page").write_text("mine")
    (root / "report_files").symlink_to(elsewhere, target_is_directory=True)
    (root / "report.html").symlink_to(elsewhere / "page")
    _cheap_figures(monkeypatch)
    assert main(["report", str(root)]) == 0
    assert sorted(p.name for p in elsewhere.iterdir()) == ["page"]
    assert (elsewhere / "page").read_text() == "mine"
    assert (root / "report_files").is_dir() and not (root / "report_files").is_symlink()


def test_an_attachments_link_text_is_escaped_in_markdown():
    """A table's file name made from a setting name keeps its underscores and brackets as
    text: the link to it renders no emphasis or extra markup (found by the fuzz above)."""
    from fedskew.report.document import Attachment, to_markdown

    md, _ = to_markdown(
        [Attachment("per-class-_x_javascript_alert_1_-_item.tex", "x", "As a LaTeX table")],
        "report_files",
    )
    assert markdown_problems(md) == []
    assert "_x_javascript" in md.replace("\\", "")
