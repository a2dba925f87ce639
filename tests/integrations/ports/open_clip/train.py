"""open_clip's ``src/open_clip_train/train.py`` (mlfoundations/open_clip),
reduced by hand for the port test: ``backward(total_loss, scaler)`` and
``train_one_epoch``'s step as open_clip has them (``scaler.unscale_`` +
``clip_grad_norm_`` when ``args.grad_clip_norm`` is set, then ``scaler.step``
and ``scaler.update``), without logging, accumulation and distillation."""

import torch


def backward(total_loss, scaler):
    if scaler is not None:
        scaler.scale(total_loss).backward()
    else:
        total_loss.backward()


def train_one_epoch(model, data, loss, epoch, optimizer, scaler, args):
    autocast = torch.autocast
    model.train()
    losses = []
    for images, texts in data:
        optimizer.zero_grad()
        with autocast(device_type="cpu", dtype=torch.float16):
            image_features, text_features, logit_scale = model(images, texts)
            total_loss = loss(image_features, text_features, logit_scale)
        backward(total_loss, scaler)

        if scaler is not None:
            if args.grad_clip_norm is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(
                    model.parameters(), args.grad_clip_norm, norm_type=2.0
                )
            scaler.step(optimizer)
            scaler.update()
        else:
            if args.grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(
                    model.parameters(), args.grad_clip_norm, norm_type=2.0
                )
            optimizer.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, 4.6052)
        losses.append(total_loss.item())
    return losses
