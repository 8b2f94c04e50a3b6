"""The numpy engine's prefix cache: KV arrays of full token blocks, keyed by chained hashes.

A block is `block_size` consecutive prompt tokens starting at a multiple of `block_size`;
its hash covers its tokens and its parent's hash, so equal hashes mean equal prefixes
(vLLM's scheme). Stored blocks are evicted least recently used first when `capacity`
blocks are held. Every change is reported to `on_event` as the vLLM-format KV event
the router understands (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), and
`stats` counts the prompt tokens looked up and the ones found cached.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

KvEvent = dict[str, Any]
MEDIUM = "GPU"  # what vLLM calls the device tier; the router keys on it
_HASH_MASK = (1 << 63) - 1  # the router takes signed 64-bit hashes


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of `tokens` (a trailing partial block has none)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        sha = hashlib.blake2b(digest_size=8)
        sha.update(parent.to_bytes(8, "little"))
        for token in tokens[start : start + block_size]:
            sha.update(int(token).to_bytes(4, "little"))
        parent = int.from_bytes(sha.digest(), "little") & _HASH_MASK
        hashes.append(parent)
    return hashes


@dataclass
class CacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCache:
    """Block hash -> that block's KV (opaque to the cache: per layer, keys and values)."""

    def __init__(self, block_size: int, capacity: int, on_event: Callable[[KvEvent], None]) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError(f"block_size and capacity must be >= 1, got {block_size}, {capacity}")
        self.block_size = block_size
        self.capacity = capacity
        self._on_event = on_event
        self._blocks: OrderedDict[int, Any] = OrderedDict()
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, tokens: Sequence[int]) -> list[Any]:
        """KV of the longest cached prefix of `tokens` that leaves at least one token to
        compute (the last prompt token's logits are always needed), block by block."""
        usable = block_hashes(tokens[:-1], self.block_size) if tokens else []
        found: list[Any] = []
        for h in usable:
            kv = self._blocks.get(h)
            if kv is None:
                break
            self._blocks.move_to_end(h)
            found.append(kv)
        self.stats.queried_tokens += len(tokens)
        self.stats.hit_tokens += len(found) * self.block_size
        return found

    def store(self, tokens: Sequence[int], block_kv: Callable[[int], Any]) -> None:
        """Store every full block of `tokens` from the first one not yet held;
        `block_kv(i)` gives block i's KV."""
        hashes = block_hashes(tokens, self.block_size)
        first_new = 0
        while first_new < len(hashes) and hashes[first_new] in self._blocks:
            self._blocks.move_to_end(hashes[first_new])
            first_new += 1
        new = hashes[first_new:]
        if not new:
            return
        for i, h in enumerate(new, start=first_new):
            self._blocks[h] = block_kv(i)
        start = first_new * self.block_size
        self._on_event(
            {
                "type": "BlockStored",
                "block_hashes": new,
                "parent_block_hash": hashes[first_new - 1] if first_new else None,
                "token_ids": [int(t) for t in tokens[start : start + len(new) * self.block_size]],
                "block_size": self.block_size,
                "lora_id": None,
                "medium": MEDIUM,
            }
        )
        self.stats.stored_blocks += len(new)
        self._evict()

    def _evict(self) -> None:
        gone: list[int] = []
        while len(self._blocks) > self.capacity:
            h, _ = self._blocks.popitem(last=False)
            gone.append(h)
        if gone:
            self.stats.evicted_blocks += len(gone)
            self._on_event({"type": "BlockRemoved", "block_hashes": gone, "medium": MEDIUM})

    def clear(self) -> None:
        """Drop every block and tell the router so."""
        self._blocks.clear()
        self._on_event({"type": "AllBlocksCleared"})
