"""Budgets for what strangers may make a node do: token buckets, one or one a host. Pure: the
caller passes the time.

`PerHost` keeps a bucket for each of at most `max_hosts` sender hosts (the least recently seen
forgotten first, so a flood of forged sources costs bounded memory and, forgotten, starts
again at a full burst: the shared bucket beside it bounds the total)."""

from __future__ import annotations

from collections import OrderedDict


class TokenBucket:
    """`rate_per_s` tokens a second, at most `burst` held; one taken per thing allowed."""

    def __init__(self, rate_per_s: float, burst: float, now: float):
        self.rate, self.burst = rate_per_s, burst
        self.tokens, self.at = burst, now

    def take(self, now: float, n: float = 1.0) -> bool:
        """`n` tokens if there are as many (at most `burst` ever are), else none."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < n:
            return False
        self.tokens -= n
        return True


class PerHost:
    """A TokenBucket for each sender host, of the `max_hosts` seen most recently."""

    def __init__(self, rate_per_s: float, burst: float, max_hosts: int):
        self.rate, self.burst, self.max_hosts = rate_per_s, burst, max_hosts
        self._buckets: OrderedDict = OrderedDict()  # host -> TokenBucket, least recently seen first

    def take(self, host, now: float) -> bool:
        bucket = self._buckets.get(host)
        if bucket is None:
            if len(self._buckets) >= self.max_hosts:
                self._buckets.popitem(last=False)
            bucket = self._buckets[host] = TokenBucket(self.rate, self.burst, now)
        else:
            self._buckets.move_to_end(host)
        return bucket.take(now)


class StrangerBudget:
    """Which datagrams from where are worth a MAC check: every one from a configured client's
    address (`known`: never limited here, so a forger cannot get a client's own address
    throttled); from any other host, its PerHost bucket's and a bucket all such hosts share."""

    def __init__(self, known: frozenset, rate_per_s: float, total_rate_per_s: float, max_hosts: int):
        self.known = known
        self._hosts = PerHost(rate_per_s, rate_per_s, max_hosts)
        self._total = TokenBucket(total_rate_per_s, total_rate_per_s, 0.0)

    def allow(self, host, now: float) -> bool:
        return host in self.known or (self._hosts.take(host, now) and self._total.take(now))
