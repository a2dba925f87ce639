"""open_clip's ``src/open_clip_train/main.py`` (mlfoundations/open_clip),
reduced by hand for the port test: the AdamW built as open_clip builds it (no
weight decay for gains, biases and the logit scale), the ``GradScaler`` for
``--precision amp``, and the checkpoint with its ``"scaler"`` entry, saved and
resumed as open_clip does; a two-tower toy model and its contrastive loss stand
in for CLIP."""

import math
from argparse import Namespace

import torch
import torch.nn.functional as F
from torch import optim
from train import train_one_epoch


class TwoTowers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)
        )
        self.text = torch.nn.Sequential(
            torch.nn.Embedding(40, 32),
            torch.nn.Flatten(),
            torch.nn.Linear(128, 8),
        )
        self.logit_scale = torch.nn.Parameter(
            torch.ones([]) * math.log(1 / 0.07)
        )

    def forward(self, images, texts):
        image_features = F.normalize(self.visual(images), dim=-1)
        text_features = F.normalize(self.text(texts), dim=-1)
        return image_features, text_features, self.logit_scale.exp()


def clip_loss(image_features, text_features, logit_scale):
    logits = logit_scale * image_features.float() @ text_features.float().T
    labels = torch.arange(len(logits))
    return (
        F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)
    ) / 2


def main(epochs=3, resume=None):
    args = Namespace(
        lr=5e-3,
        beta1=0.9,
        beta2=0.98,
        eps=1e-6,
        wd=0.2,
        precision="amp",
        grad_clip_norm=0.25,
    )
    torch.manual_seed(0)
    model = TwoTowers()
    exclude = lambda n, p: (  # noqa: E731
        p.ndim < 2
        or "bn" in n
        or "ln" in n
        or "bias" in n
        or "logit_scale" in n
    )
    include = lambda n, p: not exclude(n, p)  # noqa: E731
    named_parameters = list(model.named_parameters())
    gain_or_bias_params = [
        p for n, p in named_parameters if exclude(n, p) and p.requires_grad
    ]
    rest_params = [
        p for n, p in named_parameters if include(n, p) and p.requires_grad
    ]
    optimizer = optim.AdamW(
        [
            {"params": gain_or_bias_params, "weight_decay": 0.0},
            {"params": rest_params, "weight_decay": args.wd},
        ],
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        eps=args.eps,
    )
    scaler = None
    if args.precision == "amp":
        scaler = torch.amp.GradScaler(device="cpu")
    start_epoch = 0
    if resume is not None:
        start_epoch = resume["epoch"]
        model.load_state_dict(resume["state_dict"])
        optimizer.load_state_dict(resume["optimizer"])
        if scaler is not None and "scaler" in resume:
            scaler.load_state_dict(resume["scaler"])
    generator = torch.Generator().manual_seed(0)
    data = [
        (
            torch.randn(24, 16, generator=generator),
            torch.randint(40, (24, 4), generator=generator),
        )
        for _ in range(6)
    ]
    losses = []
    for epoch in range(start_epoch, epochs):
        losses += train_one_epoch(
            model, data, clip_loss, epoch, optimizer, scaler, args
        )
    checkpoint_dict = {
        "epoch": epochs,
        "state_dict": model.state_dict(),
        "optimizer": optimizer.state_dict(),
    }
    if scaler is not None:
        checkpoint_dict["scaler"] = scaler.state_dict()
    return model, optimizer, losses, checkpoint_dict
