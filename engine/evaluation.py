"""Evaluation of a training engine on the validation set: top-1, top-5 and the confusion matrix over every rank."""
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Evaluation:
    top1: float
    top5: float
    confusion: torch.Tensor  # (num_labels, num_labels) counts over every rank: rows true, columns predicted
    shown: tuple  # (images, labels, predictions) of this rank's first images, for the prediction grid


@torch.no_grad()
def evaluate(engine, loader, normalize, dtype, device, num_labels: int, copies: int = 1) -> Evaluation:
    """Top-1, top-5 and the confusion matrix over the whole validation set, reduced over ranks. The loader's
    uint8 images are normalised on the device (`normalize`). `copies`: the ranks that evaluate each batch together
    (a tensor group, tp_size), whose counts are the same."""
    engine.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # correct@1, correct@5, count
    confusion = torch.zeros(num_labels * num_labels, dtype=torch.float64, device=device)
    shown = None
    batches, dummy = iter(loader), None
    while True:
        batch = next(batches, None)
        # ZeRO-3 gathers parameters inside each forward, so every rank must run as many forwards as
        # the others: a rank that ran out of data joins with a dummy batch until all are done.
        more = torch.tensor([batch is not None], dtype=torch.int32, device=device)
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not more.item():
            break
        if batch is None:
            engine(dummy)
            continue
        images, labels = normalize(batch[0].to(device, non_blocking=True)).to(dtype), batch[1].to(device)
        dummy = images[:1]
        logits = engine(images).logits.float()  # (B, num_labels)
        top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
        hits = top == labels[:, None]
        # the count on the GPU as well: torch.stack does not move a CPU scalar the way arithmetic does
        count = torch.tensor(len(labels), device=device)
        totals += torch.stack([hits[:, 0].sum(), hits.any(-1).sum(), count]).to(totals)
        confusion += torch.bincount(labels * num_labels + top[:, 0], minlength=num_labels * num_labels).to(confusion)
        if shown is None:
            shown = (batch[0][:16], batch[1][:16], top[:16, 0].cpu())
    dist.all_reduce(totals)
    dist.all_reduce(confusion)
    totals, confusion = totals / copies, confusion / copies
    engine.train()
    return Evaluation((totals[0] / totals[2]).item(), (totals[1] / totals[2]).item(),
                      confusion.view(num_labels, num_labels).cpu(), shown)
