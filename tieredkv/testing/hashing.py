"""Block hashes for tests and tools that run without vLLM (vLLM hashes blocks itself)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def sha256_block_hashes(
    token_ids: Sequence[int], block_size: int, salt: str | None = None
) -> list[bytes]:
    """Chained block hashes for tests and tools that run without vLLM.

    Mirrors vLLM's scheme in spirit: each full block's hash covers its parent hash, its tokens
    and (for the first block) the salt, so equal prefixes give equal hashes across processes.
    """
    hashes: list[bytes] = []
    parent = hashlib.sha256((salt or "").encode()).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.sha256(parent)
        digest.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in block))
        parent = digest.digest()
        hashes.append(parent)
    return hashes
