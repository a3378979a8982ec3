"""Evaluation of a training engine on the validation set, reduced over every rank: top-1, top-5 and the confusion
matrix of a classifier; mean IoU, pixel accuracy and the pixels' confusion matrix of a segmentation model; the
reconstruction loss of masked-image pretraining, on masks fixed by the batch."""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from data.loader import IGNORE_INDEX
from data.masking import masked_inputs

VAL_STEP = -1  # the step the validation masks are drawn for: no training step has it


@dataclass
class Evaluation:
    metrics: dict  # classification: top1, top5; segmentation: miou, pixel_acc; mae and simmim: loss
    # (num_labels, num_labels) counts of images (segmentation: pixels) over every rank: rows true, columns predicted
    confusion: torch.Tensor | None = None
    shown: tuple | None = None  # (images, labels or masks, predictions) of this rank's first images, for TensorBoard

    @property
    def score(self) -> float:
        """Higher is better: what keep_best ranks checkpoints by."""
        for key in ("top1", "miou"):
            if key in self.metrics:
                return self.metrics[key]
        return -self.metrics["loss"]

    def describe(self) -> str:
        if "top1" in self.metrics:
            return f"top-1 {self.metrics['top1']:.2%} top-5 {self.metrics['top5']:.2%}"
        if "miou" in self.metrics:
            return f"mIoU {self.metrics['miou']:.2%} pixel accuracy {self.metrics['pixel_acc']:.2%}"
        return f"loss {self.metrics['loss']:.4f}"


def batches(engine, loader, normalize, dtype, device):
    """(images, targets, the batch as loaded) of each batch of `loader`, the uint8 images normalised on the device
    (`normalize`) in `dtype`. ZeRO-3 gathers parameters inside each forward, so every rank runs as many forwards
    as the others: a rank that ran out of data runs the model here on a dummy batch (its last batch's first
    image), counting nothing, until every rank has."""
    loaded, dummy = iter(loader), None
    while True:
        batch = next(loaded, None)
        more = torch.tensor([batch is not None], dtype=torch.int32, device=device)
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not more.item():
            return
        if batch is None:
            engine(dummy)
            continue
        images = normalize(batch[0].to(device, non_blocking=True)).to(dtype)
        dummy = images[:1]
        yield images, batch[1].to(device), batch


@torch.no_grad()
def evaluate(engine, loader, normalize, dtype, device, cfg, data_rank: int = 0, data_ranks: int = 1) -> Evaluation:
    """`cfg.task`'s evaluation over the whole validation set. The loader's uint8 images are normalised on the
    device (`normalize`). The ranks of a tensor or sequence group (cfg.model_parallel) evaluate the same batches:
    their counts are divided out. Masks of the pretraining tasks come from (seed, VAL_STEP, the batch's slot among all ranks')."""
    engine.eval()
    if cfg.task == "classification":
        result = _classification(engine, loader, normalize, dtype, device, cfg.num_labels, cfg.model_parallel)
    elif cfg.task == "segmentation":
        result = _segmentation(engine, loader, normalize, dtype, device, cfg.num_labels)
    else:
        result = _reconstruction(engine, loader, normalize, dtype, device, cfg, data_rank, data_ranks)
    engine.train()
    return result


def _classification(engine, loader, normalize, dtype, device, num_labels, copies) -> Evaluation:
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # correct@1, correct@5, count
    confusion = torch.zeros(num_labels * num_labels, dtype=torch.float64, device=device)
    shown = None
    for images, labels, batch in batches(engine, loader, normalize, dtype, device):
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
    return Evaluation({"top1": (totals[0] / totals[2]).item(), "top5": (totals[1] / totals[2]).item()},
                      confusion.view(num_labels, num_labels).cpu(), shown)


def _segmentation(engine, loader, normalize, dtype, device, num_labels) -> Evaluation:
    """The pixels' confusion matrix over every validation image (IGNORE_INDEX pixels left out), and from it each
    class's IoU, true / (true + predicted - both), averaged over the classes present in either (mIoU), and the
    pixel accuracy."""
    confusion = torch.zeros(num_labels * num_labels, dtype=torch.float64, device=device)
    shown = None
    for images, masks, batch in batches(engine, loader, normalize, dtype, device):
        logits = engine(images).logits  # UperNet's at the input's size, SegFormer's at a quarter of it
        if logits.shape[-2:] != masks.shape[-2:]:  # upsampled as the model's own loss does
            logits = F.interpolate(logits.float(), size=masks.shape[-2:], mode="bilinear", align_corners=False)
        predicted = logits.argmax(1)  # (B, H, W)
        counted = masks != IGNORE_INDEX
        confusion += torch.bincount(masks[counted] * num_labels + predicted[counted],
                                    minlength=num_labels * num_labels).to(confusion)
        if shown is None:
            shown = (batch[0][:8], batch[1][:8], predicted[:8].cpu())
    dist.all_reduce(confusion)
    confusion = confusion.view(num_labels, num_labels)
    both, true, predicted = confusion.diagonal(), confusion.sum(1), confusion.sum(0)
    union = true + predicted - both
    present = union > 0
    miou = (both[present] / union[present]).mean().item() if present.any() else 0.0
    return Evaluation({"miou": miou, "pixel_acc": (both.sum() / confusion.sum().clamp(min=1)).item()},
                      confusion.cpu(), shown)


def _reconstruction(engine, loader, normalize, dtype, device, cfg, data_rank, data_ranks) -> Evaluation:
    """The pretraining loss averaged over every validation image (each batch's loss weighted by its images)."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss x images, images
    for index, (images, _, _) in enumerate(batches(engine, loader, normalize, dtype, device)):
        inputs = masked_inputs(cfg, engine.module.config, images, VAL_STEP, index * data_ranks + data_rank)
        loss = engine(**inputs).loss
        totals += torch.stack([loss.double() * len(images), torch.tensor(len(images), device=device)]).to(totals)
    dist.all_reduce(totals)
    return Evaluation({"loss": (totals[0] / totals[1]).item()})
