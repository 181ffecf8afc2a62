"""Latency samples (runtime/latency.py): a packet's trades counted at once keep what counting them one by one keeps."""

from hypothesis import given
from hypothesis import strategies as st

from tape.runtime.latency import EveryNth, LatencySamples


@given(st.lists(st.tuples(st.integers(0, 10**9), st.integers(1, 400)), max_size=200), st.integers(2, 64))
def test_a_weighted_sample_equals_that_many_single_ones(packets, cap):
    weighted, single = LatencySamples(cap), LatencySamples(cap)
    for value, weight in packets:
        weighted.add(value, weight)
        for _ in range(weight):
            single.add(value)
    assert (weighted.count, weighted.max, weighted.stride) == (single.count, single.max, single.stride)
    assert sorted(weighted.samples) == sorted(single.samples) and len(weighted.samples) < cap


@given(st.lists(st.lists(st.integers(0, 10**9), max_size=300), max_size=40), st.integers(2, 64))
def test_a_list_of_samples_equals_them_one_by_one(lists, cap):
    """The emitter adds a delivery's latencies at once."""
    listed, single = LatencySamples(cap), LatencySamples(cap)
    for values in lists:
        listed.extend(values)
        for v in values:
            single.add(v)
    assert (listed.count, listed.max, listed.stride, listed.samples) == (single.count, single.max, single.stride,
                                                                         single.samples)


@given(st.lists(st.integers(0, 40), max_size=30), st.integers(1, 9))
def test_every_nth_picks_the_same_items_however_the_stream_is_cut(cuts, n):
    """A replica measures one delivered packet in LATENCY_SAMPLE_PACKETS, whatever each drain holds."""
    items, picked, every = list(range(sum(cuts))), [], EveryNth(n)
    at = 0
    for cut in cuts:
        picked += every.pick(items[at:at + cut])
        at += cut
    assert picked == items[::n]
