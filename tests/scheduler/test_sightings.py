"""Admission by sightings on its own (``disk_admission``, ``remote_admission``): a key is
admitted once seen often enough, and only the most recently seen keys are remembered."""

from __future__ import annotations

import pytest

from tieredkv.scheduler.lower_tier import Sightings


def test_a_key_is_admitted_from_its_nth_sighting_on():
    seen = Sightings(admission=3, limit=8)
    assert [seen.note(b"a") for _ in range(4)] == [False, False, True, True]
    assert seen.admits(b"a")
    assert not seen.admits(b"b") and not seen.note(b"b")  # counted per key


def test_admission_one_admits_at_the_first_sighting_and_never_before():
    seen = Sightings(admission=1, limit=8)
    assert not seen.admits(b"a")
    assert seen.note(b"a") and seen.admits(b"a")


def test_only_the_most_recently_seen_keys_are_remembered():
    seen = Sightings(admission=2, limit=2)
    seen.note(b"a")
    seen.note(b"b")
    seen.note(b"a")  # a is now the most recent: b goes first
    seen.note(b"c")
    assert not seen.note(b"b")  # forgotten: its count starts again
    assert not seen.admits(b"a")  # admitted before, but the least recent made room for b
    assert seen.note(b"c") and seen.admits(b"c")  # c was kept: its second sighting admits it


def test_clear_forgets_every_count():
    seen = Sightings(admission=2, limit=8)
    seen.note(b"a")
    seen.note(b"a")
    seen.clear()
    assert not seen.admits(b"a") and not seen.note(b"a")


@pytest.mark.parametrize(("admission", "limit"), [(0, 8), (1, 0)])
def test_admission_and_limit_below_one_are_refused(admission, limit):
    with pytest.raises(ValueError, match="admission and limit"):
        Sightings(admission, limit)
