"""nanoGPT's ``model.py`` (karpathy/nanoGPT), reduced by hand for the port
test: a GPT small enough for a CPU and ``configure_optimizers`` as nanoGPT
builds its AdamW (decay for matrices, none for vectors, ``fused=True`` on
CUDA)."""

import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 48
    n_embd: int = 32


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd),
        )
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        x = x + self.mlp(self.ln_1(x))
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(
            logits.view(-1, logits.size(-1)).float(), targets.view(-1)
        )
        return logits, loss

    def configure_optimizers(
        self, weight_decay, learning_rate, betas, device_type
    ):
        params = [p for p in self.parameters() if p.requires_grad]
        optim_groups = [
            {
                "params": [p for p in params if p.dim() >= 2],
                "weight_decay": weight_decay,
            },
            {
                "params": [p for p in params if p.dim() < 2],
                "weight_decay": 0.0,
            },
        ]
        fused_available = (
            "fused" in inspect.signature(torch.optim.AdamW).parameters
        )
        use_fused = fused_available and device_type == "cuda"
        extra_args = dict(fused=True) if use_fused else dict()
        optimizer = torch.optim.AdamW(
            optim_groups, lr=learning_rate, betas=betas, **extra_args
        )
        return optimizer
