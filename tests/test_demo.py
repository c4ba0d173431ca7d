"""``tieredkv demo``'s chat: lengths a chat really has (issue 27: they were 1,280 / 1,536 /
1,792 / 2,048 tokens, every one a multiple of 256, so every hit ended on a chunk)."""

from __future__ import annotations

import random

from tieredkv.tools import demo
from tieredkv.tools.vllm_server import BLOCK_SIZE


def test_chat_lengths_are_unaligned_and_seeded():
    prompts = list(demo.conversations(3, 3))
    lengths = [len(tokens) for _, _, tokens in prompts]
    assert lengths == [len(t) for _, _, t in demo.conversations(3, 3)]  # the same every run
    assert lengths != [len(t) for _, _, t in demo.conversations(3, 3, seed=1)]
    assert sum(1 for n in lengths if n % 256 == 0) == 0
    assert sum(1 for n in lengths if n % BLOCK_SIZE == 0) <= 1
    assert len(set(lengths)) == len(lengths)
    # Each user's turn extends that user's previous prompt by a turn in TURN_TOKENS.
    by_user: dict[int, list[int]] = {}
    for _, user, tokens in prompts:
        previous = by_user.get(user)
        if previous is None:
            assert demo.DOC_TOKENS[0] + demo.TURN_TOKENS[0] <= len(tokens)
            assert len(tokens) <= demo.DOC_TOKENS[1] + demo.TURN_TOKENS[1]
        else:
            assert tokens[:len(previous)] == previous
            assert demo.TURN_TOKENS[0] <= len(tokens) - len(previous) <= demo.TURN_TOKENS[1]
        by_user[user] = tokens


def test_follow_up_adds_a_random_length_turn():
    tokens = list(range(1000))
    first = demo.follow_up(tokens, random.Random(1))
    assert first[:1000] == tokens
    assert demo.FOLLOW_UP_TOKENS[0] <= len(first) - 1000 <= demo.FOLLOW_UP_TOKENS[1]
    assert demo.follow_up(tokens, random.Random(1)) == first
