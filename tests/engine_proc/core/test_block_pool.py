from engine_proc.core.block_pool import BlockPool


def test_allocation_takes_head_and_free_goes_to_tail_keeping_hash():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.allocate(), pool.allocate()
    assert (a.block_id, b.block_id) == (0, 1)
    pool.cache(a, b"h-a", parent=-1)
    pool.free(a)
    # a keeps its hash and sits at the tail: 2 and 3 are handed out before it.
    assert a.block_hash == b"h-a" and pool.lookup(b"h-a") is a
    assert [pool.allocate().block_id for _ in range(2)] == [2, 3]
    c = pool.allocate()
    assert c is a and c.block_hash is None and pool.lookup(b"h-a") is None  # evicted only now


def test_reviving_a_cached_free_block_keeps_its_hash_and_hits_again():
    # Regression (nano-vllm lost hits this way): a hit on a free cached block must not go
    # through the fresh-allocation path that clears its hash.
    pool = BlockPool(3, enable_caching=True)
    blk = pool.allocate()
    pool.cache(blk, b"prefix", parent=-1)
    pool.free(blk)
    hit = pool.lookup(b"prefix")
    pool.touch(hit)
    assert hit.ref_count == 1 and hit.block_hash == b"prefix"
    assert hit.block_id not in pool.free_queue
    pool.free(hit)
    assert pool.lookup(b"prefix") is hit


def test_unhashed_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3, enable_caching=True)
    cached, plain = pool.allocate(), pool.allocate()
    pool.cache(cached, b"x", parent=-1)
    pool.free(cached)
    pool.free(plain)
    assert pool.allocate() is plain


def test_reset_drops_only_unreferenced_hashes():
    pool = BlockPool(3, enable_caching=True)
    held, freed = pool.allocate(), pool.allocate()
    pool.cache(held, b"held", parent=-1)
    pool.cache(freed, b"freed", parent=held.block_id)
    pool.free(freed)
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup(b"freed") is None and pool.lookup(b"held") is held


def test_caching_off_indexes_nothing():
    pool = BlockPool(2, enable_caching=False)
    blk = pool.allocate()
    pool.cache(blk, b"x", parent=-1)
    assert blk.block_hash is None and pool.lookup(b"x") is None
