"""The TCPStore a rank hosts so that a data-parallel group can meet without a shared directory.

On one node the dispatcher names a FileStore path in ``run.dir/groups`` for each membership
version. Ranks on nodes that share no directory (``drafter.rendezvous=tcp``, the default with
``pool.transport=nixl``) meet on a ``torch.distributed.TCPStore`` instead: every rank process
hosts one from its start, bound to ``drafter.rendezvous_host``, and advertises ``HOST:PORT`` when
it registers. The dispatcher names the store of the version's rank 0 — the source of its state,
a live rank — under a key prefix of the version's own, so successive versions on one server never
see each other's keys (:mod:`drafter_worker.process_group` opens it).

Why rank 0's store and not the dispatcher's: the dispatcher stays torch-free (the TCPStore wire
format is torch's own), and a store that lives exactly as long as a member of the version needs no
process of its own: when rank 0 dies its version is over anyway, and the next one meets on the new
rank 0's store. The store and the collectives are not authenticated (torch.distributed's are not):
bind them to the cluster's private network.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket

import psutil
import torch.distributed as dist

from common.run.config import ConfigError, DrafterSection
from common.wire.store_names import store_address

log = logging.getLogger("hsd.drafter")

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def address_towards(endpoint: str) -> str:
    """This host's address on the route to ``endpoint`` (``tcp://HOST:PORT``; 127.0.0.1 for ``ipc://``).

    A UDP ``connect`` sends nothing: it only asks the kernel which local address that route uses."""
    if not endpoint.startswith("tcp://"):
        return "127.0.0.1"
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    try:
        family, _, _, _, peer = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(peer)
            return probe.getsockname()[0]
    except (OSError, ValueError) as exc:
        raise ConfigError(f"drafter.rendezvous_host: no address of this host on the route to dispatcher.endpoint "
                          f"{endpoint} ({exc}); set drafter.rendezvous_host") from None


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` (None: none of this host's)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    return None


class RendezvousServer:
    """This rank's TCPStore: bound to one address, its port chosen by the kernel, up until the process exits."""

    def __init__(self, host: str, *, timeout_s: float):
        try:
            family, _, _, _, bind_to = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.bind(bind_to)
        except OSError as exc:
            raise ConfigError(f"drafter.rendezvous_host: cannot bind this rank's rendezvous store to {host!r}: "
                              f"{exc}") from None
        listener.listen(128)
        self.host, port = listener.getsockname()[:2]
        # The store serves the socket bound here, so it listens on this one address, not on every interface.
        self.store = dist.TCPStore(self.host, port, is_master=True, wait_for_workers=False,
                                   master_listen_fd=listener.detach(), timeout=datetime.timedelta(seconds=timeout_s))
        self.port = self.store.port
        self.address = store_address(self.host, self.port)

    @classmethod
    def for_rank(cls, drafter: DrafterSection, *, control_endpoint: str) -> RendezvousServer:
        """The store of a rank of a group (drafter.rendezvous=tcp) whose dispatcher is at
        ``control_endpoint``. Gloo, which picks its interface from the hostname (127.0.1.1 on many
        hosts, unreachable from another node), takes the store's unless GLOO_SOCKET_IFNAME says otherwise."""
        host = drafter.rendezvous_host or address_towards(control_endpoint)
        server = cls(host, timeout_s=drafter.collective_timeout_s)
        interface = interface_of(server.host)
        if interface is not None and GLOO_IFNAME_ENV not in os.environ:
            os.environ[GLOO_IFNAME_ENV] = interface  # read by gloo each time a process group is made
        log.info("rendezvous store of this rank at %s (gloo on %s)", server.address,
                 os.environ.get(GLOO_IFNAME_ENV, "the hostname's interface"))
        return server
