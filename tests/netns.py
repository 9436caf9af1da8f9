"""Two hosts on one machine for tests of what crosses a network: two network namespaces joined by a veth pair.

Each host has its own address and its own loopback; processes started with :meth:`TwoHosts.run_in` live in that
host's namespace, and everything else (the file system, /tmp, the pids) is shared, as it is for containers on
one machine. :meth:`TwoHosts.cut` takes the link down, as a dead switch port or a partition does: nothing is
killed, packets just stop, and a TCP peer never answers; :meth:`TwoHosts.mend` brings it back. The namespaces
are made by the test and removed after it (needs root, or CAP_NET_ADMIN; CI runs as root).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

_COUNTER = itertools.count()


def available() -> bool:
    """Whether this process can make network namespaces (root and iproute2)."""
    return shutil.which("ip") is not None and os.geteuid() == 0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class TwoHosts:
    """Hosts ``a`` and ``b`` at :attr:`addresses`; names unique to this process, so parallel tests do not meet."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10000}{next(_COUNTER)}"
        self.names = {"a": f"rsa{tag}", "b": f"rsb{tag}"}
        self._links = {"a": f"ra{tag}", "b": f"rb{tag}"}  # interface names: at most 15 characters
        subnet = 10 + (os.getpid() + next(_COUNTER)) % 200
        self.addresses = {"a": f"10.{subnet}.{os.getpid() % 250}.1", "b": f"10.{subnet}.{os.getpid() % 250}.2"}

    def up(self) -> TwoHosts:
        for host in ("a", "b"):
            _ip("netns", "add", self.names[host])
        _ip("link", "add", self._links["a"], "type", "veth", "peer", "name", self._links["b"])
        for host in ("a", "b"):
            ns, link = self.names[host], self._links[host]
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{self.addresses[host]}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def interface(self, host: str) -> str:
        """``host``'s end of the link: give it to gloo as ``GLOO_SOCKET_IFNAME`` (by default gloo takes the address
        the hostname resolves to, which both hosts share)."""
        return self._links[host]

    def run_in(self, host: str, command: list[str]) -> list[str]:
        """``command`` as run in ``host``'s namespace."""
        return ["ip", "netns", "exec", self.names[host], *command]

    def cut(self) -> None:
        """The link goes down: both sides stay up, and nothing sent between them arrives."""
        _ip("-n", self.names["a"], "link", "set", self._links["a"], "down")

    def mend(self) -> None:
        _ip("-n", self.names["a"], "link", "set", self._links["a"], "up")

    def down(self) -> None:
        for host in ("a", "b"):
            subprocess.run(["ip", "netns", "del", self.names[host]], capture_output=True)


@contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    hosts = TwoHosts().up()
    try:
        yield hosts
    finally:
        hosts.down()
