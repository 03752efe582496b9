"""Which network interfaces own a host's addresses, and the UCX options that keep UCX's
TCP listeners on them (docs/kv-transfer.md §5).

A UCX worker opens a listening TCP socket on one address of every network interface it
uses, whether or not a UCX listener is made: its TCP transport accepts the connections
of endpoints made from its worker address. UCX has no option naming an address to bind,
only the interfaces to use (NET_DEVICES) and the address family (TCP_AF_PRIO), so the
interfaces that do not own the configured host are left out by name. RDMA devices
(mlx5_0:1 …) are not network interfaces, open no IP listener, and stay in use.
"""
from __future__ import annotations

import ipaddress
import socket

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def interface_addresses() -> dict[str, set[IPAddress]]:
    """Each network interface that is up -> its IPv4 and IPv6 addresses (what UCX reads,
    through getifaddrs(3))."""
    import psutil  # the ucx extra's: only the UCX transport asks

    up = {name for name, stats in psutil.net_if_stats().items() if stats.isup}
    found: dict[str, set[IPAddress]] = {}
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if name in up and entry.family in (socket.AF_INET, socket.AF_INET6):
                found.setdefault(name, set()).add(ipaddress.ip_address(entry.address.partition("%")[0]))
    return found


def host_addresses(host: str) -> set[IPAddress]:
    """The addresses `host` (an address, [IPv6] or a name) stands for; ValueError if none."""
    bare = host.strip("[]") if isinstance(host, str) else ""
    if not bare:
        raise ValueError(f"host: {host!r} is not a host name or address")
    try:
        return {ipaddress.ip_address(bare.partition("%")[0])}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(bare, None, proto=socket.IPPROTO_TCP)
    except OSError as error:
        raise ValueError(f"host: cannot resolve {host!r}: {error}") from None
    return {ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in infos}


def ucx_device_options(host: str, interfaces: dict[str, set[IPAddress]]) -> dict[str, str]:
    """UCX context options (config-dict keys, without the UCX_ prefix) under which UCX's TCP
    transport uses only the interfaces owning `host`'s addresses (`interfaces`: as
    `interface_addresses` gives them), in `host`'s address family. A wildcard host (0.0.0.0,
    ::) binds every interface, as ZeroMQ does: no options. ValueError if no interface owns
    the host."""
    addresses = host_addresses(host)
    if any(address.is_unspecified for address in addresses):
        return {}
    owners = {name for name, owned in interfaces.items() if owned & addresses}
    if not owners:
        raise ValueError(f"host: {host!r} ({', '.join(sorted(map(str, addresses)))}) is not an address of any "
                         f"network interface of this machine ({', '.join(sorted(interfaces))})")
    options = {}
    others = sorted(set(interfaces) - owners)
    if others:
        options["NET_DEVICES"] = "^" + ",".join(others)
    families = {address.version for address in addresses}
    if len(families) == 1:  # of an interface with both, UCX would bind its IPv4 address first
        options["TCP_AF_PRIO"] = "inet" if families == {4} else "inet6"
    return options
