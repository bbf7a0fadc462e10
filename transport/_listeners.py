"""Binding the server's address: ``open_listeners`` (dual stack on ``::``, one port
for every address of a host at port 0), bound before the models load so that an
address in use fails at once."""

from __future__ import annotations

import errno
import ipaddress
import sys
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from trioserve import ServerConfig


async def open_listeners(
    server: ServerConfig, host: str | None = None, port: int | None = None
) -> list[trio.SocketListener]:
    """Bind ``host:port`` (``server``'s by default; port 0 picks a free one). An
    address in use fails here: ``trioserve serve`` binds before it loads the models,
    so that it says so at once rather than after the load.

    The IPv6 any address (``::``) listens dual stack where the system allows it: IPv4
    clients connect too (as ``127.0.0.1`` or any IPv4 address of the machine), as with
    uvicorn, hypercorn or Triton; trio binds it IPv6 only. ``::1`` and every other
    address are bound as given."""
    host = host if host is not None else server.host
    port = port if port is not None else server.port
    if _ipv6_any(host):
        listener = await _dual_stack(port)
        if listener is not None:
            return [listener]
    for _ in range(PORT_0_ATTEMPTS):
        listeners = await trio.open_tcp_listeners(port, host=host)
        if port != 0 or len({ls.socket.getsockname()[1] for ls in listeners}) == 1:
            return listeners
        try:
            return await _on_one_port(listeners)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
    raise OSError(
        errno.EADDRINUSE, f"no free port for every address of {host!r} at once"
    )


#: Tries at port 0 to find one free port on every address of the host.
PORT_0_ATTEMPTS = 8


def _ipv6_any(host: str) -> bool:
    """Whether ``host`` is the IPv6 any address, however written (``::``, ``0::0``)."""
    try:
        return ipaddress.ip_address(host) == ipaddress.IPv6Address("::")
    except ValueError:
        return False


async def _dual_stack(port: int) -> trio.SocketListener | None:
    """A listener on ``[::]:port`` with IPV6_V6ONLY cleared, so that it takes IPv4
    connections too; None where the system will not clear it (an IPv6-only stack:
    then trio's own bind serves IPv6 alone). Binding errors are raised as trio's."""
    sock = trio.socket.socket(trio.socket.AF_INET6, trio.socket.SOCK_STREAM)
    try:
        try:
            sock.setsockopt(trio.socket.IPPROTO_IPV6, trio.socket.IPV6_V6ONLY, 0)
        except (OSError, AttributeError):
            sock.close()
            return None
        if sys.platform != "win32":  # as trio does: on Windows it lets others steal the port
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        await sock.bind(("::", port))
        sock.listen(0xFFFF)  # trio's own backlog (capped by the kernel's)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)


async def _on_one_port(listeners: list[trio.SocketListener]) -> list[trio.SocketListener]:
    """``listeners`` (port 0 on a name of several addresses, such as localhost's
    127.0.0.1 and ::1, where trio gives each address a free port of its own), each
    after the first bound again on the first's port: the one URL printed reaches the
    server at every address of its host. Closes ``listeners`` but the first; on
    failure (that port taken at another address: EADDRINUSE) closes them all."""
    port = listeners[0].socket.getsockname()[1]
    socks = [listeners[0].socket]
    try:
        for old in listeners[1:]:
            sock = trio.socket.socket(old.socket.family, old.socket.type, old.socket.proto)
            socks.append(sock)
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
            if sock.family == trio.socket.AF_INET6:
                sock.setsockopt(trio.socket.IPPROTO_IPV6, trio.socket.IPV6_V6ONLY, 1)
            address = old.socket.getsockname()
            await sock.bind((address[0], port, *address[2:]))
            sock.listen(0xFFFF)  # trio's own backlog (capped by the kernel's)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    finally:
        for old in listeners[1:]:
            old.socket.close()
    return [listeners[0], *(trio.SocketListener(sock) for sock in socks[1:])]
