"""DPLoadBalancer: the score 4 * waiting + running, own sends counted, dead engines skipped,
prompt_cache_key affinity."""

from __future__ import annotations

import pytest

from pagedllm.engine.load_balancer import STICKY_SLACK, DPLoadBalancer


def test_burst_splits_evenly_between_idle_engines():
    lb = DPLoadBalancer(2)
    picks = [lb.choose() for _ in range(200)]
    assert picks.count(0) == picks.count(1) == 100


def test_busy_engine_gets_fewer_new_requests():
    lb = DPLoadBalancer(2)
    lb.update([[0, 12], [0, 0]])  # engine 0 runs 12 requests, engine 1 is idle
    picks = [lb.choose() for _ in range(20)]
    # Engine 1 takes every request until its score (4 per waiting) passes 12: 3 in a row.
    assert picks[:3] == [1, 1, 1]
    assert picks.count(1) > picks.count(0)


def test_waiting_weighs_four_times_running():
    lb = DPLoadBalancer(2)
    lb.update([[1, 0], [0, 3]])  # scores 4 and 3
    assert lb.choose() == 1


def test_a_publish_replaces_the_counts():
    lb = DPLoadBalancer(2)
    for _ in range(5):
        lb.choose()
    lb.update([[0, 0], [7, 0]])
    assert lb.counts == [[0, 0], [7, 0]]
    assert lb.choose() == 0


def test_dead_engines_are_skipped():
    lb = DPLoadBalancer(3)
    assert {lb.choose(dead={1}) for _ in range(10)} == {0, 2}
    with pytest.raises(ValueError, match="no live"):
        lb.choose(dead={0, 1, 2})


def test_ties_start_at_the_client_index():
    assert DPLoadBalancer(2, client_index=1).choose() == 1
    assert DPLoadBalancer(2, client_index=0).choose() == 0


def test_a_cache_key_stays_on_its_home_engine():
    lb = DPLoadBalancer(2)
    keys = [f"doc-{i}" for i in range(40)]
    homes = [lb.home(k) for k in keys]
    assert set(homes) == {0, 1}  # keys spread over the engines
    assert homes == [DPLoadBalancer(2, client_index=1).home(k) for k in keys]  # any process
    home = homes[0]
    # The key's requests stay home, idle as the other engine is, while home is at most
    # STICKY_SLACK above the idlest (four more waiting requests here).
    assert [lb.choose(key=keys[0]) for _ in range(5)] == [home] * 5
    assert lb.choose() == 1 - home


def test_a_hot_key_overflows_then_returns():
    lb = DPLoadBalancer(2)
    home = lb.home("hot")
    lb.counts[home] = [0, STICKY_SLACK + 1]  # its home now far busier than the other
    assert lb.choose(key="hot") == 1 - home
    lb.update([[0, 0], [0, 0]])
    assert lb.choose(key="hot") == home
    assert lb.choose(dead={home}, key="hot") == 1 - home  # a dead home: the idlest
