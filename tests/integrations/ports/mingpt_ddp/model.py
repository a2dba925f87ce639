"""minGPT-ddp's ``mingpt/model.py`` (pytorch/examples, distributed/minGPT-ddp),
reduced by hand for the port test: a GPT small enough for a CPU and
``create_optimizer`` as minGPT-ddp builds its AdamW (decay for the Linear
weights, none for biases, norms and embeddings)."""

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 48
    n_embd: int = 32


@dataclass
class OptimizerConfig:
    learning_rate: float = 3e-3
    weight_decay: float = 0.1


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Parameter(
            torch.zeros(1, config.block_size, config.n_embd)
        )
        self.ln = nn.LayerNorm(config.n_embd)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        x = self.tok_emb(idx) + self.pos_emb[:, : idx.size(1)]
        x = x + self.proj(F.gelu(self.fc(self.ln(x))))
        logits = self.head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)).float(), targets.view(-1)
            )
        return logits, loss


def create_optimizer(model: torch.nn.Module, opt_config: OptimizerConfig):
    decay = {
        p
        for m in model.modules()
        if isinstance(m, nn.Linear)
        for p in [m.weight]
    }
    params = list(model.parameters())
    optim_groups = [
        {
            "params": [p for p in params if p in decay],
            "weight_decay": opt_config.weight_decay,
        },
        {"params": [p for p in params if p not in decay], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        optim_groups, lr=opt_config.learning_rate, betas=(0.9, 0.95)
    )
    return optimizer
