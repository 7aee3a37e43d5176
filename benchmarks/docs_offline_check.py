"""Do the built documentation's equations render in a browser with no network?

Builds the site (``mkdocs build --strict``, the ``docs`` extra) or takes a built one, opens
docs/algorithms.md's page in headless Chromium with the network off, and checks in the page:

- every ``<math>`` element is laid out by the browser as MathML (computed ``display`` is
  ``math`` or ``block math``), and there are as many as the page has equations;
- fractions are stacked (numerator above denominator) and subscripts lowered: the layout of
  MathML, not the characters of its source run together;
- no TeX is left as text (``\\(``, ``\\[``, ``$$``) and no resource came from outside the site.

The network is off through a network namespace of its own (``unshare -n``: only loopback), or,
where that is not allowed, through a proxy address nothing listens on; the output says which.

    python benchmarks/docs_offline_check.py                       # build, then check
    python benchmarks/docs_offline_check.py --site site --screenshot /tmp/algorithms.png

Exit status 0 when every check passes, 1 when one fails, 2 when there is no browser.
tests/test_docs_site.py checks the built HTML without a browser (CI has none).
"""

from __future__ import annotations

import argparse
import html
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = "fedskew-offline-check"

# Runs in the page after it has loaded; writes what it measured into the DOM, which Chromium's
# --dump-dom then prints.
PROBE = """
<script>
window.addEventListener("load", () => {
  const maths = [...document.querySelectorAll("math")];
  const displays = {};
  for (const m of maths) {
    const d = getComputedStyle(m).display;
    displays[d] = (displays[d] || 0) + 1;
  }
  const box = (e) => e.getBoundingClientRect();
  let fractions = 0, unstacked = [];
  for (const f of document.querySelectorAll("mfrac")) {
    fractions++;
    const [num, den] = f.children;
    if (!(box(num).bottom <= box(den).top + 1)) unstacked.push(f.textContent);
  }
  let subscripts = 0, flat = [];
  for (const s of document.querySelectorAll("msub, msubsup")) {
    subscripts++;
    const [base, sub] = s.children;
    const lowered = box(sub).bottom > box(base).bottom;
    const smaller = parseFloat(getComputedStyle(sub).fontSize) <
                    parseFloat(getComputedStyle(base).fontSize);
    if (!(lowered && smaller)) flat.push(s.textContent);
  }
  const text = document.body.innerText;
  const tex = ["\\\\(", "\\\\[", "$$"].filter((t) => text.includes(t));
  const outside = performance.getEntriesByType("resource").map((r) => r.name)
    .filter((n) => !n.startsWith("file:"));
  const pre = document.createElement("pre");
  pre.id = "MARK";
  pre.textContent = JSON.stringify({
    maths: maths.length, displays, fractions, unstacked: unstacked.slice(0, 5),
    unstacked_count: unstacked.length, subscripts, flat: flat.slice(0, 5),
    flat_count: flat.length, tex_left: tex, outside,
    page_equations: Number(document.body.dataset.equations || -1),
  });
  document.body.appendChild(pre);
});
</script>
""".replace("MARK", MARK)


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _offline_prefix() -> tuple[list[str], list[str], str]:
    """Command prefix and extra flags that keep the browser off the network, and how."""
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
        if shutil.which(prefix[0]):
            probe = subprocess.run([*prefix, "true"], capture_output=True)
            if probe.returncode == 0:
                return prefix, [], f"network namespace ({' '.join(prefix)}: loopback only)"
    flags = ["--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
             "--host-resolver-rules=MAP * ~NOTFOUND"]
    return [], flags, "proxy to a closed port and no name resolution (unshare not allowed)"


def build_site(target: Path) -> None:
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                    "--site-dir", str(target)], cwd=ROOT, check=True)


def _browser(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    prefix, flags, _ = _offline_prefix()
    binary = _chromium()
    assert binary is not None
    command = [*prefix, binary, "--headless", "--no-sandbox", "--disable-gpu",
               "--disable-dev-shm-usage", "--no-first-run", *flags, *args]
    env = {**os.environ, "HOME": tempfile.mkdtemp(prefix="chromium-home-")}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--site", type=Path, help="a built site (default: build one now)")
    parser.add_argument("--page", default="algorithms/index.html")
    parser.add_argument("--screenshot", type=Path, help="also write a PNG of the page")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)

    if _chromium() is None:
        print("no Chromium on this machine (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="fedskew-docs-check-"))
    try:
        site = work / "site"
        if args.site:
            shutil.copytree(args.site, site)
        else:
            build_site(site)
        page = site / args.page
        original = page.read_text(encoding="utf-8")
        equations = original.count("<math ")
        probed = original.replace(
            "<body", f'<body data-equations="{equations}"', 1
        ).replace("</body>", PROBE + "</body>", 1)
        page.write_text(probed, encoding="utf-8")
        _, _, how = _offline_prefix()
        done = _browser(["--virtual-time-budget=10000", "--window-size=1280,4000",
                         "--dump-dom", page.as_uri()], args.timeout)
        start = done.stdout.find(f'<pre id="{MARK}">')
        if start < 0:
            print(f"the probe wrote nothing; browser said:\n{done.stderr[-2000:]}",
                  file=sys.stderr)
            return 1
        body = done.stdout[start:].split(">", 1)[1].split("</pre>", 1)[0]
        found = json.loads(html.unescape(body))
        if args.screenshot:
            page.write_text(original, encoding="utf-8")
            shot = _browser(["--virtual-time-budget=10000", "--window-size=1280,6000",
                             f"--screenshot={args.screenshot.resolve()}", page.as_uri()],
                            args.timeout)
            if shot.returncode != 0:
                print(f"screenshot failed: {shot.stderr[-500:]}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    failures = []
    rendered = sum(n for d, n in found["displays"].items() if d in ("math", "block math"))
    if found["maths"] == 0 or found["maths"] != equations:
        failures.append(f"{found['maths']} <math> elements in the browser, {equations} in the HTML")
    if rendered != found["maths"]:
        failures.append(f"not laid out as MathML: computed display {found['displays']}")
    if found["fractions"] == 0 or found["unstacked_count"]:
        failures.append(f"{found['unstacked_count']} of {found['fractions']} fractions not "
                        f"stacked, e.g. {found['unstacked']}")
    if found["subscripts"] == 0 or found["flat_count"]:
        failures.append(f"{found['flat_count']} of {found['subscripts']} subscripts not lowered "
                        f"and smaller, e.g. {found['flat']}")
    if found["tex_left"]:
        failures.append(f"TeX left as text: {found['tex_left']}")
    if found["outside"]:
        failures.append(f"resources from outside the site: {found['outside']}")

    version = subprocess.run([_chromium() or "", "--version"], capture_output=True, text=True)
    print(f"browser: {version.stdout.strip()}; network off by {how}")
    print(f"page: {args.page}; {found['maths']} equations (<math>), computed display "
          f"{found['displays']}; {found['fractions']} fractions, {found['subscripts']} "
          f"subscripts laid out; resources from outside the site: {len(found['outside'])}")
    if args.screenshot:
        print(f"screenshot: {args.screenshot}")
    for failure in failures:
        print(f"FAIL: {failure}")
    print("ok" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
