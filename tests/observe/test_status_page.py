"""The coordinator's status page over real HTTP: what /status.json shows of a running world, and
that the page asks for the job's token and TLS and changes nothing. (The page itself, in a real
browser: test_status_browser.py.)"""

from __future__ import annotations

import asyncio
import ssl
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from ringserve import Coordinator, CoordinatorConfig, InvalidArgumentError
from ringserve.commits import Commit
from ringserve.coordinator import http as http_page
from ringserve.coordinator.http import COOKIE, cookie_value

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "security"))
from _secure import Pki, make_pki
from worlds import World, start_world

pytestmark = pytest.mark.timeout(90)
TOKEN = "page-token-4b1d"
RING3 = {(0, 1), (1, 2), (2, 0)}


async def _until(read: Callable[[], Awaitable[dict[str, Any]]], ok: Callable[[dict[str, Any]], bool],
                 timeout_s: float = 20.0) -> dict[str, Any]:
    """Polls ``read`` until ``ok`` holds for its answer, within ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        got = await read()
        if ok(got):
            return got
        assert asyncio.get_running_loop().time() < deadline, f"the page never showed it; last: {got}"
        await asyncio.sleep(0.2)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _json(http: aiohttp.ClientSession, url: str, **kwargs: Any) -> dict[str, Any]:
    async with http.get(url + "status.json", **kwargs) as answer:
        assert answer.status == 200, await answer.text()
        return dict(await answer.json())


async def test_status_json_shows_the_members_their_lanes_the_ring_edges_with_throughput_and_the_history(
        http: aiohttp.ClientSession) -> None:
    # The ring, whatever the links measure: recursive doubling leaves an edge of the ring idle.
    world = await start_world(3, coordinator={"http_port": 0}, algorithm="ring")
    try:
        url = world.coordinator.status_page.url
        stop = asyncio.Event()

        async def traffic() -> None:
            while not stop.is_set():
                await world.each(lambda w: w.allreduce(np.ones(1 << 16, np.float32)))

        task = asyncio.ensure_future(traffic())
        try:
            page = await _until(lambda: _json(http, url),
                                lambda s: all(e["bytes_per_s"] for e in s["edges"] if (e["from"], e["to"]) in RING3)
                                and {(e["from"], e["to"]) for e in s["edges"]} >= RING3)
        finally:
            stop.set()
            await task
        for worker in world.workers:
            worker.report_committed(Commit(0, 7), view=worker.view_id, now=True)
        page = await _until(lambda: _json(http, url), lambda s: s["mark"] is not None and
                            all(m["committed_step"] == 7 for m in s["members"]))
    finally:
        await world.close()
    assert [m["rank"] for m in page["members"]] == [0, 1, 2]
    assert {m["address"] for m in page["members"]} == {w.address for w in world.workers}
    lanes = {m["lane"] for m in page["members"]}
    assert lanes <= {"shared memory", "stream"} and len(lanes) == 1, lanes
    # The ring's edges, with their throughput; any other edge is a link a worker opened beside
    # the ring (RINGSERVE_ALGORITHM=auto measures the links to its partners once per view).
    ring = [e for e in page["edges"] if (e["from"], e["to"]) in RING3]
    assert sorted((e["from"], e["to"]) for e in ring) == sorted(RING3)
    assert all(e["lane"] in lanes and e["bytes_per_s"] > 0 for e in ring)
    assert all(e["from"] != e["to"] and e["lane"] in lanes for e in page["edges"])
    assert page["mark"] == {"step": 7, "lineage": 0}
    assert page["view_size"] == 3 and page["heartbeat_timeout_s"] == 5.0
    assert all(0 <= m["heartbeat_age_s"] < 5.0 and m["collectives"] > 0 for m in page["members"])
    kinds = [e["kind"] for e in page["history"]]
    assert kinds[:2] == ["view", "joined"], page["history"]
    assert any(p["collectives_per_s"] > 0 for p in page["chart"]), page["chart"]


async def test_a_stalled_collective_is_shown_as_the_stall_inspector_names_it(http: aiohttp.ClientSession) -> None:
    world = await start_world(3, coordinator={"http_port": 0}, stall_warning_s=0.3)
    try:
        url = world.coordinator.status_page.url
        a = np.ones(8, np.float32)
        early = [asyncio.ensure_future(w.allreduce(a, op="sum", name="grad.w")) for w in world.workers[:2]]
        page = await _until(lambda: _json(http, url), lambda s: bool(s["stalls"]))
        await world.workers[2].allreduce(a, op="sum", name="grad.w")
        await asyncio.gather(*early)
        cleared = await _until(lambda: _json(http, url), lambda s: not s["stalls"])
    finally:
        await world.close()
    assert page["stalls"] == ["'grad.w#1': ranks 2 have not submitted it; ranks 0, 1 wait"]
    assert cleared["stalls"] == []


async def test_a_worker_that_leaves_is_in_the_history_and_out_of_the_members(http: aiohttp.ClientSession) -> None:
    world = await start_world(3, coordinator={"http_port": 0, "min_workers": 2})
    try:
        url = world.coordinator.status_page.url
        leaver = world.workers[2]
        await leaver.close()
        page = await _until(lambda: _json(http, url), lambda s: s["view_size"] == 2 and len(s["members"]) == 2)
    finally:
        await World(world.coordinator, world.workers[:2]).close()
    assert leaver.address not in {m["address"] for m in page["members"]}
    left = [e for e in page["history"] if e["kind"] == "left"]
    assert left and leaver.address in left[0]["text"], page["history"]
    assert page["history"][-1]["kind"] == "view" and "1 left" in page["history"][-1]["text"]


@pytest.fixture
async def guarded() -> AsyncIterator[Coordinator]:
    async with Coordinator(CoordinatorConfig(http_port=0, token=TOKEN)) as coord:
        yield coord


async def test_a_job_with_a_token_refuses_the_page_and_its_data_without_it(
        guarded: Coordinator, http: aiohttp.ClientSession) -> None:
    url = guarded.status_page.url
    for path in ("", "status.json", "?token=wrong"):
        async with http.get(url + path, allow_redirects=False) as answer:
            assert answer.status == 401, path
            text = await answer.text()
            assert "views_formed" not in text and TOKEN not in text
    async with http.get(url, headers={"Authorization": "Bearer wrong"}) as answer:
        assert answer.status == 401
    async with http.get(url + "status.json", headers={"Authorization": f"Bearer {TOKEN}"}) as answer:
        assert answer.status == 200 and "views_formed" in await answer.text()
    async with http.get(url + "static/status.js") as answer:  # the same file for every job: no data in it
        assert answer.status == 200
    for path in ("favicon.ico", "static/favicon.svg"):  # the icon, asked for before any sign-in
        async with http.get(url + path) as answer:
            assert answer.status == 200 and answer.content_type == "image/svg+xml", path
            assert (await answer.text()).startswith("<svg")


async def test_the_token_given_once_becomes_a_cookie_that_holds_no_token(guarded: Coordinator) -> None:
    url = guarded.status_page.url
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:  # IP hosts too
        async with browser.post(url + "login", data={"token": "wrong"}, allow_redirects=False) as answer:
            assert answer.status == 401 and "not the job token" in await answer.text()
        async with browser.post(url + "login", data={"token": TOKEN}, allow_redirects=False) as answer:
            assert answer.status == 303 and answer.headers["Location"] == "/"
            cookie = answer.cookies[COOKIE]
        assert cookie.value == cookie_value(TOKEN) and TOKEN not in cookie.value
        assert cookie["httponly"] and cookie["samesite"] == "Strict"
        async with browser.get(url + "status.json") as answer:
            assert answer.status == 200
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:  # IP hosts too
        async with browser.get(url + f"?token={TOKEN}", allow_redirects=False) as answer:
            assert answer.status == 303 and answer.headers["Location"] == "/"  # the token leaves the address
        async with browser.get(url) as answer:
            assert answer.status == 200 and "ringserve status" in await answer.text()


async def test_no_route_changes_the_job(guarded: Coordinator, http: aiohttp.ClientSession) -> None:
    url = guarded.status_page.url
    auth = {"Authorization": f"Bearer {TOKEN}"}
    before = guarded.service.views_formed, guarded.config
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        for path in ("", "status.json", "static/status.js"):
            async with http.request(method, url + path, headers=auth) as answer:
                assert answer.status in (401, 405), (method, path, answer.status)
    async with http.get(url + "static/../../config.py", headers=auth) as answer:
        assert answer.status == 404
    async with http.get(url + "static/secrets.txt", headers=auth) as answer:
        assert answer.status == 404 and "status.js" in await answer.text()
    assert (guarded.service.views_formed, guarded.config) == before


async def test_without_a_token_the_page_answers_only_to_an_address_or_localhost(http: aiohttp.ClientSession) -> None:
    # DNS rebinding: a hostile site whose name resolves to 127.0.0.1 sends its own name as the Host.
    async with Coordinator(CoordinatorConfig(http_port=0)) as coord:
        url, port = coord.status_page.url, coord.status_page.port
        for host, status in ((f"evil.example:{port}", 421), ("evil.example", 421), (f"127.0.0.1:{port}", 200),
                             (f"localhost:{port}", 200), (f"[::1]:{port}", 200)):
            async with http.get(url + "status.json", headers={"Host": host}) as answer:
                assert answer.status == status, host
                if status == 421:
                    assert "views_formed" not in await answer.text()


async def test_with_a_token_any_name_reaches_the_login_and_the_token_decides(
        guarded: Coordinator, http: aiohttp.ClientSession) -> None:
    url = guarded.status_page.url
    async with http.get(url + "status.json", headers={"Host": "coordinator.example"}) as answer:
        assert answer.status == 401
    async with http.get(url + "status.json", headers={"Host": "coordinator.example",
                                                      "Authorization": f"Bearer {TOKEN}"}) as answer:
        assert answer.status == 200


async def test_wrong_tokens_past_the_limit_get_429_until_the_window_clears(
        guarded: Coordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_page, "LOGIN_WINDOW_S", 1.0)
    url = guarded.status_page.url
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        for i in range(http_page.LOGIN_FAILURES):
            async with browser.post(url + "login", data={"token": f"guess-{i}"}, allow_redirects=False) as answer:
                assert answer.status == 401, i
        for attempt in ({"data": {"token": "another"}}, {"data": {"token": TOKEN}}):
            async with browser.post(url + "login", allow_redirects=False, **attempt) as answer:
                assert answer.status == 429 and int(answer.headers["Retry-After"]) >= 1
        async with browser.get(url + "?token=guess", allow_redirects=False) as answer:
            assert answer.status == 429
        # The job's own clients, with the token in a header, are never limited.
        async with browser.get(url + "status.json", headers={"Authorization": f"Bearer {TOKEN}"}) as answer:
            assert answer.status == 200
        await asyncio.sleep(1.1)
        async with browser.post(url + "login", data={"token": TOKEN}, allow_redirects=False) as answer:
            assert answer.status == 303


async def test_bytes_that_are_not_utf8_in_a_token_cookie_or_form_are_refused_not_a_server_error(
        guarded: Coordinator) -> None:
    port = guarded.status_page.port
    for head in (b"Authorization: Bearer \xff\xfe\x80", b"Cookie: ringserve_status=\xed\xa0\x80"):
        answer = await _raw(port, b"GET /status.json HTTP/1.1\r\nHost: 127.0.0.1\r\n" + head + b"\r\nConnection: close\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 401"), answer[:60]
    form = b"token=%FF%FE"
    answer = await _raw(port, b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(form), form))
    assert answer.startswith(b"HTTP/1.1 401"), answer[:60]


async def _raw(port: int, request: bytes, *, hold_s: float = 0.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(10):
            return await reader.read(-1)
    finally:
        writer.close()


async def test_slow_and_silent_connections_are_closed_and_capped_while_the_page_answers(
        http: aiohttp.ClientSession) -> None:
    async with Coordinator(CoordinatorConfig(http_port=0)) as coord:
        port = coord.status_page.port
        loop = asyncio.get_running_loop()
        slow = await asyncio.open_connection("127.0.0.1", port)
        slow[1].write(b"GET /status.json HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # headers never end
        started = loop.time()
        async with asyncio.timeout(http_page.IDLE_S + 5):
            assert await slow[0].read(-1) == b""  # closed by the page, not by us
        assert loop.time() - started < http_page.IDLE_S + 2 * http_page.GUARD_S + 1
        slow[1].close()
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2 * http_page.CONNECTIONS)]
        try:
            await asyncio.sleep(3 * http_page.GUARD_S)
            assert len(coord.status_page._runner.server.connections) <= http_page.CONNECTIONS
            await _json(http, coord.status_page.url)  # and it still answers
        finally:
            for _, writer in held:
                writer.close()


async def test_a_sampler_that_fails_is_said_on_the_page_not_hidden_behind_old_figures(
        http: aiohttp.ClientSession) -> None:
    async with Coordinator(CoordinatorConfig(http_port=0)) as coord:
        page, status = coord.status_page, coord.service.status
        broken = {"now": False}

        def sampled(request: Any) -> Any:
            if broken["now"]:
                raise RuntimeError("status is broken for this test")
            return status(request)

        page._status = sampled  # the coordinator's own Status, failing on demand
        await _json(http, page.url)
        broken["now"] = True
        deadline = asyncio.get_running_loop().time() + http_page.STALE_S + 5
        while True:
            async with http.get(page.url + "status.json") as answer:
                if answer.status == 503:
                    error = (await answer.json())["error"]
                    break
            assert asyncio.get_running_loop().time() < deadline, "old figures were served as new"
            await asyncio.sleep(0.2)
        assert "status is broken for this test" in error and "s old" in error
        broken["now"] = False

        async def read() -> dict[str, Any]:
            async with http.get(page.url + "status.json") as answer:
                return dict(await answer.json()) if answer.status == 200 else {}

        await _until(read, lambda got: "views_formed" in got, timeout_s=5)  # and back once it samples


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _client_ssl(pki: Pki, cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki.node.ca)
    if cert:
        context.load_cert_chain(pki.node.cert, pki.node.key)
    return context


async def test_with_tls_the_page_is_served_over_https_with_the_jobs_certificate(pki: Pki) -> None:
    async with Coordinator(CoordinatorConfig(http_port=0, **pki.settings(mtls=False))) as coord:
        url = coord.status_page.url
        assert url.startswith("https://127.0.0.1:")
        async with aiohttp.ClientSession() as http:
            assert (await _json(http, url, ssl=_client_ssl(pki, cert=False)))["min_workers"] == 1
            with pytest.raises(aiohttp.ClientError):
                await _json(http, url.replace("https://", "http://"))
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await _json(http, url)  # not trusting the job's CA


async def test_with_mtls_the_page_requires_a_client_certificate_signed_by_the_jobs_ca(pki: Pki) -> None:
    async with Coordinator(CoordinatorConfig(http_port=0, **pki.settings(mtls=True))) as coord:
        url = coord.status_page.url
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.ClientError):
                await _json(http, url, ssl=_client_ssl(pki, cert=False))
            assert (await _json(http, url, ssl=_client_ssl(pki, cert=True)))["view_id"] == 0


def test_the_http_port_is_off_by_default_and_a_bad_one_is_named() -> None:
    assert CoordinatorConfig().http_port == -1
    assert CoordinatorConfig.from_env({"RINGSERVE_HTTP_PORT": "8080"}).http_port == 8080
    with pytest.raises(InvalidArgumentError, match=r"http_port \(70000"):
        CoordinatorConfig(http_port=70000)


async def test_a_coordinator_without_http_port_serves_no_page() -> None:
    async with Coordinator(CoordinatorConfig()) as coord:
        assert coord.status_page is None


async def test_a_port_in_use_fails_the_start_and_leaves_nothing_running() -> None:
    async with Coordinator(CoordinatorConfig(http_port=0)) as first:
        taken = first.status_page.port
        second = Coordinator(CoordinatorConfig(http_port=taken))
        with pytest.raises(OSError):
            await second.start()
        assert second.status_page is None and second._server is None


def test_ringserve_coordinator_http_port_serves_the_page_and_says_where(tmp_path: Path) -> None:
    import signal
    import subprocess
    import urllib.request

    proc = subprocess.Popen([sys.executable, "-m", "ringserve.cli", "coordinator", "--port", "0", "--http-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        assert "listening on" in lines[0], lines
        assert lines[1].startswith("ringserve coordinator status page on http://127.0.0.1:"), lines
        url = lines[1].split(" on ", 1)[1].strip()
        with urllib.request.urlopen(url + "status.json", timeout=10) as answer:
            assert answer.status == 200 and b'"view_id":0' in answer.read()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(20)
    assert proc.returncode == 0


def test_ringserve_run_http_port_0_says_the_url_it_bound_and_serves_the_page_while_the_job_runs(
        tmp_path: Path) -> None:
    import subprocess
    import time
    import urllib.error
    import urllib.request

    script = "import time, ringserve; ringserve.init(); time.sleep(20 if ringserve.rank() == 0 else 0); ringserve.shutdown()"
    proc = subprocess.Popen([sys.executable, "-m", "ringserve.cli", "run", "-np", "2", "--http-port", "0",
                             sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        said = [proc.stdout.readline() for _ in range(2)]
        assert said[0].startswith("ringserve run: coordinator at "), said
        assert said[1].startswith("ringserve run: status page on http://127.0.0.1:"), said
        url = said[1].split(" on ", 1)[1].strip()
        assert not url.endswith(":0/"), url  # the port bound, not the one asked for
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "status.json", timeout=5) as answer:
                    if b'"view_id":1' in answer.read():
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the launcher's page never showed view 1"
            time.sleep(0.2)
    finally:
        proc.terminate()  # the launcher stops its workers, then its coordinator
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
