"""nanoGPT's ``train.py`` (karpathy/nanoGPT), reduced by hand for the port
test: its config values, its micro-batch loop and its GradScaler lines as
nanoGPT has them (``scaler.unscale_`` and ``clip_grad_norm_`` when ``grad_clip
!= 0.0``); the module-level script is a function here, and the scaler takes the
device type so that it runs on a CPU."""

import torch
from model import GPT, GPTConfig


def main(
    max_iters=24, grad_clip=1.0, dtype="float16", gradient_accumulation_steps=2
):
    device_type = "cpu"
    batch_size, learning_rate, weight_decay = 8, 1e-2, 1e-1
    beta1, beta2 = 0.9, 0.95
    torch.manual_seed(1337)
    ptdtype = {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }
    ctx = torch.amp.autocast(device_type=device_type, dtype=ptdtype[dtype])
    data = torch.randint(
        GPTConfig.vocab_size,
        (4096,),
        generator=torch.Generator().manual_seed(0),
    )

    def get_batch():
        ix = torch.randint(len(data) - GPTConfig.block_size - 1, (batch_size,))
        x = torch.stack([data[i : i + GPTConfig.block_size] for i in ix])
        y = torch.stack(
            [data[i + 1 : i + 1 + GPTConfig.block_size] for i in ix]
        )
        return x, y

    model = GPT(GPTConfig())
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
    optimizer = model.configure_optimizers(
        weight_decay, learning_rate, (beta1, beta2), device_type
    )
    losses = []
    X, Y = get_batch()
    for _iter_num in range(max_iters):
        for _micro_step in range(gradient_accumulation_steps):
            with ctx:
                _logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            X, Y = get_batch()
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() * gradient_accumulation_steps)
    return model, optimizer, losses
