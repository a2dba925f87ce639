"""Launch geometry shared by the CUDA and emulator backends."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_THREADS_PER_BLOCK", "LaunchConfig", "launch_config"]

#: The largest block any kernel of ``cuda/`` launches with: every ``__global__`` declares it as
#: its launch bounds (``kMaxThreadsPerBlock``, Note [launch bounds] in ``cuda/common.cuh``), so
#: the GPU compiler keeps each kernel within the registers a block of this size may use.
MAX_THREADS_PER_BLOCK = 1024


@dataclass
class LaunchConfig:
    r"""How multi-tensor launches split work.

    Attributes:
        chunk_size: elements per chunk (one thread block per chunk); a multiple of 4. Tests
            lower it to exercise chunk and table boundaries with small tensors.
        threads_per_block: CUDA threads per block.
        emulator_threads_per_block: threads per block in the CPU emulator, where every
            emulated thread is an OS thread, hence the smaller default.
        emulator_block_order_seed: the seed of the order in which the emulator runs the blocks
            of a launch (a shuffle, as a GPU promises no order): a result that depends on that
            order differs between seeds; the same seed runs the same order.
    """

    chunk_size: int = 65536
    threads_per_block: int = 512
    emulator_threads_per_block: int = 32
    emulator_block_order_seed: int = 0

    def validate(self) -> None:
        if self.chunk_size <= 0 or self.chunk_size % 4 or self.chunk_size >= 2**31:
            raise ValueError(
                f"Invalid chunk_size: {self.chunk_size}; use a positive multiple of 4 below 2**31"
            )
        for name in ("threads_per_block", "emulator_threads_per_block"):
            value = getattr(self, name)
            if not 1 <= value <= MAX_THREADS_PER_BLOCK:
                raise ValueError(f"Invalid {name}: {value}; use 1 to {MAX_THREADS_PER_BLOCK}")
        if not 0 <= self.emulator_block_order_seed < 2**64:
            raise ValueError(
                f"Invalid emulator_block_order_seed: {self.emulator_block_order_seed}; "
                "use an integer from 0 to 2**64 - 1"
            )


# The process-wide configuration read at every launch.
launch_config = LaunchConfig()
