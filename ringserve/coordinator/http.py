"""The coordinator's live status page: a small read-only HTTP server (aiohttp) beside the gRPC one.

Routes, all of them reads (GET, and HEAD), except ``POST /login``, which only sets a cookie:

- ``/``: the page (``static/index.html``); it polls ``/status.json`` every second and redraws;
- ``/status.json``: the newest snapshot (statusview.py) of the coordinator's own ``Status``,
  sampled once a second by a task this server owns, so that any number of viewers cost one
  Status a second and the page never holds state of its own;
- ``/static/<file>``: the page's script, style and icon, shipped in the package, so the page works
  without the internet (no CDN); they are the same for every job and hold no data, so they are
  served to anyone, as is ``/favicon.ico`` (the icon, for clients that ask there without reading
  the page's ``<link rel="icon">``);
- ``/login``: a form for the job's token, when the job has one.

Security follows the job's: with a token, ``/`` and ``/status.json`` require it, as an
``Authorization: Bearer <token>`` header (scripts, curl) or as a cookie that ``/login`` (or the
first ``/?token=...``) sets. The cookie holds an HMAC of the token, never the token, so it opens
this page and nothing else. With TLS, the page is served over HTTPS with the coordinator's
certificate, and with ``tls_require_client_auth`` a client must present a certificate the job's CA
signed, as on gRPC. No route changes the job: nothing here calls anything but ``Status``.

What the page stands against besides:

- **DNS rebinding.** A page with no token (a job on loopback) answers only requests whose Host
  is an address or ``localhost``: a hostile site whose name resolves to 127.0.0.1 sends its own
  name, and gets 421. With a token, any name may reach the login form; the token is the check.
- **Guessing the token.** At most ``LOGIN_FAILURES`` wrong tokens (at /login or in ``?token=``)
  in ``LOGIN_WINDOW_S``, all clients together; past that, 429 with Retry-After until the
  window clears. The right token still needs to be the right one.
- **Slow and silent connections.** At most ``CONNECTIONS`` at once (a new one past it closes
  the one idle longest); one that has not sent a request's headers within ``IDLE_S`` of opening
  or of its last answer is closed (slow-loris), and a request (its body included) that is not
  done within ``REQUEST_S`` is answered 408. aiohttp bounds the request line and headers' sizes.
- **A sampler that stops.** Sampling errors are logged and retried each second; while the
  newest sample is older than ``STALE_S``, ``/status.json`` answers 503 naming the error and
  the age of what it last had, and the page shows that, not old figures as if they were new.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import html
import ipaddress
import json
import logging
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

try:
    from aiohttp import web
except ImportError:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "The coordinator's status page (http_port, --http-port) needs aiohttp: install it with "
        "`pip install 'ringserve[status]'`."
    ) from None

from ringserve._proto import coordinator_pb2 as pb
from ringserve.config import CoordinatorConfig
from ringserve.coordinator import statusview
from ringserve.security import Security

log = logging.getLogger("ringserve.coordinator")

SAMPLE_S = 1.0
STALE_S = 3 * SAMPLE_S  # older than this, the snapshot is not served as the job's state
LOGIN_FAILURES = 10  # wrong tokens in LOGIN_WINDOW_S, all clients together, before 429
LOGIN_WINDOW_S = 10.0
CONNECTIONS = 64  # connections to the page at once; a browser holds one or two
IDLE_S = 5.0  # a connection must send a request's headers within this of opening or of its last answer
REQUEST_S = 10.0  # a request's handling, its body included
GUARD_S = 0.5  # how often the connections are looked at
# At thousands of workers the page lists the first ranks only (the counts cover every member).
MAX_LISTED = 256
COOKIE = "ringserve_status"
STATIC = ("index.html", "status.js", "status.css", "favicon.svg")
_TYPES = {"html": "text/html", "js": "text/javascript", "css": "text/css", "svg": "image/svg+xml"}
# Everything the page loads comes from here; no inline script, no other origin.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def cookie_value(token: str) -> str:
    """What the cookie holds for ``token``: an HMAC that opens the page and nothing else."""
    return hmac.new(token.encode(), b"ringserve status page", hashlib.sha256).hexdigest()


def same(given: str, expected: str) -> bool:
    """Whether ``given`` (anything a client sent: a header, a cookie, a form field, which may hold
    bytes that are not UTF-8, kept as surrogates) is ``expected``, in constant time."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode("utf-8", "surrogateescape"))


def _static(name: str) -> bytes:
    return resources.files("ringserve.coordinator").joinpath("static", name).read_bytes()


def server_ssl_context(config: CoordinatorConfig) -> ssl.SSLContext | None:
    """HTTPS with the coordinator's certificate (and client certificates when gRPC requires them);
    None without TLS."""
    if not config.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_require_client_auth:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=config.tls_ca)
    return context


class StatusPage:
    """The status page of one coordinator's service, on ``config.host:config.http_port``.

    Example:
        ```python
        page = await StatusPage(service.status, config, security).start()
        print(page.url)          # http://127.0.0.1:<port>/
        await page.stop()
        ```
    """

    def __init__(self, status: Callable[[pb.StatusRequest], pb.StatusResponse], config: CoordinatorConfig,
                 security: Security) -> None:
        self._status = status
        self._config = config
        self._token = security.token
        self._cookie = cookie_value(security.token) if security.token else ""
        self._ssl = server_ssl_context(config)
        self._samples: deque[statusview.Sample] = deque(maxlen=int(statusview.CHART_S / SAMPLE_S) + 1)
        self._snapshot = b"{}"
        self._sampled_at = 0.0  # the loop's clock at the newest sample
        self._sample_error = ""  # why the newest sampling failed ("": it did not)
        self._failures: deque[float] = deque()  # the loop's clock at each wrong token of the window
        # Per open connection (aiohttp's RequestHandler): [the loop's clock of its start or last
        # answer, busy?]; kept to the server's connections at each look
        self._activity: dict[Any, list[Any]] = {}
        self._guard: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._sampler: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        host = self._config.host
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self._ssl else 'http'}://{host}:{self.port}/"

    async def start(self) -> StatusPage:
        """Binds the port and starts sampling.

        Raises:
            OSError: the port could not be bound.
        """
        app = web.Application(middlewares=[self._timed, self._secure])
        app.router.add_get("/", self._index)
        app.router.add_get("/status.json", self._json)
        app.router.add_get("/static/{name}", self._file)
        app.router.add_get("/favicon.ico", self._favicon)
        app.router.add_get("/login", self._login_form)
        app.router.add_post("/login", self._login)
        self._take_sample()
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self._config.host, self._config.http_port, ssl_context=self._ssl)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        self._sampler = asyncio.get_running_loop().create_task(self._sample(), name="ringserve-status-sampler")
        self._sampler.add_done_callback(self._sampler_ended)
        self._guard = asyncio.get_running_loop().create_task(self._guard_connections(), name="ringserve-status-guard")
        log.info("status page on %s", self.url)
        return self

    async def stop(self) -> None:
        if self._guard is not None:
            self._guard.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._guard
            self._guard = None
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
            self._sampler = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- the samples -------------------------------------------------------------------------

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_S)
            try:
                self._take_sample()
            except Exception as exc:
                if not self._sample_error:
                    log.warning("the status page could not sample the coordinator: %r; retrying every %g s",
                                exc, SAMPLE_S)
                self._sample_error = repr(exc)
            else:
                if self._sample_error:
                    log.warning("the status page samples the coordinator again")
                self._sample_error = ""

    def _sampler_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._sample_error = f"the sampler stopped: {task.exception()!r}"
            log.error("the status page's sampler stopped: %r", task.exception())

    def _take_sample(self) -> None:
        status = self._status(pb.StatusRequest(limit=MAX_LISTED))
        self._samples.append(statusview.sample(status, self._samples[-1] if self._samples else None))
        self._snapshot = json.dumps(statusview.snapshot(status, list(self._samples)), separators=(",", ":")).encode()
        self._sampled_at = asyncio.get_running_loop().time()

    # -- connections -------------------------------------------------------------------------

    async def _guard_connections(self) -> None:
        """Closes connections that send no request in time, and the idlest past CONNECTIONS."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(GUARD_S)
            server = self._runner.server if self._runner is not None else None
            if server is None:
                continue
            now = loop.time()
            self._activity = {h: self._activity.get(h) or [now, False] for h in server.connections}
            idle = [(since, h) for h, (since, busy) in self._activity.items() if not busy]
            idle.sort(key=lambda pair: pair[0])
            over = len(server.connections) - CONNECTIONS
            for n, (since, handler) in enumerate(idle):
                if now - since > IDLE_S or n < over:
                    transport = handler.transport
                    if transport is not None:
                        transport.close()

    @web.middleware
    async def _timed(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Marks the connection busy while a request is handled, within REQUEST_S."""
        loop = asyncio.get_running_loop()
        state = self._activity.setdefault(request.protocol, [loop.time(), False])
        state[1] = True
        try:
            async with asyncio.timeout(REQUEST_S):
                return await handler(request)
        except TimeoutError:
            refused = web.Response(status=408, text=f"The request was not done within {REQUEST_S:g} s.")
            refused.headers.update(_HEADERS)
            return refused
        finally:
            state[0], state[1] = loop.time(), False

    # -- access ------------------------------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        if not self._token:
            return True
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer ") and same(header[7:], self._token):
            return True
        return same(request.cookies.get(COOKIE, ""), self._cookie)

    def _set_cookie(self, response: web.StreamResponse) -> None:
        response.set_cookie(COOKIE, self._cookie, httponly=True, samesite="Strict", secure=self._ssl is not None,
                            path="/")

    def _host_allowed(self, request: web.Request) -> bool:
        """Without a token, only an address or localhost as the Host (no DNS rebinding)."""
        if self._token:
            return True
        host = request.host.rsplit(":", 1)[0] if not request.host.endswith("]") else request.host
        host = host.strip("[]").lower()
        if host == "localhost":
            return True
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return False
        return True

    def _guessing(self) -> float:
        """Seconds until another wrong token is heard (0: now), as LOGIN_FAILURES allows."""
        now = asyncio.get_running_loop().time()
        while self._failures and self._failures[0] <= now - LOGIN_WINDOW_S:
            self._failures.popleft()
        if len(self._failures) < LOGIN_FAILURES:
            return 0.0
        return self._failures[0] + LOGIN_WINDOW_S - now

    def _wrong_token(self) -> None:
        self._failures.append(asyncio.get_running_loop().time())

    @web.middleware
    async def _secure(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Asks for the token where it is needed, and adds the security headers to every answer."""
        if not self._host_allowed(request):
            refused = web.Response(status=421, text=f"This page answers to an address or localhost, not "
                                                    f"{request.host!r}: a job without a token is not served by name.")
            refused.headers.update(_HEADERS)
            return refused
        public = request.path in ("/login", "/favicon.ico") or request.path.startswith("/static/")
        given = request.query.get("token", "") if not public else ""
        if ((request.method == "POST" and request.path == "/login") or given) and (wait := self._guessing()):
            limited = web.Response(status=429, text="Too many wrong tokens: try again later.",
                                   headers={"Retry-After": str(max(1, int(wait + 0.999)))})
            limited.headers.update(_HEADERS)
            return limited
        if not public and not self._authorized(request):
            right = bool(given) and request.method == "GET" and same(given, self._token)
            if given and not right:
                self._wrong_token()
            if right:
                # The token in the address works once: it becomes the cookie, and leaves the address.
                found: web.StreamResponse = _see_other(request.path)
                self._set_cookie(found)
            elif request.path == "/status.json":
                found = web.json_response({"error": "This job requires its token."}, status=401)
            else:
                found = self._login_page("This job requires its token.", status=401)
            found.headers.update(_HEADERS)
            return found
        response = await handler(request)
        response.headers.update(_HEADERS)
        return response

    # -- routes ------------------------------------------------------------------------------

    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=_static("index.html"), content_type="text/html", charset="utf-8")

    async def _json(self, request: web.Request) -> web.StreamResponse:
        age = asyncio.get_running_loop().time() - self._sampled_at
        if age > STALE_S:
            why = self._sample_error or "no sample was taken"
            return web.json_response({"error": f"the status is {age:.0f} s old: {why}"}, status=503)
        return web.Response(body=self._snapshot, content_type="application/json")

    async def _file(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound(text=f"No static file {name!r}: the page has {', '.join(STATIC)}.")
        return web.Response(body=_static(name), content_type=_TYPES[name.rsplit(".", 1)[1]], charset="utf-8")

    async def _favicon(self, request: web.Request) -> web.StreamResponse:
        # The SVG under the old name: browsers that draw SVG icons (Chromium, Firefox) draw it, and
        # no client gets a 404 for the one path every browser asks for.
        return web.Response(body=_static("favicon.svg"), content_type=_TYPES["svg"])

    async def _login_form(self, request: web.Request) -> web.StreamResponse:
        if not self._token:
            return _see_other("/")
        return self._login_page("")

    async def _login(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        given = str(form.get("token", ""))
        if not self._token:
            return _see_other("/")
        if not same(given, self._token):
            self._wrong_token()
            return self._login_page("That is not the job token.", status=401)
        response = _see_other("/")
        self._set_cookie(response)
        return response

    def _login_page(self, message: str, status: int = 200) -> web.Response:
        note = f'<p class="error">{html.escape(message)}</p>' if message else ""
        body = (
            '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>ringserve: sign in</title>'
            '<link rel="stylesheet" href="/static/status.css"><link rel="icon" href="/static/favicon.svg" '
            'type="image/svg+xml"></head><body class="login">'
            '<form method="post" action="/login"><h1>ringserve status</h1>'
            f"{note}<label>Job token <input type=\"password\" name=\"token\" autofocus></label>"
            '<button type="submit">Open</button></form></body></html>'
        )
        return web.Response(text=body, content_type="text/html", status=status)


def _see_other(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location})
