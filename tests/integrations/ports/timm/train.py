"""timm's ``train.py`` (huggingface/pytorch-image-models), reduced by hand for
the port test: the loss scaler created in ``main`` and handed to
``train_one_epoch`` as ``loss_scaler=``, called by its ``_backward`` with
timm's arguments (clipping by norm, gradient accumulation), and checkpointed
under its ``state_dict_key``; the ``timm.utils``/``timm.optim`` pieces it
imports are the stand-ins of ``timm_utils.py``."""

from argparse import Namespace
from functools import partial

import torch
from timm_utils import NativeScaler, create_optimizer_v2, optimizer_kwargs


def train_one_epoch(
    epoch, model, loader, optimizer, loss_fn, args, amp_autocast, loss_scaler
):
    accum_steps = args.grad_accum_steps
    losses = []
    model.train()
    for batch_idx, (input, target) in enumerate(loader):
        need_update = (batch_idx + 1) % accum_steps == 0

        def _forward(input=input, target=target):
            with amp_autocast():
                output = model(input)
                loss = loss_fn(output.float(), target)
            if accum_steps > 1:
                loss /= accum_steps
            return loss

        def _backward(_loss, need_update=need_update):
            loss_scaler(
                _loss,
                optimizer,
                clip_grad=args.clip_grad,
                clip_mode=args.clip_mode,
                parameters=model.parameters(),
                create_graph=False,
                need_update=need_update,
            )

        loss = _forward()
        _backward(loss)
        if need_update:
            optimizer.zero_grad()
        losses.append(loss.item() * accum_steps)
    return losses


def main(epochs=3, resume=None):
    args = Namespace(
        opt="adamw",
        lr=1e-2,
        weight_decay=0.05,
        clip_grad=0.25,
        clip_mode="norm",
        grad_accum_steps=2,
    )
    device = torch.device("cpu")
    torch.manual_seed(42)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5)
    )
    optimizer = create_optimizer_v2(model, **optimizer_kwargs(cfg=args))
    amp_autocast = partial(
        torch.autocast, device_type=device.type, dtype=torch.float16
    )
    loss_scaler = NativeScaler(device=device.type)
    start_epoch = 0
    if resume is not None:
        model.load_state_dict(resume["state_dict"])
        optimizer.load_state_dict(resume["optimizer"])
        loss_scaler.load_state_dict(resume[loss_scaler.state_dict_key])
        start_epoch = resume["epoch"] + 1
    inputs = torch.randn(96, 12, generator=torch.Generator().manual_seed(0))
    dataset = torch.utils.data.TensorDataset(
        inputs, (4 * inputs[:, :5]).softmax(-1)
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=12)
    loss_fn = torch.nn.CrossEntropyLoss()
    losses = []
    for epoch in range(start_epoch, epochs):
        losses += train_one_epoch(
            epoch,
            model,
            loader,
            optimizer,
            loss_fn,
            args,
            amp_autocast,
            loss_scaler,
        )
    checkpoint = {
        "epoch": epochs - 1,
        "state_dict": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        loss_scaler.state_dict_key: loss_scaler.state_dict(),
    }
    return model, optimizer, losses, checkpoint
