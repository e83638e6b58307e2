"""The status page in a real headless Chromium (Debian's chromium and chromedriver, driven by
Selenium; never a downloaded browser), against a real coordinator and real worker processes:

- the members and the ring appear, with each edge's lane and throughput;
- a worker that stops answering (SIGSTOP: a hung process, or a host cut off) turns red, then
  leaves the view, with no reload of the page;
- a job with a token refuses the page without it, and opens it with it.

Marked ``browser`` (deselected by default); ``bash scripts/test_browser.sh`` installs the browser
and runs them. With RINGSERVE_UPDATE_SCREENSHOT=1 the screenshot replaces docs/img/status-page.png.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ringserve import Coordinator, CoordinatorConfig
from ringserve.loop import LoopThread

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = pathlib.Path(__file__).resolve().parent / "status_worker.py"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
HEARTBEAT_TIMEOUT_S = 4.0


def _until(check: Callable[[], Any], what: str, timeout_s: float = 40.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"the page never showed {what}"
        time.sleep(0.2)


@pytest.fixture
def browser(tmp_path: pathlib.Path) -> Iterator[Any]:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.fail(f"{CHROMIUM} and {CHROMEDRIVER} are needed: run scripts/test_browser.sh, which installs them")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not fetch a driver: Debian's is given
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1440,960"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


class Job:
    """A coordinator on its own loop thread, with the status page, and worker processes."""

    def __init__(self, tmp_path: pathlib.Path, **config: Any) -> None:
        self.tmp_path = tmp_path
        self.thread = LoopThread(use_uvloop=False, name="browser-test-coordinator")
        self.coordinator = self.thread.run(Coordinator(CoordinatorConfig(**config)).start(), 30.0)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        assert self.coordinator.status_page is not None
        return self.coordinator.status_page.url

    def start_workers(self, n: int, seconds: float) -> None:
        env = {**os.environ, "RINGSERVE_COORDINATOR": self.coordinator.address, "RINGSERVE_USE_UVLOOP": "0",
               "RINGSERVE_COLLECTIVE_TIMEOUT_S": "60", "RINGSERVE_ELASTIC_TIMEOUT_S": "60",
               "RINGSERVE_RENDEZVOUS_TIMEOUT_S": "60", "OMP_NUM_THREADS": "1"}
        files = [self.tmp_path / f"worker{i}.address" for i in range(n)]
        procs = [subprocess.Popen([sys.executable, str(WORKER), str(f), str(seconds)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=(self.tmp_path / f"worker{i}.log").open("wb"))
                 for i, f in enumerate(files)]
        _until(lambda: all(f.exists() for f in files), "every worker in the world", 60.0)
        self.procs = {f.read_text(): p for f, p in zip(files, procs, strict=True)}

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        try:
            self.thread.run(self.coordinator.stop(0), 10.0)
        finally:
            self.thread.stop()


@pytest.fixture
def job(tmp_path: pathlib.Path) -> Iterator[Job]:
    made: list[Job] = []

    def make(**config: Any) -> Job:
        made.append(Job(tmp_path, **config))
        return made[-1]

    yield make  # type: ignore[misc]
    for j in made:
        j.close()


def _rows(driver: Any) -> list[dict[str, str]]:
    return list(driver.execute_script(
        "return [...document.querySelectorAll('#members tbody tr[data-rank]')].map(r => ({rank: r.dataset.rank,"
        " health: r.dataset.health, address: r.children[2].textContent, lane: r.children[3].textContent}))"))


def _screenshot(browser: Any, directory: pathlib.Path) -> None:
    """The page now, into the test's directory (and the docs' image, when asked to update it)."""
    shot = directory / "status-page.png"
    browser.save_screenshot(str(shot))
    if os.environ.get("RINGSERVE_UPDATE_SCREENSHOT") == "1":
        (ROOT / "docs" / "img").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, ROOT / "docs" / "img" / "status-page.png")


def test_the_page_shows_the_members_and_the_ring_and_a_stopped_worker_turns_red_then_leaves(
        browser: Any, job: Callable[..., Job]) -> None:
    from selenium.webdriver.common.by import By

    world = job(http_port=0, min_workers=2, settle_s=1.0, heartbeat_interval_s=0.5,
                heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    world.start_workers(4, seconds=150)
    browser.get(world.url)
    browser.execute_script("window.loadedOnce = 'yes'")  # gone if the page reloads
    rows = _until(lambda: (r := _rows(browser)) and len(r) == 4 and r, "4 members")
    assert {r["address"] for r in rows} == set(world.procs)
    assert len({r["lane"] for r in rows}) == 1 and rows[0]["lane"] in ("shared memory", "stream")
    _until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#ring g.node")) == 4, "the ring's 4 nodes")
    _until(lambda: [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#ring g.edge text.rate")]
           and all(e.text.endswith("/s") for e in browser.find_elements(By.CSS_SELECTOR, "#ring g.edge text.rate")),
           "each edge's throughput")
    assert sorted((e.get_attribute("data-from"), e.get_attribute("data-to"))
                  for e in browser.find_elements(By.CSS_SELECTOR, "#ring g.edge")) == [("0", "1"), ("1", "2"), ("2", "3"), ("3", "0")]
    _until(lambda: browser.find_elements(By.CSS_SELECTOR, "#chart polyline.line-commits"), "the commit rate chart")
    _until(lambda: browser.find_element(By.ID, "mark").text.startswith("step "), "the committed step")

    victim = next(r for r in rows if r["rank"] == "2")["address"]
    os.kill(world.procs[victim].pid, signal.SIGSTOP)
    try:
        _until(lambda: any(r["address"] == victim and r["health"] == "dead" for r in _rows(browser)),
               "the stopped worker in red", 20.0)
        red = browser.find_element(By.CSS_SELECTOR, "#members tr.dead td.age")
        assert red.value_of_css_property("background-color") == "rgba(212, 61, 61, 1)"
        assert browser.find_elements(By.CSS_SELECTOR, "#ring g.node.dead")
        _screenshot(browser, world.tmp_path)
        _until(lambda: (r := _rows(browser)) and len(r) == 3 and victim not in {x["address"] for x in r},
               "the stopped worker leaving the view", 30.0)
    finally:
        world.procs[victim].kill()
    failed = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#history li.failed")]
    assert any(victim in text and f"silent for more than {HEARTBEAT_TIMEOUT_S:g} s" in text for text in failed), failed
    _until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#ring g.node")) == 3, "a ring of 3")
    assert browser.execute_script("return window.loadedOnce") == "yes", "the page reloaded"


def test_a_job_with_a_token_refuses_the_page_without_it_and_opens_it_with_it(
        browser: Any, job: Callable[..., Job]) -> None:
    from selenium.webdriver.common.by import By

    world = job(http_port=0, token="browser-token-91c2")
    browser.get(world.url)
    assert browser.find_elements(By.CSS_SELECTOR, "form[action='/login'] input[name=token]"), browser.page_source
    assert not browser.find_elements(By.ID, "members")
    refused = browser.execute_async_script(
        "const done = arguments[0]; fetch('/status.json').then(r => done(r.status))")
    assert refused == 401
    box = browser.find_element(By.NAME, "token")
    box.send_keys("not-the-token")
    box.submit()
    _until(lambda: "not the job token" in browser.page_source, "the refusal of a wrong token")
    box = browser.find_element(By.NAME, "token")
    box.send_keys("browser-token-91c2")
    box.submit()
    _until(lambda: browser.find_elements(By.ID, "members"), "the page after signing in")
    _until(lambda: browser.find_element(By.ID, "view-id").text == "none yet", "the status of the job")
    opened = browser.execute_async_script(
        "const done = arguments[0]; fetch('/status.json').then(r => done(r.status))")
    assert opened == 200
