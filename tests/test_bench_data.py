"""`bench data` (convit_scale/bench/data.py): loader throughput counted over whole waves of worker batches."""


def test_bench_steady_state_counts_whole_waves_of_batches():
    """Two workers making a batch each per second, side by side: 2 batches/s, not the 9 batches in 4 s that
    counting from the first arrival gives; a last batch made alone (odd count) is left out."""
    from convit_scale.bench.data import steady_state

    arrivals = [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    for tail in ([], [6]):
        images, seconds = steady_state(arrivals + tail, [64] * (10 + len(tail)), workers=2)
        assert (images, seconds) == (8 * 64, 4)
    assert steady_state([1, 2, 3, 4], [64] * 4, workers=1) == (3 * 64, 3)
