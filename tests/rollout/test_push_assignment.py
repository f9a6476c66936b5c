"""Which trainer rank pushes the weights to which server (`rollout.push_assignment`)."""

import pytest

from megatron_armor.rollout.push_assignment import deal_servers_to_ranks, push_urls_of_this_rank

A = ["http://10.0.0.1:1", "http://10.0.0.1:2"]
B = ["http://10.0.0.2:1", "http://10.0.0.2:2", "http://10.0.0.2:3"]


def local(urls, host):
    """Whether each server is on the host with this address."""
    return [url.startswith(f"http://{host}:") for url in urls]


def test_each_hosts_servers_are_dealt_over_its_ranks_in_order():
    """Two nodes of two ranks (colocated: server i on rank i's GPU), then three servers on a two-rank node."""
    urls = [A[0], B[0], A[1], B[1]]
    hosts = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]
    assert deal_servers_to_ranks(urls, [local(urls, h) for h in hosts]) == [[A[0]], [A[1]], [B[0]], [B[1]]]
    urls = A + B
    hosts = ["10.0.0.1", "10.0.0.2", "10.0.0.2"]
    assert deal_servers_to_ranks(urls, [local(urls, h) for h in hosts]) == [A, [B[0], B[2]], [B[1]]]


def test_bad_server_lists_are_refused_naming_the_servers():
    hosts = ["10.0.0.1", "10.0.0.1"]
    urls = A + ["http://10.0.0.3:1"]
    with pytest.raises(ValueError, match=r"but http://10\.0\.0\.3:1 is on no trainer rank's host: use "
                                         r"rollout\.weight_sync\.method distributed"):
        deal_servers_to_ranks(urls, [local(urls, h) for h in hosts])
    urls = [A[0], A[0] + "/"]
    with pytest.raises(ValueError, match=r"listed more than once: \['http://10\.0\.0\.1:1'\]"):
        deal_servers_to_ranks(urls, [local(urls, h) for h in hosts])
    urls = ["http://127.0.0.1:1", "http://localhost:2"]
    with pytest.raises(ValueError, match="several hosts, so the loopback server URLs"):
        deal_servers_to_ranks(urls, [[True, True], [True, True]], ranks_span_hosts=True)
    assert deal_servers_to_ranks(urls, [[True, True], [True, True]]) == [[urls[0]], [urls[1]]]  # one host


def test_a_single_process_pushes_to_every_local_server_and_rank_0_for_other_paths():
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert push_urls_of_this_rank(urls, "tensor") == urls
    assert push_urls_of_this_rank(["http://203.0.113.7:1"], "distributed") == ["http://203.0.113.7:1"]
    with pytest.raises(ValueError, match="on no trainer rank's host"):
        push_urls_of_this_rank(["http://203.0.113.7:1"], "tensor")
