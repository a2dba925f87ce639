"""minGPT-ddp's ``mingpt/trainer.py`` (pytorch/examples,
distributed/minGPT-ddp), reduced by hand for the port test: the ``Trainer``
with its DDP wrapper and ``_run_batch`` as minGPT-ddp has them, clipping the
grads right after ``scaler.scale(loss).backward()`` (so, upstream, the *scaled*
grads); on a CPU (gloo) instead of ``LOCAL_RANK``'s GPU."""

from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class TrainerConfig:
    max_epochs: int = 3
    batch_size: int = 8
    grad_norm_clip: float = 0.25
    use_amp: bool = True


class Trainer:
    def __init__(
        self,
        trainer_config: TrainerConfig,
        model,
        optimizer,
        train_dataset: Dataset,
    ):
        self.config = trainer_config
        self.train_loader = DataLoader(
            train_dataset,
            batch_size=self.config.batch_size,
            shuffle=False,
            sampler=DistributedSampler(train_dataset),
        )
        self.epochs_run = 0
        self.model = model
        self.optimizer = optimizer
        if self.config.use_amp:
            self.scaler = torch.amp.GradScaler("cpu")
        self.model = DDP(self.model)

    def _run_batch(self, source, targets, train: bool = True) -> float:
        with (
            torch.set_grad_enabled(train),
            torch.amp.autocast(
                device_type="cpu",
                dtype=torch.float16,
                enabled=(self.config.use_amp),
            ),
        ):
            _, loss = self.model(source, targets)

        if train:
            self.optimizer.zero_grad(set_to_none=True)
            if self.config.use_amp:
                self.scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(
                    self.model.parameters(), self.config.grad_norm_clip
                )
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(
                    self.model.parameters(), self.config.grad_norm_clip
                )
                self.optimizer.step()
        return loss.item()

    def _run_epoch(
        self, epoch: int, dataloader: DataLoader, train: bool = True
    ):
        dataloader.sampler.set_epoch(epoch)
        return [
            self._run_batch(source, targets, train)
            for source, targets in dataloader
        ]

    def train(self):
        losses = []
        for epoch in range(self.epochs_run, self.config.max_epochs):
            losses += self._run_epoch(epoch, self.train_loader, train=True)
        return losses
