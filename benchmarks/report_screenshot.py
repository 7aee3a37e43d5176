"""A screenshot of a `fedskew report` HTML page in headless Chromium (Debian's package).

    python benchmarks/report_screenshot.py REPORT.html OUT.png [--width 1280 --height 4000]

Needs `chromium` (`apt-get install -y chromium`). The page is self-contained (pictures as
base64 PNG), so Chromium runs with networking off and a throw-away profile.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
]


def screenshot(page: Path, out: Path, width: int, height: int, timeout: float = 120) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("chromium not found: apt-get install -y chromium")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fedskew-chromium-") as profile:
        cmd = [
            browser,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--screenshot={out.resolve()}",
            f"--window-size={width},{height}",
            page.resolve().as_uri(),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not out.is_file():
        sys.exit(f"chromium failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("page", type=Path, help="the report's .html")
    ap.add_argument("out", type=Path, help="the PNG to write")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=4000)
    args = ap.parse_args()
    screenshot(args.page, args.out, args.width, args.height)
    print(f"screenshot: {args.out}")


if __name__ == "__main__":
    main()
