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

L2_PENALTY = 1e-2  # the full-batch task's weight decay, inside its loss
EVAL_SEED_OFFSET = 10_000  # held-out batches come from a different stream than training's


@dataclasses.dataclass(frozen=True)
class Task:
    """What a training loop needs to know about a model and its data."""

    name: str  # the CLI name, used as the label in progress bars, tables and plots alike
    title: str  # what the model is, for table and plot headings
    unit: str  # what a batch holds: "tokens" or "images"
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
    """Model, batch and run lengths. The "cpu" size keeps the README's main command short.

    CPUs without fp16 arithmetic run fp16 autocast ~10x slower than fp32 (matmuls, convolutions
    and element-wise kernels alike), so the CPU models are small and their runs short, yet long
    enough for the loss scale to grow into overflows that are skipped.
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
    full_batch: int  # examples in the fixed batch that LBFGS trains on
    lbfgs_steps: int


SIZES = {
    "tiny": Size(16, 32, 1, text_batch=8, text_steps=60, image_size=8, cnn_width=4,
                 image_batch=16, image_steps=30, full_batch=4096, lbfgs_steps=6),
    "cpu": Size(32, 48, 1, text_batch=8, text_steps=150, image_size=8, cnn_width=8,
                image_batch=32, image_steps=150, full_batch=4096, lbfgs_steps=25),
    "cuda": Size(256, 384, 6, text_batch=64, text_steps=1000, image_size=64, cnn_width=64,
                 image_batch=256, image_steps=500, full_batch=16384, lbfgs_steps=100),
}


def _next_byte_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())


def _classification_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images).float(), labels)


def language_model(size: Size, device: torch.device) -> Task:
    """Next-byte prediction on the standard library's source with a causal transformer."""
    return _next_byte_task(size, device, "lm", "char transformer", CharTransformer)


def hf_gpt2(size: Size, device: torch.device) -> Task:
    """The same next-byte task with a Hugging Face ``GPT2LMHeadModel`` built from a config."""
    from .hf import HFGPT2  # transformers is optional: imported only for this model

    return _next_byte_task(size, device, "hf-gpt2", "transformers.GPT2LMHeadModel", HFGPT2)


def _next_byte_task(
    size: Size, device: torch.device, name: str, title: str, model: Callable[..., nn.Module]
) -> Task:
    text = stdlib_text(2_000_000)
    return Task(
        name=name,
        title=title,
        unit="tokens",
        items_per_batch=size.text_batch * size.context,
        make_model=lambda: model(size.context, size.width, size.depth, heads=4).to(device),
        batches=lambda seed: text_batches(text, size.text_batch, size.context, seed, device),
        loss=_next_byte_loss,
        default_steps=size.text_steps,
        lr=2e-3,
    )


def image_classifier(size: Size, device: torch.device) -> Task:
    """Ten-class classification of noisy, shifted synthetic patterns with a small CNN."""
    prototypes = image_prototypes(num_classes=10, size=size.image_size, seed=0)
    return Task(
        name="cnn",
        title="conv-BN-ReLU classifier",
        unit="images",
        items_per_batch=size.image_batch,
        make_model=lambda: SmallCNN(num_classes=10, width=size.cnn_width).to(device),
        batches=lambda seed: image_batches(prototypes, size.image_batch, 3.0, seed, device),
        loss=_classification_loss,
        default_steps=size.image_steps,
        lr=5e-3,  # the CNN is tiny and its steps are few: a larger lr brings it near its plateau
        eval_batches=32,  # its batches are small: more of them make the final loss less noisy
    )


def full_batch_classifier(size: Size, device: torch.device) -> Task:
    """LBFGS's home ground: one fixed large batch, a deterministic loss, no BatchNorm noise.

    Multinomial logistic regression on a fixed set of noisy synthetic patterns: a convex loss,
    the same batch at every step, so the loss LBFGS's line search measures is the loss it
    minimises, and the noise keeps the held-out loss well above zero.
    """
    prototypes = image_prototypes(num_classes=10, size=size.image_size, seed=0)
    features = 3 * size.image_size**2

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        # an L2 penalty makes the problem strongly convex: one minimum, which every run reaches
        penalty = sum(p.float().pow(2).sum() for p in model.parameters())
        return _classification_loss(model, batch) + L2_PENALTY * penalty

    def fixed(seed: int) -> Iterator[Batch]:
        batch = next(image_batches(prototypes, size.full_batch, 3.0, seed, device))
        return itertools.repeat(batch)

    return Task(
        name="lbfgs",
        title="logistic regression, full batch",
        unit="images",
        items_per_batch=size.full_batch,
        make_model=lambda: nn.Sequential(nn.Flatten(), nn.Linear(features, 10)).to(device),
        batches=fixed,
        loss=loss,
        default_steps=size.lbfgs_steps,
        lr=1.0,  # LBFGS's natural step; its strong-Wolfe line search shortens it where needed
        eval_batches=1,  # the held-out set is one fixed batch as large as the training set
    )


TASKS = {"lm": language_model, "cnn": image_classifier, "hf-gpt2": hf_gpt2}  # for AdamW
ALL_TASKS = {**TASKS, "lbfgs": full_batch_classifier}
