"""Which trainer rank pushes the weights to which SGLang server.

Every rank holds the full gathered tensors during a push (`convert.weights.gather_all_stages_hf_weights`),
so any rank can push. Host-local handles (`weight_sync tensor`: shared memory, CUDA-IPC) reach only a
server on the pusher's host, so each server is dealt to one of the ranks it is local to: the servers
local to the same ranks (one host's) in URL order over those ranks in rank order, so that colocated
server i (on trainer rank i's GPU, as `armor ray-train` lists them) gets its weights from rank i, and
every node pushes to its own servers at once. The other update paths (distributed, disk) reach any
server, and rank 0 pushes to all of them.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

import torch.distributed as dist

from megatron_armor.utils.net import on_this_host


def deal_servers_to_ranks(
    urls: Sequence[str], local_to_rank: Sequence[Sequence[bool]], *, ranks_span_hosts: bool = False
) -> list[list[str]]:
    """Per rank, the servers it pushes to. `local_to_rank[r][i]`: whether server i is on rank r's host;
    `ranks_span_hosts`: the ranks run on more than one host. ValueError for a server listed twice, a
    loopback URL while the ranks span hosts (it names a different server, or none, on each host), or a
    server on no trainer rank's host."""
    normalized = [url.rstrip("/") for url in urls]
    twice = sorted({url for url in normalized if normalized.count(url) > 1})
    if twice:
        raise ValueError(f"rollout servers listed more than once: {twice}")
    if ranks_span_hosts and (loopback := [url for url in urls if _is_loopback(url)]):
        raise ValueError(f"the trainer ranks run on several hosts, so the loopback server URLs {loopback} name a "
                         f"different server on each: give the servers' addresses")
    dealt: list[list[str]] = [[] for _ in local_to_rank]
    seen: dict[tuple[int, ...], int] = {}  # ranks a server is local to -> servers of theirs dealt so far
    unreached = []
    for i, url in enumerate(urls):
        ranks = tuple(r for r, local in enumerate(local_to_rank) if local[i])
        if not ranks:
            unreached.append(url)
            continue
        position = seen[ranks] = seen.get(ranks, -1) + 1
        dealt[ranks[position % len(ranks)]].append(url)
    if unreached:
        raise ValueError(
            f"weight_sync tensor hands the servers shared-memory / CUDA-IPC handles, which only a trainer rank on "
            f"their host can send, but {', '.join(unreached)} {'is' if len(unreached) == 1 else 'are'} on no trainer "
            f"rank's host: use rollout.weight_sync.method distributed (or disk)"
        )
    return dealt


def push_urls_of_this_rank(urls: Sequence[str], weight_sync: str) -> list[str]:
    """The servers this rank pushes weights to (collective over the default group when it is initialised)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if weight_sync != "tensor":
        return list(urls) if rank == 0 else []
    mine = (socket.gethostname(), [on_this_host(url) for url in urls])
    every: list = [mine]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, mine)
    local = [flags for _, flags in every]
    span = len({host for host, _ in every}) > 1 or any(0 < sum(column) < world for column in zip(*local))
    return deal_servers_to_ranks(urls, local, ranks_span_hosts=span)[rank]


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
