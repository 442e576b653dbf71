"""runtime/prefix_cache.py: content keys of published pages (the BlockManager's prefix sharing is
tested through the engine in test_prefix_sharing.py and test_block_manager.py)."""

from vexact_models.runtime.prefix_cache import ROOT_KEY, PrefixCache, chain_key


def test_chain_key_is_a_digest_of_the_parent_key_and_the_tokens():
    """Equal parent and tokens give equal 16-byte keys; another token, another order or another
    parent gives another key (a chain stands for its whole prefix)."""
    first = chain_key(ROOT_KEY, (1, 2, 3))
    assert first == chain_key(ROOT_KEY, (1, 2, 3)) and len(first) == 16
    assert len({first, chain_key(ROOT_KEY, (1, 2, 4)), chain_key(ROOT_KEY, (3, 2, 1)), chain_key(first, (1, 2, 3))}) == 4


def test_prefix_cache_serves_the_first_page_published_under_a_key_and_guards_its_content():
    cache = PrefixCache(4)
    key = chain_key(ROOT_KEY, (5, 6))
    assert len(cache) == 0 and cache.key(0) is None and cache.lookup(key, (ROOT_KEY, (5, 6))) is None
    cache.publish(2, key, (ROOT_KEY, (5, 6)))
    cache.publish(3, key, (ROOT_KEY, (5, 6)))  # keyed too (a chain continues through it), not serving
    assert len(cache) == 1 and cache.key(2) == cache.key(3) == key
    assert cache.lookup(key, (ROOT_KEY, (5, 6))) == 2
    assert cache.lookup(key, (ROOT_KEY, (5, 7))) is None  # a key collision is never shared
    cache.forget(3)  # not the serving page: the key still served
    assert cache.key(3) is None and cache.lookup(key, (ROOT_KEY, (5, 6))) == 2
    cache.forget(2)
    assert len(cache) == 0 and cache.lookup(key, (ROOT_KEY, (5, 6))) is None
    cache.forget(1)  # never published: nothing happens
    cache.publish(0, key, (ROOT_KEY, (5, 6)))
    cache.reset()
    assert len(cache) == 0 and cache.key(0) is None and cache.lookup(key, (ROOT_KEY, (5, 6))) is None


def test_a_forgotten_serving_page_hands_its_key_to_the_next_page_published_under_it():
    """Pages holding the same prefix (computed at once by two sequences) all stay reachable: when
    the serving one is forgotten, the next one published under its key serves it."""
    cache = PrefixCache(6)
    key, content = chain_key(ROOT_KEY, (5, 6)), (ROOT_KEY, (5, 6))
    for block in (4, 1, 3):
        cache.publish(block, key, content)
    cache.publish(1, key, content)  # published again: still one copy
    cache.forget(4)
    assert len(cache) == 1 and cache.lookup(key, content) == 1
    cache.forget(3)  # not serving: the serving page stays
    assert cache.key(3) is None and cache.lookup(key, content) == 1
    cache.forget(1)
    assert len(cache) == 0 and cache.lookup(key, content) is None and cache.key(1) is None
    cache.publish(2, key, content)
    cache.publish(0, key, content)
    cache.reset()  # forgets the waiting copies too
    cache.publish(5, key, content)
    cache.forget(5)
    assert len(cache) == 0 and cache.lookup(key, content) is None
