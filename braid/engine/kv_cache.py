"""KV cache blocks on the driver: allocation, reference counts and the prefix cache.

Every rank stores its own heads of each block; which block a token goes to is decided here.
A full block of computed tokens is registered under a key, so two sequences whose prompts start
alike share those blocks (each holds a reference) and the second one skips their prefill. A
block nobody references keeps its contents and its key, on an LRU list, until a new allocation
needs it.

Serving one prompt's KV to another leaks what the first prompt said, so a key (`BlockKey`) is
the block's tokens themselves next to a SHA-256 digest chained from the previous block's digest
(see `block_key`). The chain starts at a root digest of a random salt drawn per `BlockManager`
and the sequence's `cache_salt`: digests cannot be predicted or matched across servers, and
prompts under different cache salts never share a block. Every lookup compares the block's
tokens, and the digest stands for every block before it: serving a block computed for other
tokens would take a SHA-256 collision under a salt nobody outside the server knows.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from collections import OrderedDict

from braid.config import KVCacheConfig
from braid.engine.request import Sequence

# Prefix-cache key of a full block: (chain digest, its tokens as little-endian int64 bytes).
# Dicts and sets compare both, so a hit needs the exact tokens. Bytes cache their hash: looking
# a sequence's keys up again (the scheduler does, every step it waits) hashes no tokens.
BlockKey = tuple[bytes, bytes]


def block_key(parent: bytes, tokens: bytes) -> bytes:
    """Chain digest of a full block: SHA-256 of the previous block's digest (or the sequence's
    root digest) and the block's tokens (fixed-width bytes, so the input splits one way only).
    It stands for the whole prefix up to this block; the block's own tokens are compared
    besides, on every lookup."""
    return hashlib.sha256(parent + tokens).digest()


class BlockManager:
    """Fixed-size KV blocks with reference counts and a prefix cache of full blocks."""

    def __init__(self, cache: KVCacheConfig) -> None:
        block_size = self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks
        self.prefix_caching = cache.prefix_caching
        self._free = list(range(self.num_blocks - 1, 0, -1))  # no cached contents
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self._refs = [0] * self.num_blocks
        self._key_of: dict[int, BlockKey] = {}
        self._block_of: dict[BlockKey, int] = {}
        self._salt = secrets.token_bytes(16)  # roots every key: unpredictable, per server
        self._pack = struct.Struct(f"<{block_size}q").pack  # a full block's tokens as bytes

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take (cached but unreferenced blocks included)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks some sequence references."""
        return self.num_blocks - 1 - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / (self.num_blocks - 1)

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def blocks_needed(self, num_tokens: int, held: int) -> int:
        """More blocks a sequence holding `held` blocks needs to store `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - held)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks with one reference each; the least recently used cached blocks are
        evicted (their keys forgotten) once no empty block is left."""
        if count > self.num_free:
            raise MemoryError(f"KV cache needs {count} blocks, {self.num_free} free")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Released last to first, so a sequence's tail is
        evicted before its prefix, which other prompts are likelier to share."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            assert self._refs[block] >= 0, f"block {block} freed twice"
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def _root(self, cache_salt: str | None) -> bytes:
        """Digest a sequence's first block chains from: this cache's random salt and the
        request's `cache_salt` (no salt and an empty one differ)."""
        tag = b"" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8", "surrogatepass")
        return hashlib.sha256(self._salt + tag).digest()

    def _key(self, seq: Sequence, i: int) -> BlockKey:
        """Key of the sequence's block i (computed once, kept in `seq.block_keys`)."""
        while len(seq.block_keys) <= i:
            j = len(seq.block_keys)
            tokens = self._pack(*seq.token_slice(j * self.block_size, (j + 1) * self.block_size))
            parent = seq.block_keys[-1][0] if j else self._root(seq.params.cache_salt)
            seq.block_keys.append((block_key(parent, tokens), tokens))
        return seq.block_keys[i]

    def shareable_keys(self, seq: Sequence) -> list[BlockKey]:
        """Keys of the sequence's blocks another sequence could share: its full blocks before
        the last token (the ones `match_prefix` looks up)."""
        if not self.prefix_caching:
            return []
        return [self._key(seq, i) for i in range((seq.num_tokens - 1) // self.block_size)]

    def cached_prefix(self, keys: list[BlockKey]) -> int:
        """How many of the leading `keys` the prefix cache holds (same digests, same tokens)."""
        count = 0
        while count < len(keys) and keys[count] in self._block_of:
            count += 1
        return count

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of the sequence's tokens made of full
        blocks, leaving at least one token to compute (its logits are needed); each gets a
        reference."""
        keys = self.shareable_keys(seq)
        return self.share(keys[:self.cached_prefix(keys)])

    def share(self, keys: list[BlockKey]) -> list[int]:
        """The cached blocks of `keys` (all cached), each with one more reference."""
        blocks = [self._block_of[key] for key in keys]
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        return blocks

    def num_unreferenced(self, keys: list[BlockKey]) -> int:
        """How many of the cached blocks of `keys` nobody references: sharing them takes them
        from the blocks an allocation could use."""
        return sum(self._refs[self._block_of[key]] == 0 for key in keys)

    def register(self, seq: Sequence) -> None:
        """Publish the sequence's newly filled blocks of computed tokens in the prefix cache.
        A block whose prefix another block already holds stays private (freed, not cached)."""
        if not self.prefix_caching:
            return
        full = seq.num_computed // self.block_size
        for i in range(seq.num_registered_blocks, full):
            block, key = seq.blocks[i], self._key(seq, i)
            if block not in self._key_of and key not in self._block_of:
                self._key_of[block] = key
                self._block_of[key] = block
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)
