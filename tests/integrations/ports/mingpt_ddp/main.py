"""minGPT-ddp's ``mingpt/main.py`` (pytorch/examples, distributed/minGPT-ddp),
reduced by hand for the port test: the model, ``create_optimizer`` and the
``Trainer`` put together (the caller has initialised the process group, as
``ddp_setup`` does)."""

import torch
from model import GPT, GPTConfig, OptimizerConfig, create_optimizer
from torch.utils.data import TensorDataset
from trainer import Trainer, TrainerConfig


def main(max_epochs=3):
    torch.manual_seed(0)
    tokens = torch.randint(
        GPTConfig.vocab_size, (96, GPTConfig.block_size + 1)
    )
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    model = GPT(GPTConfig())
    optimizer = create_optimizer(model, OptimizerConfig())
    trainer = Trainer(
        TrainerConfig(max_epochs=max_epochs), model, optimizer, dataset
    )
    losses = trainer.train()
    return model, optimizer, losses
