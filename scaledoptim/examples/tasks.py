"""A task bundles a model, its data and its loss, so every training loop runs it the same way."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from .data import Batch, image_batches, image_prototypes, stdlib_text, text_batches
from .models import CharTransformer, SmallCNN

EVAL_SEED_OFFSET = 10_000  # held-out batches come from a different stream than training's


@dataclasses.dataclass(frozen=True)
class Task:
    """What a training loop needs to know about a model and its data."""

    name: str
    unit: str  # what throughput counts: "tokens" or "images"
    items_per_batch: int
    make_model: Callable[[], nn.Module]
    batches: Callable[[int], Iterator[Batch]]  # seed -> endless training batches
    loss: Callable[[nn.Module, Batch], torch.Tensor]  # always returns an fp32 scalar
    default_steps: int
    lr: float
    eval_batches: int = 8

    def eval_loss(self, model: nn.Module, seed: int) -> float:
        """Mean fp32 loss over fixed held-out batches: the number every compared run reports."""
        held_out = itertools.islice(self.batches(seed + EVAL_SEED_OFFSET), self.eval_batches)
        model.eval()
        with torch.no_grad():
            losses = [self.loss(model, batch) for batch in held_out]
        model.train()
        return torch.stack(losses).mean().item()


@dataclasses.dataclass(frozen=True)
class Size:
    """Model, batch and run lengths; the "cpu" size keeps ``--compare`` under three minutes.

    CPUs have no fast fp16 convolution (it runs ~10x slower than fp32), hence the tiny CNN there.
    """

    context: int
    width: int
    depth: int
    text_batch: int
    text_steps: int
    image_size: int
    cnn_width: int
    image_batch: int
    image_steps: int


SIZES = {
    "tiny": Size(32, 64, 1, text_batch=16, text_steps=150, image_size=8, cnn_width=4,
                 image_batch=16, image_steps=40),
    "cpu": Size(64, 128, 2, text_batch=32, text_steps=300, image_size=16, cnn_width=8,
                image_batch=32, image_steps=200),
    "cuda": Size(256, 384, 6, text_batch=64, text_steps=1000, image_size=64, cnn_width=64,
                 image_batch=256, image_steps=500),
}  # fmt: skip


def language_model(size: Size, device: torch.device) -> Task:
    """Next-byte prediction on the standard library's source with a causal transformer."""
    text = stdlib_text(2_000_000)

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())

    return Task(
        name="char-transformer",
        unit="tokens",
        items_per_batch=size.text_batch * size.context,
        make_model=lambda: CharTransformer(size.context, size.width, size.depth, heads=4).to(device),
        batches=lambda seed: text_batches(text, size.text_batch, size.context, seed, device),
        loss=loss,
        default_steps=size.text_steps,
        lr=2e-3,
    )


def image_classifier(size: Size, device: torch.device) -> Task:
    """Ten-class classification of noisy, shifted synthetic patterns with a small CNN."""
    prototypes = image_prototypes(num_classes=10, size=size.image_size, seed=0)

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images).float(), labels)

    return Task(
        name="cnn",
        unit="images",
        items_per_batch=size.image_batch,
        make_model=lambda: SmallCNN(num_classes=10, width=size.cnn_width).to(device),
        batches=lambda seed: image_batches(prototypes, size.image_batch, 3.0, seed, device),
        loss=loss,
        default_steps=size.image_steps,
        lr=5e-3,  # the CNN is tiny and its steps are few: a larger lr brings it near its plateau
        eval_batches=32,  # its batches are small: more of them make the final loss less noisy
    )


TASKS = {"lm": language_model, "cnn": image_classifier}
