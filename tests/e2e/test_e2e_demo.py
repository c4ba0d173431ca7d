"""``tieredkv demo`` end to end (issue 27: its chat now has unaligned lengths): both runs on real
vLLM servers, every turn after the first a host-tier hit, every follow-up after the restart a
disk-tier hit, each shorter than its prompt and ending inside a chunk."""

from __future__ import annotations

import pytest

from tieredkv.tools import demo

pytestmark = pytest.mark.vllm


def test_demo_hits_host_then_disk_with_unaligned_prompts(tmp_path):
    rows, run1, run2 = demo.play(tmp_path, users=2, turns=2)
    phases = [r.phase for r in rows]
    assert phases == ["cold", "cold", "host tier hit", "host tier hit", "disk tier hit", "disk tier hit"]
    for row in rows:
        assert row.prompt_tokens % 256, row  # the lengths a chat has, not multiples of 256
        if row.phase == "cold":
            assert row.cached_tokens == 0, row
        else:
            assert 0 < row.cached_tokens < row.prompt_tokens, row
    assert run1["hit tokens host"] > 0 and run2["hit tokens disk"] > 0
