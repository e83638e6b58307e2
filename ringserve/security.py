"""TLS, mTLS and the job token, for every server and channel of a job.

One ``Security`` is loaded from a config (``CoordinatorConfig`` or ``WorkerConfig``) when a process
starts: the certificate files and the token file are read once, there, so a missing file is an
error at start and never mid-training.

- **Servers** (the coordinator, each worker's peer server) listen with TLS when ``tls_cert`` is set,
  and with ``tls_require_client_auth`` refuse clients without a certificate signed by ``tls_ca``.
  With a token, a server interceptor answers UNAUTHENTICATED to any RPC whose ``authorization``
  metadata is not ``Bearer <token>``, before the handler runs and before the request is parsed, so
  a refused call changes no state. The token is compared in constant time.
- **Channels** (a worker's channel to the coordinator and to its ring successor, the coordinator's
  probe of a suspect worker, ``ringserve status``, the health probe) speak TLS when ``tls_ca`` or
  ``tls_cert`` is set, and present ``tls_cert`` as their client certificate. The token rides as call
  credentials on a TLS channel and through a client interceptor on a plaintext one (gRPC sends call
  credentials only over a secure transport). A bidirectional stream on a plaintext channel carries
  it as explicit metadata instead (``call_metadata``): grpc.aio's stream-stream interceptor turns
  each ``write`` into two tasks, and a stream that the server refuses leaves one of them pending
  forever, so a worker re-opening its heartbeat stream would leak a task each time.
- **The health service stays open**: ``grpc.health.v1.Health`` needs no token, because the probes
  that call it (Docker's health check, Kubernetes' gRPC probe) cannot send one. It tells only
  SERVING or not. Under ``tls_require_client_auth`` it needs a client certificate like every other
  service, since TLS sits below gRPC; probe with ``python -m ringserve.healthcheck --tls-*`` then.
"""

from __future__ import annotations

import hmac
import inspect
import os
import pathlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

import grpc

from ringserve.atomic import write_atomic
from ringserve.config import new_token
from ringserve.errors import InvalidArgumentError, RingserveError

AUTH_HEADER = "authorization"
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


class SecuritySettings(Protocol):
    """The fields of CoordinatorConfig and WorkerConfig that Security reads."""

    @property
    def tls_cert(self) -> str: ...
    @property
    def tls_key(self) -> str: ...
    @property
    def tls_ca(self) -> str: ...
    @property
    def tls_require_client_auth(self) -> bool: ...
    @property
    def tls_server_name(self) -> str: ...
    @property
    def token(self) -> str: ...
    @property
    def token_file(self) -> str: ...


def token_file_made(path: str) -> str:
    """``path``, holding the job's token: the one already there (a coordinator that restarts keeps
    its job's token), else a new one, written whole (ringserve.atomic) and readable by its owner
    only. What ``ringserve coordinator --make-token PATH`` serves with, for workers that read the
    same file (a volume they share, docker-compose.yml).

    Raises:
        OSError: the directory is missing or not writable.
    """
    existing = pathlib.Path(path)
    if existing.is_file() and existing.read_bytes().strip():
        return path

    def secret(f: IO[bytes]) -> None:
        os.fchmod(f.fileno(), 0o600)
        f.write(new_token().encode() + b"\n")

    write_atomic(path, secret)
    return path


def _read(path: str, what: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgumentError(f"The {what} file {path!r} could not be read: {exc.strerror}.") from None


@dataclass(frozen=True)
class Security:
    """The loaded TLS material and token of one process; no field is ever logged.

    Example:
        ```python
        security = Security.load(config)
        port = security.add_port(server, "0.0.0.0:0")
        channel = security.channel("10.0.0.7:41234", options)
        ```
    """

    cert: bytes | None = field(default=None, repr=False)
    key: bytes | None = field(default=None, repr=False)
    ca: bytes | None = field(default=None, repr=False)
    require_client_auth: bool = False
    server_name: str = ""
    token: str = field(default="", repr=False)

    @classmethod
    def load(cls, settings: SecuritySettings) -> Security:
        """Reads the certificate, key, CA and token files named by a config.

        Raises:
            InvalidArgumentError: a file is missing or unreadable, or the token file is empty.
        """
        token = settings.token
        if settings.token_file:
            token = _read(settings.token_file, "token").decode().strip()
            if not token:
                raise InvalidArgumentError(f"The token file {settings.token_file!r} is empty.")
        return cls(
            cert=_read(settings.tls_cert, "TLS certificate") if settings.tls_cert else None,
            key=_read(settings.tls_key, "TLS key") if settings.tls_key else None,
            ca=_read(settings.tls_ca, "TLS CA") if settings.tls_ca else None,
            require_client_auth=settings.tls_require_client_auth,
            server_name=settings.tls_server_name,
            token=token,
        )

    @property
    def tls(self) -> bool:
        return self.cert is not None or self.ca is not None

    # -- servers -----------------------------------------------------------------------------

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The token's check (when the job has one), then the parse guard: in that order, so that an
        unauthenticated request is never parsed."""
        return [*([TokenInterceptor(self.token)] if self.token else []), ParseGuard()]

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Binds address with TLS when this process has a certificate; returns the bound port.

        Raises:
            InvalidArgumentError: TLS is on (a CA is set) but there is no certificate to serve.
            OSError: the address could not be bound (in use, or not this machine's).
        """
        try:
            port = self._add_port(server, address)
        except RingserveError:  # a RuntimeError too, but ours: a setting to fix, not a busy port
            raise
        except RuntimeError:  # grpc's "Failed to bind to address"
            port = 0
        if port == 0:
            raise OSError(f"Could not bind {address}: the port is in use or the host is not an address of this machine.")
        return port

    def _add_port(self, server: grpc.aio.Server, address: str) -> int:
        if not self.tls:
            port: int = server.add_insecure_port(address)
            return port
        if self.cert is None or self.key is None:
            raise InvalidArgumentError(
                f"A server on {address} with TLS needs a certificate and key (tls_cert, tls_key)."
            )
        credentials = grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca,
            require_client_auth=self.require_client_auth,
        )
        secure: int = server.add_secure_port(address, credentials)
        return secure

    # -- channels ----------------------------------------------------------------------------

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS credentials (with the token as call credentials, if any); needs ``tls``."""
        ssl = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert)
        if not self.token:
            return ssl
        return grpc.composite_channel_credentials(ssl, grpc.access_token_call_credentials(self.token))

    def channel_options(self, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        extra = [("grpc.ssl_target_name_override", self.server_name)] if self.tls and self.server_name else []
        return [*options, *extra]

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """What a bidirectional stream on one of our channels must send itself: the token on a
        plaintext channel (see the module docstring); nothing with TLS or without a token."""
        return ((AUTH_HEADER, f"Bearer {self.token}"),) if self.token and not self.tls else ()

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """An asyncio channel to address that speaks TLS and sends the token as configured
        (on bidirectional streams, pass ``call_metadata()`` to the call)."""
        opts = self.channel_options(options)
        if self.tls:
            return grpc.aio.secure_channel(address, self.channel_credentials(), options=opts)
        interceptors = token_client_interceptors(self.token) if self.token else None
        return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)

    def sync_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel (the health probe), with the same TLS and token."""
        opts = self.channel_options(options)
        if self.tls:
            return grpc.secure_channel(address, self.channel_credentials(), options=opts)
        channel = grpc.insecure_channel(address, options=opts)
        if self.token:
            channel = grpc.intercept_channel(channel, _SyncTokenInterceptor(self.token))
        return channel


# -- the server side of the token -------------------------------------------------------------


def _authorized(metadata: Sequence[tuple[str, str | bytes]] | None, expected: bytes) -> bool:
    for key, value in metadata or ():
        if key == AUTH_HEADER:
            raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
            return hmac.compare_digest(raw, expected)
    return False


async def _deny_unary(request: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "A valid job token is required (authorization: Bearer <token>).")


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to every RPC without ``authorization: Bearer <token>``.

    The refusal happens before the method's handler runs, and its request is never deserialized
    (the refusing handler takes raw bytes), so nothing from an unauthenticated caller reaches the
    servicers or the data plane. The health service is left open (see the module docstring).
    """

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if method.startswith(OPEN_SERVICES):
            return handler
        if _authorized(handler_call_details.invocation_metadata, self._expected):
            return handler
        # An unknown method is refused like a known one, so that a stranger cannot list methods.
        if handler is None or (handler.request_streaming and handler.response_streaming):
            return grpc.stream_stream_rpc_method_handler(_deny_unary)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(_deny_unary)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_deny_unary)
        return grpc.unary_unary_rpc_method_handler(_deny_unary)


class ParseGuard(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT, naming the message it is not, to a request whose bytes do not
    parse, where grpc.aio would answer UNKNOWN ("Unexpected DecodeError"): bad input is refused by
    name. It parses in the handler instead of before it, for every method with a protobuf request
    (the peer stream's frames are raw bytes, parsed by the data plane, and pass untouched)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        parse = getattr(handler, "request_deserializer", None)
        if handler is None or parse is None or not hasattr(handler, "_replace"):
            return handler
        method = handler_call_details.method
        if handler.request_streaming:
            # Streams may read through ``context.read()``: the deserializer stays, raising Unparsed,
            # which the behavior's wrapper turns into the refusal.
            behavior = handler.stream_unary or handler.stream_stream
            kind = "stream_unary" if handler.stream_unary else "stream_stream"
            checked = _raising(parse, method)
            if inspect.isasyncgenfunction(behavior):  # grpc.aio tells the two kinds by the function
                async def streaming(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                    try:
                        async for answer in behavior(requests, context):
                            yield answer
                    except Unparsed as exc:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

                return handler._replace(request_deserializer=checked, **{kind: streaming})

            async def streamed(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await behavior(requests, context)
                except Unparsed as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

            return handler._replace(request_deserializer=checked, **{kind: streamed})
        if handler.response_streaming:
            streaming = handler.unary_stream

            async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                result = streaming(await _parsed(parse, raw, context, method), context)
                if hasattr(result, "__aiter__"):
                    async for answer in result:
                        yield answer
                else:
                    await result

            return handler._replace(request_deserializer=None, unary_stream=unary_stream)
        unary = handler.unary_unary

        async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await unary(await _parsed(parse, raw, context, method), context)

        return handler._replace(request_deserializer=None, unary_unary=unary_unary)


async def _parsed(parse: Callable[[bytes], Any], raw: bytes, context: grpc.aio.ServicerContext, method: str) -> Any:
    try:
        return parse(raw)
    except Exception as exc:  # DecodeError, or whatever a deserializer raises on bytes it cannot take
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"The request to {method} does not parse ({len(raw)} bytes): {exc}")


class Unparsed(Exception):
    """A streamed request whose bytes do not parse (ParseGuard refuses the call with it)."""


def _raising(parse: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def checked(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception as exc:
            raise Unparsed(f"A request streamed to {method} does not parse ({len(raw)} bytes): {exc}") from None

    return checked


# -- the client side of the token on plaintext channels -----------------------------------------


def _with_token(details: grpc.aio.ClientCallDetails, header: tuple[str, str]) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add(*header)
    return grpc.aio.ClientCallDetails(
        method=details.method, timeout=details.timeout, metadata=metadata,
        credentials=details.credentials, wait_for_ready=details.wait_for_ready,
    )


class _TokenUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, header: tuple[str, str]) -> None:
        self._header = header

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._header), request)


class _TokenUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, header: tuple[str, str]) -> None:
        self._header = header

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._header), request)


def token_client_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add ``authorization: Bearer <token>`` to the unary-request calls of a
    channel. Client streams send ``Security.call_metadata()`` themselves, as bidirectional ones
    do: an intercepted client stream feeds its writes through a generator of gRPC's, whose task
    is left waiting when the call fails (a peer cut off), and is destroyed pending at the next
    garbage collection, with an "aclose(): asynchronous generator is already running" error
    (the chaos campaign's netns-lane job)."""
    header = (AUTH_HEADER, f"Bearer {token}")
    return [_TokenUnaryUnary(header), _TokenUnaryStream(header)]


class _SyncTokenInterceptor(grpc.UnaryUnaryClientInterceptor):
    """The health probe's blocking channel makes unary calls only."""

    def __init__(self, token: str) -> None:
        self._header = (AUTH_HEADER, f"Bearer {token}")

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        details = _SyncDetails(
            client_call_details.method, client_call_details.timeout,
            [*(client_call_details.metadata or ()), self._header],
            client_call_details.credentials, client_call_details.wait_for_ready, client_call_details.compression,
        )
        return continuation(details, request)


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, method: str, timeout: float | None, metadata: Any, credentials: Any, wait_for_ready: Any, compression: Any) -> None:
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression
