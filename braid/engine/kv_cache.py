"""KV cache blocks on the driver: allocation, reference counts and the prefix cache.

Every rank stores its own heads of each block; which block a token goes to is decided here.
A full block of computed tokens is registered under a key chained from its tokens and the key
of the block before it, so two sequences whose prompts start alike share those blocks (each
holds a reference) and the second one skips their prefill. A block nobody references keeps its
contents and its key, on an LRU list, until a new allocation needs it.
"""

from __future__ import annotations

from collections import OrderedDict

from braid.engine.request import Sequence

# Key of the (empty) prefix before a sequence's first block.
ROOT_KEY = 0


def block_key(parent: int, tokens: list[int]) -> int:
    """Prefix-cache key of a full block: its tokens chained to the previous block's key.
    Python's hash of a tuple of ints is deterministic and 64 bits wide: a collision between
    two different prefixes is about as likely as 2**-40 over a million cached blocks."""
    return hash((parent, tuple(tokens)))


def num_kv_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks of a cache of `num_tokens` tokens, plus block 0 (never handed out: block tables
    pad with it)."""
    return num_tokens // block_size + 1


def kv_capacity_tokens(num_tokens: int, block_size: int) -> int:
    """Tokens a cache sized for `num_tokens` holds (whole blocks)."""
    return (num_kv_blocks(num_tokens, block_size) - 1) * block_size


class BlockManager:
    """Fixed-size KV blocks with reference counts and a prefix cache of full blocks."""

    def __init__(self, num_tokens: int, block_size: int, prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_kv_blocks(num_tokens, block_size)
        self.prefix_caching = prefix_caching
        self._free = list(range(self.num_blocks - 1, 0, -1))  # no cached contents
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self._refs = [0] * self.num_blocks
        self._key_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}

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

    def _key(self, seq: Sequence, i: int) -> int:
        """Key of the sequence's block i (computed once, kept in `seq.block_keys`)."""
        while len(seq.block_keys) <= i:
            j = len(seq.block_keys)
            tokens = seq.token_slice(j * self.block_size, (j + 1) * self.block_size)
            seq.block_keys.append(block_key(seq.block_keys[-1] if j else ROOT_KEY, tokens))
        return seq.block_keys[i]

    def shareable_keys(self, seq: Sequence) -> list[int]:
        """Keys of the sequence's blocks another sequence could share: its full blocks before
        the last token (the ones `match_prefix` looks up)."""
        if not self.prefix_caching:
            return []
        return [self._key(seq, i) for i in range((seq.num_tokens - 1) // self.block_size)]

    def cached_prefix(self, keys: list[int]) -> int:
        """How many of the leading `keys` the prefix cache holds."""
        count = 0
        while count < len(keys) and keys[count] in self._block_of:
            count += 1
        return count

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of the sequence's tokens made of full
        blocks, leaving at least one token to compute (its logits are needed); each gets a
        reference."""
        keys = self.shareable_keys(seq)
        matched = [self._block_of[key] for key in keys[:self.cached_prefix(keys)]]
        for block in matched:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        return matched

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
