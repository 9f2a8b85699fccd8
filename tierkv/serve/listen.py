"""The server's listening socket, taken before anything heavy is imported.

Importing tierkv's model stack (torch) takes seconds; a server that binds its port after that
refuses the connections of those seconds, and a client or a readiness probe started with it
fails instead of waiting. The ``tierkv`` command (``tierkv.__main__``) therefore reads
``--host`` and ``--port`` of ``tierkv serve`` first and listens at once (`early`); the server,
once its flags are checked, takes that socket (`take`), and its clients meanwhile wait in the
listen queue for the 503 of a loading server. Only the standard library is imported here.
"""
from __future__ import annotations

import argparse
import errno
import socket

from tierkv.errors import ConfigError

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
_early: dict[tuple[str, int], socket.socket] = {}


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port``; a ConfigError naming what is wrong."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ConfigError(f"--host {host}: not an address of this machine ({error.strerror})") from None
    # IPv4 first where a name has both (localhost: what clients of 'localhost:PORT' try first and uvicorn bound)
    family, kind, proto, _, address = next((a for a in found if a[0] == socket.AF_INET), found[0])
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(2048)
    except OSError as error:
        listener.close()
        hint = ": another process listens there (pick another --port)" if error.errno == errno.EADDRINUSE else ""
        raise ConfigError(f"--host {host} --port {port}: cannot listen ({error.strerror}){hint}") from None
    return listener


def early(args: list[str]) -> None:
    """Listen where ``tierkv serve ARGS`` will, if its ``--host`` and ``--port`` can be read and the
    address is free. Anything else (help asked, a bad port, a busy one) is left to the server's own
    checks, which report it."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", default=str(DEFAULT_PORT))
    parser.add_argument("-h", "--help", action="store_true")
    try:
        known, _ = parser.parse_known_args(args)
        port = int(known.port)
    except (SystemExit, ValueError):
        return
    names = {arg.partition("=")[0] for arg in args if arg.startswith("--")}
    if any(name not in ("--host", "--port") and ("--host".startswith(name) or "--port".startswith(name))
           for name in names):
        return                    # an abbreviation (--po 9000): the server's parser reads it, not this one
    if known.help or not 0 < port < 65536:
        return
    try:
        _early[known.host, port] = listen(known.host, port)
    except ConfigError:
        return


def take(host: str, port: int) -> socket.socket:
    """The socket `early` opened for ``host``:``port``, or a new one. One opened for another address
    (flags read differently once checked) is closed first, so it never holds the port asked for."""
    taken = _early.pop((host, port), None)
    for other in _early.values():
        other.close()
    _early.clear()
    return taken if taken is not None else listen(host, port)


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
