"""The manual: `mkdocs build --strict` passes, and the built site works in a real headless Chromium.

The site is served over http://127.0.0.1 from a thread (the search index is fetched by a web worker,
which file:// does not allow). Chromium and chromedriver come from the system's packages
(`apt-get install chromium chromium-driver`; `.ci/run` installs them); without them the browser test
is skipped, except under CI, where it fails.
"""

import functools
import http.server
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

if importlib.util.find_spec("mkdocs") is None:  # an optional extra: pip install -e '.[docs]'
    pytest.skip("mkdocs is not installed (pip install -e '.[docs]')", allow_module_level=True)

import yaml  # noqa: E402  (mkdocs' own dependency)

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def _mkdocs(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run = _mkdocs(ROOT / "mkdocs.yml", out)
    assert run.returncode == 0, run.stdout + run.stderr
    return out


def test_manual_builds_strict_with_every_page(site):
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = []
    stack = list(config["nav"])
    while stack:
        item = stack.pop()
        value = next(iter(item.values())) if isinstance(item, dict) else item
        stack.extend(value) if isinstance(value, list) else pages.append(value)
    on_disk = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == set(pages), "every page is in the nav, and every nav entry exists"
    for page in pages:
        stem = page[: -len(".md")]
        html = (
            site / (stem[: -len("index")] if stem.endswith("index") else stem + "/") / "index.html"
        )
        assert html.is_file(), page
    api = (site / "reference/api/index.html").read_text()
    for name in ("GpuCachedLoader", "JpegCache", "set_epoch", "state_dict", "RandomResizedCrop"):
        assert name in api  # generated from the docstrings


def _config_with(tmp_path: Path, page: str) -> Path:
    """The project's mkdocs.yml (same theme, plugins and strictness) over a one-page manual."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(page)
    config.update(
        docs_dir=str(docs),
        nav=["index.md"],
        hooks=[str(ROOT / hook) for hook in config.get("hooks", [])],
    )
    python = config["plugins"][1]["mkdocstrings"]["handlers"]["python"]
    python["paths"] = [str(ROOT)]
    path = tmp_path / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    "page, message",
    [
        ("# Home\n\nSee [the loader](guides/no-such-page.md).\n", "no-such-page.md"),
        ("# Home\n\n::: gpucache.NoSuchName\n", "gpucache.NoSuchName"),
    ],
)
def test_broken_link_or_api_reference_fails_the_build(tmp_path, page, message):
    run = _mkdocs(_config_with(tmp_path, page), tmp_path / "site")
    assert run.returncode != 0 and message in run.stdout + run.stderr, run.stdout + run.stderr


@pytest.fixture()
def served(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture()
def browser(tmp_path):
    missing = [n for n, p in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)) if not p]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (pip install -e '.[docs]')")
    if missing:
        reason = f"needs {', '.join(missing)}: apt-get install -y chromium chromium-driver"
        if os.environ.get("CI"):
            pytest.fail(reason + " (.ci/run installs them)")
        pytest.skip(reason)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1280,900",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def test_index_renders_and_search_finds_a_page(served, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 60)
    browser.get(served)
    assert "gpucache" in browser.title
    wait.until(EC.text_to_be_present_in_element((By.CSS_SELECTOR, "article h1"), "gpucache"))
    nav = browser.find_element(By.CSS_SELECTOR, "nav.md-nav--primary").get_attribute("textContent")
    assert "Getting started" in nav and "Coming from torchvision" in nav
    theme = browser.execute_script(
        "return getComputedStyle(document.querySelector('.md-header')).position"
    )
    assert theme in ("sticky", "fixed"), "the theme's stylesheet is applied"

    box = wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, "input.md-search__input")))
    box.click()  # the header's search box, as a reader would
    box.send_keys("decompression bomb")
    link = wait.until(
        EC.element_to_be_clickable(
            (By.CSS_SELECTOR, ".md-search-result__list a[href*='guides/bad-input']")
        )
    )
    link.click()
    wait.until(EC.url_contains("guides/bad-input"))
    wait.until(EC.text_to_be_present_in_element((By.CSS_SELECTOR, "article h1"), "Bad input"))
    assert "decompression bomb" in browser.find_element(By.CSS_SELECTOR, "article").text


def test_readme_is_a_front_page_whose_test_command_is_ci():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 200
    commands = [line for line in readme[:10] if line.startswith("python3 -m venv")]
    assert len(commands) == 2 and "pipelines.train_example" in commands[0]
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert commands[1] == ci, "README command 2 is exactly what .ci/run runs"
    for target in re.findall(r"\]\((docs/[^)#]+)", "\n".join(readme)):
        assert (ROOT / target).is_file(), target


PROJECT_WORDS = {
    "silent",
    "silently",
    "equivalent",
    "equivalents",
    "aws_session_token",
}  # an env variable


def test_docs_speak_only_of_the_project():
    pattern = re.compile(r"\w*(issue [0-9]|engineer|session|the user asked|lent)\w*", re.I)
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for match in pattern.finditer(path.read_text()):
            assert match.group(0).lower() in PROJECT_WORDS, f"{path.name}: {match.group(0)!r}"
