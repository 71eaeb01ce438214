"""The numbers train.py's loop measures besides the training loss: the validation loss over fixed
windows, and PQT's mean tile bitwidth b_t. Reads the model; changes nothing."""

import torch
import torch.distributed as dist
from tqdm import tqdm


def bits_params(model):
    """The PQT bitwidth parameters b_i ([] without PQT)."""
    return [p for n, p in model.named_parameters() if n.endswith("b_i")]


def mean_bt(bits_params, b_init, b_target, world=1):
    """Mean tile bitwidth b_t over all PQT tiles (paper A eq. 11: b_t = b_target + b_i (b_init - b_target)),
    as a 0-dim tensor (no device sync). FSDP2 (DTensor b_i, `world` ranks): each rank's shards,
    summed over the ranks in one all-reduce (none with one rank)."""
    if not bits_params:
        return None
    with torch.no_grad():   # DTensor.to_local() costs ~40 us a call with autograd on, ~2 us without
        local = [p.to_local() if hasattr(p, "to_local") else p.detach() for p in bits_params]
    b_i = torch.cat([x.flatten() for x in local]).float()
    if world > 1 and hasattr(bits_params[0], "to_local"):
        total = torch.stack([b_i.sum(), torch.tensor(float(b_i.numel()), device=b_i.device)])
        dist.all_reduce(total)
        b_i = total[0] / total[1]
    else:
        b_i = b_i.mean()
    return b_target + b_i * (b_init - b_target)


@torch.no_grad()
def evaluate(model, batches, n_windows, batch_size, ctx, device, rank=0, world=1, ddp=False, fsdp=False):
    """Mean cross-entropy (nats/token) over the fixed validation windows, split across ranks.
    Uses the plain (uncompiled, unwrapped) model in eval mode. Under FSDP2 (fsdp) every forward
    all-gathers, so a rank with fewer batches runs extra forwards whose loss is not counted."""
    was_training = model.training
    model.eval()
    tot = torch.zeros(2, dtype=torch.float64, device=device)
    bar = tqdm(total=len(batches.val_starts(n_windows)[rank::world]), desc="eval", unit="window", leave=False,
               delay=2, disable=rank != 0)  # shown only when an eval takes more than 2 s
    for x, y in batches.val_batches(n_windows, batch_size, rank, world):
        x, y = x.to(device), y.to(device)
        with ctx:
            _, loss = model(x, y)
        tot[0] += loss.double() * y.numel()
        tot[1] += y.numel()
        bar.update(len(x))
    if fsdp:
        most = -(-len(batches.val_starts(n_windows)[0::world]) // batch_size)   # rank 0 has the most windows
        mine = -(-len(batches.val_starts(n_windows)[rank::world]) // batch_size)
        for _ in range(most - mine):
            with ctx:
                model(torch.zeros(1, batches.block_size, dtype=torch.long, device=device))
    bar.close()
    if ddp:
        dist.all_reduce(tot)
    model.train(was_training)
    return (tot[0] / tot[1]).item()
