"""Launch geometry shared by the CUDA and emulator backends."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LaunchConfig", "launch_config"]


@dataclass
class LaunchConfig:
    r"""How multi-tensor launches split work.

    Attributes:
        chunk_size: elements per chunk (one thread block per chunk); a multiple of 4. Tests
            lower it to exercise chunk and table boundaries with small tensors.
        threads_per_block: CUDA threads per block.
        emulator_threads_per_block: threads per block in the CPU emulator, where every
            emulated thread is an OS thread, hence the smaller default.
    """

    chunk_size: int = 65536
    threads_per_block: int = 512
    emulator_threads_per_block: int = 32

    def validate(self) -> None:
        if self.chunk_size <= 0 or self.chunk_size % 4 or self.chunk_size >= 2**31:
            raise ValueError(
                f"Invalid chunk_size: {self.chunk_size}; use a positive multiple of 4 below 2**31"
            )
        for name in ("threads_per_block", "emulator_threads_per_block"):
            value = getattr(self, name)
            if not 1 <= value <= 1024:
                raise ValueError(f"Invalid {name}: {value}; use 1 to 1024")


# The process-wide configuration read at every launch.
launch_config = LaunchConfig()
