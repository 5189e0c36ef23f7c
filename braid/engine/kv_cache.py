"""Block allocator for the paged KV cache (the driver decides; every rank stores its heads)."""

from __future__ import annotations


class BlockAllocator:
    """Hands out fixed-size KV blocks. Block 0 is never handed out: block tables pad with it."""

    def __init__(self, num_tokens: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_tokens // block_size + 1
        self._free = list(range(self.num_blocks - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def blocks_needed(self, num_tokens: int, held: int) -> int:
        """More blocks a sequence holding `held` blocks needs to store `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - held)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"KV cache needs {count} blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
