"""A blocking client of an authenticated link (protocol/linkauth.py), for what talks to a node's
TCP port from outside the event loop (the Spark replay source, the attacks, tests): `sendall` and
`recv` as on a socket."""

import os
import socket

from tape.protocol.linkauth import ANY_LISTENER, HELLO, NONCE_SIZE, LinkKeys


class LinkSocket:
    def __init__(self, sock: socket.socket, keys: LinkKeys | None, peer: bytes = ANY_LISTENER):
        """`peer`: the node listening (whose pair key `keys` offers)."""
        self.sock = sock
        self.sealer = self.opener = None
        if keys is not None:
            nonce = os.urandom(NONCE_SIZE)
            sock.sendall(keys.hello(nonce, peer=peer))
            answer = b""
            while len(answer) < HELLO.size:
                data = sock.recv(HELLO.size - len(answer))
                if not data:
                    raise ConnectionError("closed during the handshake")
                answer += data
            _, self.sealer, self.opener = keys.accept(nonce, answer, initiator=True, peer=peer)

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(self.sealer.seal(data) if self.sealer else data)

    def recv(self, n: int) -> bytes:
        while True:
            data = self.sock.recv(n)
            if not data or self.opener is None:
                return data
            plain = self.opener.open(data)
            if plain:
                return plain

    def settimeout(self, t) -> None:
        self.sock.settimeout(t)

    def close(self) -> None:
        self.sock.close()
