"""The prompt cache evicts the least recently used entry of any type; a fetch is
a use, and an earlier turn of a conversation that has moved on goes first,
while a system prompt several conversations branch from keeps its place."""

from __future__ import annotations

from veloxpatch.serve.prompt_cache import BoundedPromptCache

KEY = ("tiny", None, None)


class Untrimmable:
    """A cache entry as kvzip's: priced, not trimmable (its prefixes stay)."""

    nbytes = 100

    def is_trimmable(self):
        return False

    def empty(self):
        return False


def keep(store, tokens, cache_type="user"):
    store._keep(KEY, list(tokens), [Untrimmable()], cache_type, to_disk=False)


def kept(store):
    return sorted(tuple(t) for _, t, _ in store._lru._all)


def test_a_fetched_entry_outlives_one_kept_after_it():
    store = BoundedPromptCache(max_size=2)
    keep(store, [1, 2, 3])
    keep(store, [4, 5, 6])
    cache, rest = store.fetch_nearest_cache(KEY, [1, 2, 3, 7])
    assert cache is not None and rest == [7]
    keep(store, [8, 9])
    assert kept(store) == [(1, 2, 3), (8, 9)]


def test_eviction_is_by_recency_not_by_entry_type():
    """mlx-lm's order evicts from the longest of its per-type lists: two system
    entries would push out the newer user entry."""
    store = BoundedPromptCache(max_size=3)
    keep(store, [1, 1], "user")
    keep(store, [2, 2], "system")
    keep(store, [3, 3], "system")
    keep(store, [4, 4], "user")
    assert kept(store) == [(2, 2), (3, 3), (4, 4)]
    assert store.stats_by_type()["user"]["n_sequences"] == 1


def test_an_earlier_turn_goes_before_another_users_conversation():
    store = BoundedPromptCache(max_size=3)
    keep(store, [1, 2, 3])  # user A, turn 1
    keep(store, [9, 9, 9])  # user B
    keep(store, [1, 2, 3, 4, 5])  # user A, turn 2: turn 1 is behind it
    keep(store, [7, 7])
    assert kept(store) == [(1, 2, 3, 4, 5), (7, 7), (9, 9, 9)]


def test_a_system_prompt_two_conversations_extend_keeps_its_place():
    store = BoundedPromptCache(max_size=4)
    keep(store, [1, 2], "system")
    keep(store, [1, 2, 3])
    store.fetch_nearest_cache(KEY, [1, 2, 4])  # a second user reads it
    keep(store, [1, 2, 4])  # and branches from it
    keep(store, [9, 9])
    keep(store, [8, 8])  # evicts the oldest: A's [1, 2, 3]
    assert kept(store) == [(1, 2), (1, 2, 4), (8, 8), (9, 9)]
    assert store.nbytes == 400


def test_the_cache_says_which_prompts_an_entry_holds_exactly():
    store = BoundedPromptCache()
    keep(store, [1, 2, 3])
    assert store.holds_prompt([1, 2, 3])
    assert not store.holds_prompt([1, 2]) and not store.holds_prompt([1, 2, 3, 4])


def test_a_replay_is_served_before_the_prompts_waiting_to_be_read():
    from types import SimpleNamespace

    from veloxpatch.serve.server import ReplaysFirst

    queue = ReplaysFirst()
    for name, replay in (("a", False), ("b", False), ("retry", True), ("c", False)):
        queue.put((None, name, SimpleNamespace(replay=replay)))
    assert [queue.get()[1] for _ in range(4)] == ["retry", "a", "b", "c"]
