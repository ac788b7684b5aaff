"""The ranks' rendezvous: torch.distributed's TCPStore, served by rank 0 on one address only.

torch's ``tcp://HOST:PORT`` init method makes rank 0's store listen on every interface (``*:PORT``, IPv4 and
IPv6), whatever HOST says, unauthenticated, for the whole life of the process group. The ranks of an engine
are processes of one machine (in a pod, of one network namespace), so rank 0 binds the store's socket to
loopback itself and hands it to the store (``master_listen_fd``). Gloo's own sockets (one listener per
rank, one connection per peer) go on the loopback interface too (``GLOO_SOCKET_IFNAME``, unless it is set):
by default gloo takes the address the host name resolves to, which in a pod is the pod's IP.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

import torch.distributed as dist

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
LOOPBACK_IFNAME = "lo"  # Linux's loopback interface


def join(backend: str, rank: int, world: int, store: tuple[str, int], timeout: timedelta) -> None:
    """Join the default process group of ``world`` ranks as ``rank``; rank 0 serves the store at ``store``
    (host, port), bound to that address only."""
    host, port = store
    if backend == "gloo" and ipaddress.ip_address(host).is_loopback:
        os.environ.setdefault(GLOO_IFNAME, LOOPBACK_IFNAME)
    listen_fd = _listen(host, port) if rank == 0 else None
    tcp = dist.TCPStore(host, port, world, rank == 0, timeout, master_listen_fd=listen_fd)
    dist.init_process_group(backend, store=tcp, rank=rank, world_size=world, timeout=timeout)


def _listen(host: str, port: int) -> int:
    """A socket listening on ``host:port`` only, as a file descriptor the store takes over (and closes)."""
    return socket.create_server((host, port)).detach()
