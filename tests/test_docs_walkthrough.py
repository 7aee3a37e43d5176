"""benchmarks/docs_walkthrough.py walks the shell commands of docs/tracking.md, privacy.md and
flower.md (slow: minutes, and servers). Here, fast: every command of those pages is planned
(run with what its page promises, or skipped with a reason), the extraction keeps
continuations and heredocs whole, and the committed result is of the current plan."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import docs_walkthrough as walk  # noqa: E402

sys.path.remove(str(ROOT / "benchmarks"))


def test_every_command_of_the_pages_is_run_or_skipped_with_a_reason():
    missing, stale = walk.unplanned()
    assert not missing, [c.key for c in missing]
    assert not stale, stale
    for key, plan in walk.PLAN.items():
        if plan.skip:
            assert len(plan.skip) > 20, key  # a reason, not a flag
        elif not key.startswith("cat > "):  # writing a file the next command reads
            assert plan.checks, f"{key}: run without anything its page promises"


def test_extraction_keeps_continuations_and_heredocs_whole(tmp_path, monkeypatch):
    page = tmp_path / "docs" / "p.md"
    page.parent.mkdir()
    page.write_text(
        "text\n\n```bash\n# a comment\nfedskew run -a fedavg \\\n    -r 3   # note\n"
        "cat > g.toml <<'EOF'\n[compare]\n# not a comment here\nEOF\nls\n```\n\n"
        "```python\nprint(1)\n```\n"
    )
    monkeypatch.setattr(walk, "ROOT", tmp_path)
    cmds = walk.commands(page)
    assert [c.key for c in cmds] == ["fedskew run -a fedavg -r 3", "cat > g.toml <<'EOF'", "ls"]
    assert cmds[1].text == "cat > g.toml <<'EOF'\n[compare]\n# not a comment here\nEOF"


@pytest.mark.slow
def test_the_documented_commands_give_what_the_pages_say(tmp_path):
    assert walk.main(["--out", str(tmp_path / "walk.md")]) == 0, (tmp_path / "walk.md").read_text()
