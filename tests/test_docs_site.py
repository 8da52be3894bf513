"""The built documentation site, as a reader sees it: headless Chromium with the network blocked.

``make test`` builds the site (``mkdocs build --strict``, which executes the notebooks) and passes
its folder in ``OPTCLIP_DOCS_SITE``; without it the first test that needs the site builds one.
Chromium comes from Debian's ``chromium`` package, which ``make test`` installs when missing.
"""

from __future__ import annotations

import html
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FORMULAS = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$", re.S)
# nbconvert's markup for a cell's output and for a figure it shows (the page's CSS has neither).
OUTPUT = re.compile(r'<div class="[^"]*\bjp-OutputArea-output\b')
FIGURE = re.compile(r'<img [^>]*src="data:image/png;base64,')

# Injected into a copy of a built page: once the page has loaded, record what the browser laid
# out, so that --dump-dom returns measurements instead of the page's static markup.
PROBE = """
<script>
window.addEventListener("load", () => {
  const math = [...document.querySelectorAll("math")];
  const report = {
    mathml: typeof MathMLElement !== "undefined",
    sizes: math.map((m) => { const r = m.getBoundingClientRect(); return [r.width, r.height]; }),
    mathml_elements: math.filter((m) => m instanceof MathMLElement).length,
    raw_tex: /\\\\\\(|\\\\\\[|\\$\\$/.test(document.body.innerText),
    resources: performance.getEntriesByType("resource").map((e) => e.name),
  };
  const out = document.createElement("pre");
  out.id = "optclip-probe";
  out.textContent = JSON.stringify(report);
  document.body.appendChild(out);
});
</script>
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    given = os.environ.get("OPTCLIP_DOCS_SITE")
    if given:
        path = pathlib.Path(given).resolve()
        assert (path / "index.html").is_file(), f"OPTCLIP_DOCS_SITE={given} holds no built site"
        return path
    path = tmp_path_factory.mktemp("site")
    mkdocs = pathlib.Path(sys.executable).with_name("mkdocs")
    subprocess.run([str(mkdocs), "build", "--strict", "--quiet", "--site-dir", str(path)],
                   cwd=ROOT, check=True)
    return path


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    pytest.fail("headless Chromium is needed: `make test` installs Debian's `chromium` package "
                "(apt-get install -y chromium)")


def offline_chromium(*args: str) -> subprocess.CompletedProcess:
    """Run headless Chromium with every network request refused."""
    command = [chromium(), "--headless", "--no-sandbox", "--disable-gpu",
               "--disable-dev-shm-usage", "--no-first-run", "--allow-file-access-from-files",
               "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND",
               "--virtual-time-budget=5000", "--window-size=1280,2000", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


def probe(page: pathlib.Path) -> dict:
    copy = page.with_name("_optclip_probe.html")
    copy.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    try:
        dom = offline_chromium("--dump-dom", copy.as_uri()).stdout
    finally:
        copy.unlink()
    found = re.search(r'<pre id="optclip-probe">(.*?)</pre>', dom, re.S)
    assert found, "the page's load event never ran in Chromium"
    return json.loads(html.unescape(found[1]))


def test_formulas_render_offline(site, tmp_path):
    source = (ROOT / "docs" / "clipping.md").read_text()
    expected = len(FORMULAS.findall(source))
    assert expected >= 20  # the page's formulas: inline $...$ and display $$...$$

    page = site / "clipping" / "index.html"
    built = page.read_text()
    assert built.count("<math") == expected
    assert "arithmatex" not in built and "mathjax" not in built.lower()

    report = probe(page)
    assert report["mathml"], "this Chromium has no native MathML"
    assert report["mathml_elements"] == expected
    assert all(w > 0 and h > 0 for w, h in report["sizes"]), report["sizes"]
    assert not report["raw_tex"], "raw TeX delimiters are visible on the page"
    assert all(url.startswith("file:") for url in report["resources"]), report["resources"]

    shot = tmp_path / "clipping.png"
    offline_chromium(f"--screenshot={shot}", page.as_uri())
    assert shot.stat().st_size > 10_000


@pytest.mark.parametrize("name", ["quickstart", "taming_loss_spikes"])
def test_notebook_pages_show_their_outputs(site, name):
    page = (site / "notebooks" / name / "index.html").read_text()
    assert len(FIGURE.findall(page)) >= 1, "no figure on the page"
    assert len(OUTPUT.findall(page)) >= 3, "the notebook was not executed"
    assert "Traceback (most recent call last)" not in page


def test_api_reference_renders_docstrings(site):
    page = (site / "api" / "index.html").read_text()
    text = html.unescape(re.sub(r"<[^>]+>", " ", page))
    assert not re.search(r":(func|class|meth|data):", text), "a Sphinx role is printed literally"
    assert "``" not in text
    # Roles naming a public transform became links to its entry on the same page.
    assert 'href="#optclip.hist_clip"' in page
    # A Returns section whose text mentions other objects keeps its type and description apart.
    entry = page[page.index('id="optclip.ema_criterion"'):]
    returns = re.search(r"Returns:.*?<tbody>(.*?)</tbody>", entry, re.S)[1]
    cells = [html.unescape(re.sub(r"<[^>]+>", "", c)).split() for c in
             re.findall(r"<td[^>]*>(.*?)</td>", returns, re.S)]
    assert cells[0] == ["Criterion"], cells
    assert " ".join(cells[1]).startswith("A Criterion for hist_clip"), cells
    # Long signatures are formatted one parameter per line.
    signature = re.search(r'id="optclip.zclip".*?doc-signature.*?<code>(.*?)</code>', page, re.S)[1]
    assert html.unescape(re.sub(r"<[^>]+>", "", signature)).count("\n") >= 10
