"""Authenticated TCP links for the shells (protocol/linkauth.py is the
logic): `connect` and `serving` give a role the (reader, writer) pair it
always had, with every byte inside authenticated records when the link has
keys, or the plain pair when it has none. Handshake failures and records
that do not verify are counted in `refused` by reason and close the
connection; the role code sees a closed connection or a ProtocolError,
as for any bad peer."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Awaitable, Callable

from tape.protocol.errors import ProtocolError
from tape.protocol.linkauth import (
    ANY_LISTENER,
    HELLO,
    MAGIC,
    NONCE_SIZE,
    LinkEnd,
    LinkKeys,
    OlderPeer,
    Opener,
    Sealer,
    record_digests,
)
from tape.protocol.slots import Slots
from tape.runtime.ratelimited_log import RateLimitedLog
from tape.runtime.tuning import (
    BEHIND_RECV,
    HANDSHAKE_TIMEOUT_S,
    SOCKET_RECV,
)

log = RateLimitedLog(logging.getLogger("tape.link"))


class LinkReader(asyncio.StreamReader):
    """A StreamReader that can instead hand each chunk to a callback in the turn the transport
    receives it (`hand_to`). Awaiting `read` costs two turns of the event loop a read (the
    reader wakes the reading task, which runs in the next turn), the Python of a future and a
    task step: on a busy link that is most of what a small read costs (asyncio's docs invite
    copying start_server and open_connection to use another reader)."""

    _arrive = None
    heard = False  # any byte came: a peer without keys has said something (serving's deadline)

    def hand_to(self, arrive: Callable[[bytes | BaseException], None] | None) -> None:
        """From now on each chunk goes to `arrive` as it comes (b"" at the end, or the
        connection's exception); what was buffered goes first. None: buffer again."""
        self._arrive = arrive
        if arrive is None:
            return
        if self._buffer:
            data = bytes(self._buffer)
            self._buffer.clear()
            self._maybe_resume_transport()  # a full buffer had paused its reading
            arrive(data)
        if self._exception is not None:
            arrive(self._exception)
        elif self._eof:
            arrive(b"")

    def feed_data(self, data: bytes) -> None:
        self.heard = self.heard or bool(data)
        if self._arrive is None:
            super().feed_data(data)
        elif data:
            self._arrive(data)

    def feed_eof(self) -> None:
        super().feed_eof()
        if self._arrive is not None:
            self._arrive(b"")

    def set_exception(self, exc: BaseException) -> None:
        super().set_exception(exc)
        if self._arrive is not None:
            self._arrive(exc)


async def read_each(reader, on_data: Callable[[bytes], None]) -> None:
    """Call on_data(chunk) for each read of `reader` (a LinkReader or a SealedReader: verified
    records), in the turn the transport receives it, until the peer closes; raises what
    on_data raised, the connection's error, or a record's ProtocolError."""
    done = asyncio.get_running_loop().create_future()

    def arrive(data: bytes | BaseException) -> None:
        if done.done():
            return
        if isinstance(data, BaseException):
            done.set_exception(data)
        elif not data:
            done.set_result(None)
        else:
            try:
                on_data(data)
            except BaseException as e:  # ends the connection in the caller, as an awaited read's would
                done.set_exception(e)

    reader.hand_to(arrive)
    try:
        await done
    finally:
        reader.hand_to(None)


async def start_server(client_connected, host: str, port: int, tls=None) -> asyncio.Server:
    """asyncio.start_server, each connection read by a LinkReader; `tls`: an ssl.SSLContext (its
    handshake within HANDSHAKE_TIMEOUT_S)."""
    loop = asyncio.get_running_loop()

    def factory():
        return asyncio.StreamReaderProtocol(LinkReader(loop=loop), client_connected, loop=loop)

    timeout = HANDSHAKE_TIMEOUT_S if tls is not None else None
    return await loop.create_server(factory, host, port, ssl=tls, ssl_handshake_timeout=timeout)


async def _open_connection(host: str, port: int):
    """asyncio.open_connection, read by a LinkReader."""
    loop = asyncio.get_running_loop()
    reader = LinkReader(loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await loop.create_connection(lambda: protocol, host, port)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


class SealedReader:
    """The `read` of an asyncio.StreamReader, over verified records."""

    def __init__(self, reader: asyncio.StreamReader, opener: Opener, refused: dict[str, int]):
        self._reader = reader
        self._opener = opener
        self._refused = refused

    async def read(self, n: int = -1) -> bytes:
        while True:
            data = await self._reader.read(n)
            if not data:
                return b""
            try:
                plain = self._opener.open(data)
            except ProtocolError as e:
                _refuse(self._refused, e)
                raise
            if plain:
                return plain

    def hand_to(self, arrive) -> None:
        """LinkReader.hand_to, each chunk opened first (a record that does not verify is counted
        and handed on as its ProtocolError)."""
        if arrive is None:
            self._reader.hand_to(None)
            return

        def opened(data: bytes | BaseException) -> None:
            if isinstance(data, BaseException) or not data:
                arrive(data)
                return
            try:
                plain = self._opener.open(data)
            except ProtocolError as e:
                _refuse(self._refused, e)
                arrive(e)
                return
            if plain:
                arrive(plain)

        self._reader.hand_to(opened)


class SealedWriter:
    """An asyncio.StreamWriter whose writes go out as sealed records, to the `peer` the handshake
    proved."""

    def __init__(self, writer: asyncio.StreamWriter, sealer: Sealer, peer: bytes):
        self._writer = writer
        self._sealer = sealer
        self.peer = peer
        self.transport = writer.transport
        self.version = sealer.version

    def write(self, data: bytes, digests: list[bytes] | None = None) -> None:
        if data:
            self._writer.write(self._sealer.seal(data, digests))

    def __getattr__(self, name):  # drain, close, is_closing, wait_closed, get_extra_info
        return getattr(self._writer, name)


def peer_of(writer) -> bytes | None:
    """The node a link's handshake proved is at the other end (ANY_LISTENER: a holder of a shared
    key), None on a link without keys."""
    return getattr(writer, "peer", None)


def write_each(writers: list, data: bytes) -> None:
    """The same bytes to several links (a leader's append to its followers): hashed once for all
    the sealed ones of a link version."""
    digests: dict[bytes, list[bytes]] = {}
    for writer in writers:
        if isinstance(writer, SealedWriter):
            version = writer.version
            if version not in digests:
                digests[version] = record_digests(data, version)
            writer.write(data, digests[version])
        else:
            writer.write(data)


def _refuse(refused: dict[str, int], e: ProtocolError) -> None:
    refused[e.reason] = refused.get(e.reason, 0) + 1
    log.warn(e.reason, "link refused: %s", e)


async def _handshake(reader, writer, keys: LinkKeys, initiator: bool, refused: dict[str, int],
                     version: bytes = MAGIC, peer: bytes = ANY_LISTENER):
    """Hellos exchanged: the connecting side's first (to `peer`), in `version`; the accepting
    side's in the version offered. Raises OlderPeer (connecting: the peer answered in an older
    version we speak), or ConnectionError (counted in `refused`)."""
    end = LinkEnd(keys, os.urandom(NONCE_SIZE), initiator, version, peer)
    try:
        if initiator:
            writer.write(end.opening())
    except KeyError:
        _refuse(refused, ProtocolError("no_pair_key", f"no link key shared with {peer!r}", 0))
        raise ConnectionError(f"no link key for {peer!r}") from None
    try:
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):  # not wait_for (runtime/process.py `within`)
            hello = await reader.readexactly(HELLO.size)
        reply = end.on_hello(hello)
        if reply:
            writer.write(reply)
    except OlderPeer:
        raise
    except asyncio.IncompleteReadError as e:
        _refuse(refused, ProtocolError("bad_hello", f"closed after {len(e.partial)} bytes of a hello", 0))
        raise ConnectionError("link closed during the handshake") from None
    except asyncio.TimeoutError:
        _refuse(refused, ProtocolError("hello_timeout", f"no hello in {HANDSHAKE_TIMEOUT_S} s", 0))
        raise ConnectionError("no link hello in time") from None
    except ProtocolError as e:
        _refuse(refused, e)
        raise ConnectionError(f"link handshake refused: {e}") from None
    return SealedReader(reader, end.opener, refused), SealedWriter(writer, end.sealer, end.peer)


async def connect(host: str, port: int, keys: LinkKeys | None, refused: dict[str, int], timeout: float | None = None,
                  peer: bytes = ANY_LISTENER):
    """open_connection, then the handshake when the link has keys (with the key shared with `peer`,
    the node there), both within `timeout` (raises OSError or asyncio.TimeoutError; ConnectionError
    when the handshake fails)."""
    async def open_link(version: bytes = MAGIC):
        reader, writer = await _open_connection(host, port)
        small_reads(writer)
        if keys is None:
            return reader, writer
        try:
            return await _handshake(reader, writer, keys, True, refused, version, peer)
        except OlderPeer as e:  # a node not yet upgraded refused our hello: offer its version (once:
            writer.close()        # only a TPL3 offer can be answered in TPL2)
            log.warn("older_link_version", "%s:%d speaks %s: connecting again in it", host, port,
                     e.version.decode())
            return await open_link(e.version)
        except BaseException:
            writer.close()
            raise

    async with asyncio.timeout(timeout):  # not wait_for (runtime/process.py `within` says why)
        return await open_link()


def small_reads(writer: asyncio.StreamWriter) -> None:
    """Make the connection's transport read at most SOCKET_RECV bytes a recv() (asyncio's
    socket transports; another loop's keep their own size)."""
    if hasattr(type(writer.transport), "max_size"):
        writer.transport.max_size = SOCKET_RECV


def large_reads(writer: asyncio.StreamWriter) -> None:
    """Make a voter's inbound link read up to BEHIND_RECV bytes a recv(): an append of a paced
    batch (hundreds of KB) is one read, one fsync and one reply, not one turn of the event loop a
    SOCKET_RECV. With the heap kept (runtime/memory.py) a large buffer shrunk to a small read costs
    what a small one does."""
    if hasattr(type(writer.transport), "max_size"):
        writer.transport.max_size = BEHIND_RECV


def serving(handler: Callable[..., Awaitable[None]], keys: LinkKeys | None, refused: dict[str, int],
            peers: frozenset[str] = frozenset()):
    """A start_server callback: `handler` gets the (authenticated, with keys) pair, or nothing is
    called. Bounded, so that no stranger can exhaust the process's file descriptors or take a
    configured peer's slot (protocol/slots.py: `peers`, the addresses the listener's peers connect
    from). A connection that says nothing for HANDSHAKE_TIMEOUT_S is closed, with keys (no hello)
    or without (no byte)."""
    slots = Slots(peers)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        small_reads(writer)
        host = (writer.get_extra_info("peername") or ("?",))[0]
        reason = slots.admit(host)
        if reason:
            _refuse(refused, ProtocolError(reason, f"{host} closed ({slots.strangers_open} stranger slots taken)", 0))
            writer.close()
            return
        try:
            if keys is None:
                deadline = asyncio.get_running_loop().call_later(HANDSHAKE_TIMEOUT_S, _unheard, reader, writer,
                                                                 refused)
                try:
                    return await handler(reader, writer)
                finally:
                    deadline.cancel()
            try:
                pair = await _handshake(reader, writer, keys, False, refused)
            except (ConnectionError, OSError):
                writer.close()
                return
            await handler(*pair)
        finally:
            slots.release(host)

    return serve


def _unheard(reader, writer: asyncio.StreamWriter, refused: dict[str, int]) -> None:
    """A keyless connection's deadline: closed if not a byte came."""
    if not getattr(reader, "heard", True):
        _refuse(refused, ProtocolError("hello_timeout", f"nothing in {HANDSHAKE_TIMEOUT_S} s", 0))
        writer.close()
