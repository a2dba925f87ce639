"""A Hugging Face GPT-2 built from a config (no download), for ``--model hf-gpt2``.

``transformers`` is imported only here, and only when this model is asked for: the examples and
the package work with torch alone.
"""

from __future__ import annotations

import torch
from torch import nn


class HFGPT2(nn.Module):
    """``transformers.GPT2LMHeadModel`` over bytes, returning the logits like ``CharTransformer``.

    Dropout is off so that fp32, torch.amp and scaledoptim see the same computation.
    """

    def __init__(self, context: int, width: int, depth: int, heads: int, vocab: int = 256) -> None:
        super().__init__()
        import transformers

        config = transformers.GPT2Config(
            vocab_size=vocab, n_positions=context, n_embd=width, n_layer=depth, n_head=heads,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
        )
        self.gpt2 = transformers.GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt2(input_ids=tokens).logits
