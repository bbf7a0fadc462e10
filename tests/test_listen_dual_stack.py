"""``serve --host ::`` takes IPv4 connections too (dual stack, as uvicorn, hypercorn
and Triton do where the system allows); ``::1`` and other addresses stay as they are."""

from __future__ import annotations

import socket

import pytest
import trio
import trioserve
from http_helpers import config, echo_model, f32
from trioserve.transport import open_gateway, open_http, open_listeners


def _ipv6() -> bool:
    """Whether this machine can listen on IPv6 at all."""
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _ipv6(), reason="this machine has no IPv6")


def _v6only(listener: trio.SocketListener) -> int:
    return listener.socket.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)


async def test_a_server_on_the_ipv6_any_address_answers_over_ipv4():
    async with trioserve.open_runtime(config(echo_model())) as rt, open_gateway(
        rt, host="::", port=0
    ) as gw:
        host, port = gw.addresses[0]
        assert host == "::"
        async with open_http(f"http://127.0.0.1:{port}") as http:  # a real IPv4 connection
            res = await http.infer("echo", {"x": f32(1.0, 2.0)[None]})
        assert res.status == 200, res.body
        async with open_http(f"http://[::1]:{port}") as http:  # and IPv6 still
            res = await http.infer("echo", {"x": f32(3.0)[None]})
        assert res.status == 200, res.body


@pytest.mark.parametrize("host", ["::", "0:0::0", "[::]"])
async def test_the_ipv6_any_address_is_bound_dual_stack(host):
    listeners = await open_listeners(trioserve.ServerConfig(), host.strip("[]"), 0)
    try:
        assert len(listeners) == 1
        assert _v6only(listeners[0]) == 0
        port = listeners[0].socket.getsockname()[1]
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.aclose()
    finally:
        for ls in listeners:
            await ls.aclose()


async def test_the_ipv6_loopback_stays_ipv6_only():
    listeners = await open_listeners(trioserve.ServerConfig(), "::1", 0)
    try:
        assert [_v6only(ls) for ls in listeners] == [1]
    finally:
        for ls in listeners:
            await ls.aclose()


