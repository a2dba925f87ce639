"""Offline training data: the standard library's source as text, and synthetic images.

Both are generated deterministically from a seed, so every compared run sees the same batches.
"""

from __future__ import annotations

import pathlib
import sysconfig
from collections.abc import Iterator

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


def stdlib_text(num_bytes: int) -> torch.Tensor:
    """The first ``num_bytes`` bytes of the stdlib's top-level ``*.py`` files, in name order.

    Real, freely licensed English-and-code text that every Python installation ships, so the
    example needs no download. Returned as a uint8 tensor of byte values (the vocabulary is 256).
    """
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= num_bytes:
            break
    text = b"".join(chunks)[:num_bytes]
    if len(text) < num_bytes:
        raise RuntimeError(f"the stdlib at {stdlib} holds only {len(text)} bytes of *.py source")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def text_batches(
    text: torch.Tensor, batch_size: int, context: int, seed: int, device: torch.device
) -> Iterator[Batch]:
    """Endless random windows of ``text``: inputs and the next-byte targets, as int64."""
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(context + 1)
    while True:
        starts = torch.randint(0, len(text) - context - 1, (batch_size, 1), generator=gen)
        windows = text[starts + offsets].long().to(device)
        yield windows[:, :-1], windows[:, 1:]


def image_prototypes(num_classes: int, size: int, seed: int) -> torch.Tensor:
    """One smooth random 3-channel pattern per class (low-frequency noise, upsampled)."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, 3, 4, 4, generator=gen)
    return torch.nn.functional.interpolate(coarse, size=size, mode="bilinear", align_corners=False)


def image_batches(
    prototypes: torch.Tensor, batch_size: int, noise: float, seed: int, device: torch.device
) -> Iterator[Batch]:
    """Endless batches of randomly shifted class prototypes under heavy Gaussian noise.

    The noise keeps the task from being solved outright, so the loss stays well above zero and
    comparing final losses in relative terms is meaningful.
    """
    gen = torch.Generator().manual_seed(seed)
    num_classes, _, size, _ = prototypes.shape
    while True:
        labels = torch.randint(0, num_classes, (batch_size,), generator=gen)
        shifts = torch.randint(-size // 4, size // 4 + 1, (2,), generator=gen).tolist()
        images = torch.roll(prototypes[labels], shifts=shifts, dims=(2, 3))
        images = images + noise * torch.randn(images.shape, generator=gen)
        yield images.to(device), labels.to(device)
