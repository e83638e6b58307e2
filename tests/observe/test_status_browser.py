"""The status page in a real headless Chromium (Debian's chromium and chromedriver, driven by
Selenium; never a downloaded browser), against a real coordinator and real worker processes:

- the members and the ring appear; the edges are the pairs the plan exchanges over (under the
  default ``auto``, halving-doubling's at a world of 4), each labelled with its throughput, the
  labels clear of each other and of the nodes;
- the page fits from 420 px (no sideways scroll) to a wide screen (the members table whole at
  1024 px), and a history row's time never runs into its badge, whatever the font size;
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

from ringserve import Coordinator, CoordinatorConfig, topology
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
        env = {k: v for k, v in os.environ.items() if k != "RINGSERVE_ALGORITHM"}  # the default: auto
        env = {**env, "RINGSERVE_COORDINATOR": self.coordinator.address, "RINGSERVE_USE_UVLOOP": "0",
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


# The page redraws once a second, replacing the ring's and the tables' elements: an element found
# by one call may be gone by the next (StaleElementReferenceException). So each look at the page
# is one script, which runs whole between two redraws, and returns plain values.
_LOOK = """
const box = (e) => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
const all = (q) => [...document.querySelectorAll(q)];
return {
  rows: all('#members tbody tr[data-rank]').map(r => ({rank: r.dataset.rank, health: r.dataset.health,
    address: r.children[2].textContent, lane: r.children[3].textContent,
    age_background: getComputedStyle(r.children[5]).backgroundColor})),
  nodes: all('#ring g.node').map(g => ({rank: g.dataset.rank, health: g.classList[1], box: box(g.querySelector('circle'))})),
  edges: all('#ring g.edge').map(g => [g.dataset.from, g.dataset.to]),
  labels: all('#ring g.label').map(g => ({edge: [g.dataset.from, g.dataset.to], text: g.textContent,
    box: box(g.querySelector('rect')), fill: getComputedStyle(g.querySelector('rect')).fill})),
  labels_above_lines: !!document.querySelector('#ring g.edges ~ g.nodes ~ g.labels'),
  mark: document.getElementById('mark').textContent,
  commit_chart: all('#chart polyline.line-commits').length > 0,
  failed: all('#history li.failed').map(li => li.textContent),
};
"""

# The widths the page is laid out at: the page's and the members table's, and whether a history
# row's time ends before its badge starts.
_FIT = """
const table = document.getElementById('members'), box = table.parentElement;
const rows = [...document.querySelectorAll('#history li')];
return {
  viewport: window.innerWidth, page: document.documentElement.scrollWidth,
  table: table.getBoundingClientRect().right, table_box: box.getBoundingClientRect().right,
  table_scroll: box.scrollWidth, table_client: box.clientWidth,
  history: rows.length, clashes: rows.filter(li => li.querySelector('.when').getBoundingClientRect().right
    > li.querySelector('.kind').getBoundingClientRect().left).map(li => li.textContent),
};
"""


def _look(driver: Any) -> dict[str, Any]:
    return dict(driver.execute_script(_LOOK))


def _at_width(driver: Any, width: int) -> dict[str, Any]:
    """The page laid out ``width`` CSS pixels wide (0: the window's own width again)."""
    if width:
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False})
    else:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    # Laid out anew, and redrawn at least once (a poll answered) at this width.
    driver.execute_async_script("const done = arguments[0]; setTimeout(done, 1500)")
    return dict(driver.execute_script(_FIT))


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _screenshot(browser: Any, directory: pathlib.Path) -> None:
    """The page now, into the test's directory (and the docs' image, when asked to update it)."""
    shot = directory / "status-page.png"
    browser.save_screenshot(str(shot))
    if os.environ.get("RINGSERVE_UPDATE_SCREENSHOT") == "1":
        (ROOT / "docs" / "img").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, ROOT / "docs" / "img" / "status-page.png")


def test_the_page_shows_the_members_and_the_plans_edges_fits_any_width_and_a_stopped_worker_turns_red_then_leaves(
        browser: Any, job: Callable[..., Job]) -> None:
    world = job(http_port=0, min_workers=2, settle_s=1.0, heartbeat_interval_s=0.5,
                heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    world.start_workers(4, seconds=150)
    browser.get(world.url)
    browser.execute_script("window.loadedOnce = 'yes'")  # gone if the page reloads
    # A member's lane shows once its heartbeat carries its links, a beat or two after it joined,
    # and a link starts as a stream until the shared-memory ring its peer offers is mapped.
    page = _until(lambda: (p := _look(browser)) and len(p["rows"]) == 4 and len(p["nodes"]) == 4
                  and len({r["lane"] for r in p["rows"]} - {"–"}) == 1 and all(r["lane"] != "–" for r in p["rows"])
                  and p, "4 members, each with the same lane")
    assert {r["address"] for r in page["rows"]} == set(world.procs)
    assert page["rows"][0]["lane"] in ("shared memory", "stream")

    # auto runs this 256 KiB allreduce by halving-doubling at a world of 4 on one host: each rank
    # exchanges with its partners at distance 1 and 2, 8 edges. The ring's pings and the measure's
    # other pairs (every pair of 4, once) sent when the view formed, and are not drawn once the
    # rates show that only the plan's pairs carry the traffic.
    plan = sorted((str(r), str(p)) for r in range(4) for p in topology.hd_peers(4, r))
    assert len(plan) == 8
    page = _until(lambda: (p := _look(browser)) and sorted(map(tuple, p["edges"])) == plan
                  and sorted(tuple(x["edge"]) for x in p["labels"]) == plan
                  and all(x["text"].endswith("/s") and x["text"] != "0 B/s" for x in p["labels"]) and p,
                  "the plan's 8 edges, each with its throughput")
    assert page["labels_above_lines"]
    assert all(x["fill"] == "rgb(255, 255, 255)" for x in page["labels"])  # opaque: no line shows through
    labels = page["labels"]
    clash = [(a["edge"], b["edge"]) for i, a in enumerate(labels) for b in labels[i + 1:] if _overlap(a["box"], b["box"])]
    assert not clash, clash
    assert not [(x["edge"], n["rank"]) for x in labels for n in page["nodes"] if _overlap(x["box"], n["box"])]
    _until(lambda: _look(browser)["commit_chart"], "the commit rate chart")
    _until(lambda: _look(browser)["mark"].startswith("step "), "the committed step")

    wide = _at_width(browser, 1024)
    assert wide["viewport"] == 1024 and wide["page"] <= 1024, wide
    assert wide["table_scroll"] <= wide["table_client"] and wide["table"] <= wide["table_box"], wide  # whole
    narrow = _at_width(browser, 420)
    assert narrow["viewport"] == 420 and narrow["page"] <= 420, narrow
    # A time in a large font (a reader's minimum font size, or a zoom of the text alone).
    browser.execute_script("document.styleSheets[0].insertRule('ol.history .when { font-size: 24px }', "
                           "document.styleSheets[0].cssRules.length)")
    for width in (420, 1440):
        fit = _at_width(browser, width)
        assert fit["history"] >= 2 and not fit["clashes"], (width, fit)
    browser.execute_script("document.styleSheets[0].deleteRule(document.styleSheets[0].cssRules.length - 1)")
    _at_width(browser, 0)

    victim = next(r for r in page["rows"] if r["rank"] == "2")["address"]
    os.kill(world.procs[victim].pid, signal.SIGSTOP)
    try:
        page = _until(lambda: (p := _look(browser)) and any(r["address"] == victim and r["health"] == "dead"
                                                            for r in p["rows"]) and p,
                      "the stopped worker in red", 20.0)
        red = next(r for r in page["rows"] if r["address"] == victim)
        assert red["age_background"] == "rgb(212, 61, 61)", red
        assert [n["rank"] for n in page["nodes"] if n["health"] == "dead"] == [red["rank"]]
        _screenshot(browser, world.tmp_path)
        _until(lambda: (r := _look(browser)["rows"]) and len(r) == 3 and victim not in {x["address"] for x in r},
               "the stopped worker leaving the view", 30.0)
    finally:
        world.procs[victim].kill()
    failed = _look(browser)["failed"]
    assert any(victim in text and f"silent for more than {HEARTBEAT_TIMEOUT_S:g} s" in text for text in failed), failed
    _until(lambda: len(_look(browser)["nodes"]) == 3, "a ring of 3")
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
