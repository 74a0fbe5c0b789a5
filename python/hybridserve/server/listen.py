"""Where the server listens: `--host`/`--port` (TCP), or `--uds PATH` (a Unix domain socket, as
vLLM's flag: for a proxy or a sidecar on the same machine, with the file's permissions as the
access control). HTTPS (`tls.py`) works on either."""

from __future__ import annotations

import os
import socket
import ssl
import stat
from dataclasses import dataclass

from aiohttp import web


class ListenError(OSError):
    """The server cannot listen where it was told; the message says why."""


@dataclass
class Listening:
    site: web.BaseSite
    where: str  # for the log: "http://127.0.0.1:8000", "http+unix:/run/hs.sock"
    socket_path: str | None = None  # the socket file this server made (removed when it stops)
    socket_inode: int | None = None

    def remove_socket(self) -> None:
        """Removes the socket file, if it is still the one this server made (not one that another
        server made at the same path since)."""
        if self.socket_path is None:
            return
        try:
            if os.stat(self.socket_path).st_ino == self.socket_inode:
                os.unlink(self.socket_path)
        except OSError:
            pass


def _clear_stale_socket(path: str) -> None:
    """A socket file left by a server that is gone is removed; a live one, or any other file,
    is an error (never removed)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ListenError(f"--uds {path}: the path exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        try:
            os.unlink(path)  # nobody listens: a server that stopped without removing it
        except OSError as e:
            raise ListenError(f"--uds {path}: cannot remove the stale socket there: {e}") from None
        return
    except OSError as e:
        raise ListenError(f"--uds {path}: cannot check the socket there: {e}") from None
    finally:
        probe.close()
    raise ListenError(f"--uds {path}: another server listens on this socket")


async def listen(
    runner: web.AppRunner, host: str, port: int, uds: str | None, tls: ssl.SSLContext | None
) -> Listening:
    """Starts the runner's site; raises ListenError when it cannot."""
    scheme = "http" if tls is None else "https"
    if uds is not None:
        _clear_stale_socket(uds)
        site: web.BaseSite = web.UnixSite(runner, uds, ssl_context=tls)
        try:
            await site.start()
        except OSError as e:
            raise ListenError(f"cannot listen on the socket {uds}: {e}") from None
        return Listening(site, f"{scheme}+unix:{uds}", uds, os.stat(uds).st_ino)
    site = web.TCPSite(runner, host, port, ssl_context=tls)
    try:
        await site.start()
    except OSError as e:  # the port is taken, the host does not resolve or is not ours
        raise ListenError(f"cannot listen on {host}:{port}: {e}") from None
    server = getattr(site, "_server", None)
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    return Listening(site, f"{scheme}://{host}:{bound}")
