"""Image transforms with PIL and torch (torchvision does not import beside this torch build).

Training: random resized crop, horizontal flip, RandAugment-style ops (Cubuk et al. 2020), then the
model image processor's resize. Evaluation: exactly the image processor's resize. Both return uint8 (3, H, W)
tensors: batches cross from DataLoader workers to the trainer at a quarter of float32's bytes, and `Normalize`
applies the processor's normalisation on the device the model runs on (as timm's prefetching loader does), with
the arithmetic the processor uses, so `pipeline()` on the exported model sees what evaluation saw. Randomness
comes from a `random.Random` per sample, so augmentations repeat exactly on a resumed run.
"""
import math
import random

import numpy as np
import torch
from PIL import Image, ImageEnhance, ImageOps


def _to_tensor(img: Image.Image) -> torch.Tensor:
    """(3, H, W) uint8, contiguous: the one copy a channels-first layout needs."""
    return torch.from_numpy(np.ascontiguousarray(np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)))


class Normalize:
    """uint8 (B, 3, H, W) images -> float32 (x / 255 - mean) / std, on whatever device the batch is on."""

    def __init__(self, processor):
        self.mean = torch.tensor(processor.image_mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(processor.image_std, dtype=torch.float32).view(1, 3, 1, 1)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if self.mean.device != images.device:
            self.mean, self.std = self.mean.to(images.device), self.std.to(images.device)
        return images.float().div_(255.0).sub_(self.mean).div_(self.std)  # in place: one float copy of the batch


class EvalTransform:
    def __init__(self, processor):
        self.size = (processor.size["width"], processor.size["height"])
        self.resample = int(processor.resample)

    def __call__(self, img: Image.Image, rng=None) -> torch.Tensor:
        return _to_tensor(img.convert("RGB").resize(self.size, self.resample))


# RandAugment ops: name -> f(img, magnitude in [0, 1], sign). Ranges follow the paper's table.
def _shear(axis):
    def op(img, m, sign):
        s = sign * 0.3 * m
        coeffs = (1, s, 0, 0, 1, 0) if axis == 0 else (1, 0, 0, s, 1, 0)
        return img.transform(img.size, Image.AFFINE, coeffs, Image.BILINEAR)
    return op


def _translate(axis):
    def op(img, m, sign):
        t = sign * 0.45 * m * img.size[axis]
        coeffs = (1, 0, t, 0, 1, 0) if axis == 0 else (1, 0, 0, 0, 1, t)
        return img.transform(img.size, Image.AFFINE, coeffs, Image.BILINEAR)
    return op


RAND_OPS = {
    "AutoContrast": lambda img, m, s: ImageOps.autocontrast(img),
    "Equalize": lambda img, m, s: ImageOps.equalize(img),
    "Rotate": lambda img, m, s: img.rotate(s * 30 * m, resample=Image.BILINEAR),
    "Solarize": lambda img, m, s: ImageOps.solarize(img, 256 - int(256 * m)),
    "Posterize": lambda img, m, s: ImageOps.posterize(img, 8 - int(4 * m)),
    "Color": lambda img, m, s: ImageEnhance.Color(img).enhance(1 + s * 0.9 * m),
    "Contrast": lambda img, m, s: ImageEnhance.Contrast(img).enhance(1 + s * 0.9 * m),
    "Brightness": lambda img, m, s: ImageEnhance.Brightness(img).enhance(1 + s * 0.9 * m),
    "Sharpness": lambda img, m, s: ImageEnhance.Sharpness(img).enhance(1 + s * 0.9 * m),
    "ShearX": _shear(0), "ShearY": _shear(1), "TranslateX": _translate(0), "TranslateY": _translate(1),
}


class TrainTransform(EvalTransform):
    def __init__(self, processor, crop_scale_min: float = 0.08, hflip: float = 0.5, randaug_n: int = 2,
                 randaug_m: int = 9):
        super().__init__(processor)
        self.scale, self.hflip, self.n, self.m = (crop_scale_min, 1.0), hflip, randaug_n, randaug_m / 10

    def _crop_box(self, w: int, h: int, rng):
        """Inception-style random resized crop: area in `scale`, aspect ratio in [3/4, 4/3] (log-uniform)."""
        for _ in range(10):
            area = w * h * rng.uniform(*self.scale)
            ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
            if 0 < cw <= w and 0 < ch <= h:
                x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
                return x, y, x + cw, y + ch
        side = min(w, h)  # fallback: central square
        return (w - side) // 2, (h - side) // 2, (w + side) // 2, (h + side) // 2

    def __call__(self, img: Image.Image, rng) -> torch.Tensor:
        img = img.convert("RGB")
        if self.scale[0] < 1.0:
            img = img.resize(self.size, self.resample, box=self._crop_box(*img.size, rng))
        else:
            img = img.resize(self.size, self.resample)
        if rng.random() < self.hflip:
            img = ImageOps.mirror(img)
        for name in rng.sample(sorted(RAND_OPS), self.n) if self.n else ():
            img = RAND_OPS[name](img, self.m, rng.choice((-1, 1)))
        return _to_tensor(img)


class SegEvalTransform(EvalTransform):
    """Segmentation: the image as EvalTransform gives it, its mask resized alike with nearest-neighbour (a label is
    never blended with its neighbour's); (uint8 (3, H, W), int64 (H, W))."""

    def __call__(self, img: Image.Image, mask: Image.Image, rng=None) -> tuple[torch.Tensor, torch.Tensor]:
        return super().__call__(img), _mask_tensor(mask.resize(self.size, Image.NEAREST))


class SegTrainTransform(TrainTransform):
    """Segmentation: one random resized crop and flip for the image and its mask together (the mask
    nearest-neighbour), then RandAugment's photometric ops on the image alone (its geometric ones would move
    pixels off their labels). Crop scale from `crop_scale_min`, as for classification."""

    PHOTOMETRIC = ("AutoContrast", "Equalize", "Solarize", "Posterize", "Color", "Contrast", "Brightness", "Sharpness")

    def __call__(self, img: Image.Image, mask: Image.Image, rng) -> tuple[torch.Tensor, torch.Tensor]:
        img = img.convert("RGB")
        if img.size != mask.size:
            raise ValueError(f"image {img.size[0]}x{img.size[1]} and mask {mask.size[0]}x{mask.size[1]} differ in size")
        box = self._crop_box(*img.size, rng) if self.scale[0] < 1.0 else None
        img = img.resize(self.size, self.resample, box=box)
        mask = mask.resize(self.size, Image.NEAREST, box=box)
        if rng.random() < self.hflip:
            img, mask = ImageOps.mirror(img), ImageOps.mirror(mask)
        for name in rng.sample(self.PHOTOMETRIC, min(self.n, len(self.PHOTOMETRIC))) if self.n else ():
            img = RAND_OPS[name](img, self.m, rng.choice((-1, 1)))
        return _to_tensor(img), _mask_tensor(mask)


def _mask_tensor(mask: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(mask, dtype=np.uint8).astype(np.int64))


def mix_batch(images: torch.Tensor, labels: torch.Tensor, num_classes: int, mixup: float, cutmix: float,
              generator: torch.Generator):
    """Mixup (Zhang et al. 2018) or CutMix (Yun et al. 2019), one of them per batch with equal odds when
    both alphas are set. Returns images and soft targets (B, num_classes). Nothing here reads a tensor on the
    host: the scalars are drawn from Python's generator seeded by `generator`, the permutation from `generator`."""
    targets = torch.zeros(labels.shape[0], num_classes, device=labels.device).scatter_(1, labels.unsqueeze(1), 1.0)
    if not (mixup > 0 or cutmix > 0):
        return images, targets
    draw = random.Random(generator.initial_seed())
    use_cutmix = cutmix > 0 and (mixup <= 0 or draw.random() < 0.5)
    alpha = cutmix if use_cutmix else mixup
    lam = draw.betavariate(alpha, alpha)
    # the copy to the device waits for nothing (a blocking one would wait for the device's queue)
    perm = torch.randperm(images.shape[0], generator=generator).to(images.device, non_blocking=True)
    if use_cutmix:
        h, w = images.shape[-2:]
        ch, cw = int(h * math.sqrt(1 - lam)), int(w * math.sqrt(1 - lam))
        cy, cx = draw.randrange(h), draw.randrange(w)
        y0, y1, x0, x1 = max(cy - ch // 2, 0), min(cy + ch // 2, h), max(cx - cw // 2, 0), min(cx + cw // 2, w)
        images = images.clone()
        images[..., y0:y1, x0:x1] = images[perm][..., y0:y1, x0:x1]
        lam = 1 - (y1 - y0) * (x1 - x0) / (h * w)  # the area actually pasted
    else:
        images = lam * images + (1 - lam) * images[perm]
    return images, lam * targets + (1 - lam) * targets[perm.to(targets.device, non_blocking=True)]
