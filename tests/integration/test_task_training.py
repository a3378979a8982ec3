"""The tasks beyond classification through train.py (`task: mae` on a ViT, `simmim` on a Swin, `segmentation`
with UperNet over a Swin on the digits-on-a-canvas shards) on 2 ranks under ZeRO 1, 2 and 3: a checkpointing
policy, a resume and a resume on another number of ranks each continue the uninterrupted `none` run's losses
bitwise (the masks drawn from seed, step and slot); the run's export, and export.py's merge of its checkpoint,
are the same weights; the exports load in transformers (a segmentation one in pipeline("image-segmentation"),
an MAE encoder as a classifier to fine-tune); and the input a task cannot take is one line, exit 2.
"""
import json

import numpy as np
import pytest
import torch
from conftest import check_input, fork_start, launch, read_metrics, run_entry, seg_shards
from safetensors.torch import load_file

from benchmarks.fault_injection import arg

# each task's arguments: SimMIM on the Swin masks 4x4-pixel blocks of its 2-pixel patches; segmentation reads
# 11 classes (background and the ten digits)
TASKS = {
    "mae": ["--model", "vit-debug", "--mask_ratio", "0.75"],
    "simmim": ["--model", "swin-debug", "--mask_ratio", "0.6", "--mask_patch_size", "4"],
    "segmentation": ["--model", "swin-debug", "--num_labels", "11", "--label_smoothing", "0"],
    "segformer": ["--model", "segformer-debug", "--num_labels", "11", "--label_smoothing", "0", "--image_size", "32"],
}
TASK = {"segformer": "segmentation"}  # the task of each case not named after its task
METRIC = {"mae": "val_loss", "simmim": "val_loss", "segmentation": "val_miou"}


@pytest.fixture
def task_args(request, debug_args):
    """debug_args with the task's own shards and arguments."""
    def args(task):
        task, case = TASK.get(task, task), task
        shards = seg_shards(request.getfixturevalue("digits_seg")) if task == "segmentation" else []
        return debug_args + shards + TASKS[case] + ["--task", task]
    return args
# ZeRO-3 of MAE and UperNet segmentation in the default run; ZeRO-1 and 2, SimMIM (whose path differs from
# MAE's by the mask's form alone) and SegFormer (segmentation's path with another model) under `-m slow`
# ZeRO-3: MAE in the default run (segmentation is the default run's DDP case, and ZeRO-3's resume MAE's)
CASES = [pytest.param(task, stage, marks=[] if stage == 3 and task == "mae" else [pytest.mark.slow],
                      id=f"{task}-zero{stage}") for task in TASKS for stage in (1, 2, 3)]
# the FSDP2 engine: MAE in the default run (the task's own loss, masks and export), the rest under `-m slow`
CASES += [pytest.param(task, "fsdp2", marks=[] if task == "mae" else [pytest.mark.slow], id=f"{task}-fsdp2")
          for task in TASKS]
# the DDP engine: UperNet segmentation in the default run (a parameter the forward never uses), the rest slow
CASES += [pytest.param(task, "ddp", marks=[] if task == "segmentation" else [pytest.mark.slow], id=f"{task}-ddp")
          for task in TASKS]
STEPS, SAVED = 8, 4


def losses(run_dir, first=1):
    records = {r["step"]: r["loss"] for r in read_metrics(run_dir)}
    return np.array([records[s] for s in range(first, STEPS + 1)])


def weights(run_dir):
    return load_file(f"{run_dir}/hf_model/model.safetensors")


def state_dict(model_dir):
    """The weights of a Hugging Face directory as its own class loads them (save_pretrained writes transformers'
    legacy names, export.py the modules' own)."""
    import transformers

    architecture = json.load(open(f"{model_dir}/config.json"))["architectures"][0]
    return getattr(transformers, architecture).from_pretrained(model_dir).state_dict()


@pytest.mark.parametrize("task,stage", CASES)
def test_policy_resume_and_elastic_resume_continue_the_run_bitwise(task_args, tmp_path, task, stage):
    case, task = task, TASK.get(task, task)
    engine = ["--engine", stage, "--zero_stage", 3] if stage in ("fsdp2", "ddp") else ["--zero_stage", stage]
    args = task_args(case) + engine + ["--max_steps", STEPS, "--micro_batch_size", 8, "--warmup_steps", 2,
                                       "--eval_every", SAVED]
    full = tmp_path / "full"
    launch(args + ["--save_every", SAVED, "--output_dir", full])
    records = read_metrics(full)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in records)
    metric = METRIC[task]
    evals = [r[metric] for r in records if metric in r]
    assert len(evals) == 2 and all(np.isfinite(evals))
    summary = json.load(open(full / "summary.json"))
    assert summary["task"] == task and summary[metric] == evals[-1] and "val_top1" not in summary
    state = json.load(open(full / "checkpoints" / f"step{SAVED:07d}" / "train_state.json"))
    # keep_best ranks checkpoints by the val mIoU, or (pretraining) by the val loss, lower first
    assert state["val_score"] == (evals[0] if task == "segmentation" else -evals[0])

    # the step-4 checkpoint continued under selective recompute, in a fresh directory: the same 4 losses, the
    # same final weights (every gradient equal: AdamW would carry a difference into the weights)
    ckpt = full / "checkpoints" / f"step{SAVED:07d}"
    resumed = tmp_path / "resumed"
    proc = launch(args + ["--ac", "selective", "--output_dir", resumed, "--resume", ckpt])
    assert f"at step {SAVED}" in proc.stdout and "data order restarts" not in proc.stdout
    np.testing.assert_array_equal(losses(resumed, SAVED + 1), losses(full, SAVED + 1))
    final = weights(full)
    assert all(weights(resumed)[k].equal(v) for k, v in final.items()), [k for k, v in final.items() if not weights(resumed)[k].equal(v)]

    # on 1 rank accumulating 2 micro-batches (the same slots, so the same masks), under full recompute
    one = tmp_path / "one"
    proc = launch(args + ["--ac", "full", "--grad_accum_steps", 2, "--output_dir", one, "--resume", ckpt], nproc=1)
    if stage not in ("fsdp2", "ddp"):  # DCP reshards at load, without a conversion
        assert "converting it to DeepSpeed's universal format" in proc.stdout
    np.testing.assert_array_equal(losses(one, SAVED + 1), losses(full, SAVED + 1))

    # export.py merges the final checkpoint into the weights the run exported
    out = tmp_path / "exported"
    proc = run_entry("export", full / "checkpoints" / f"step{STEPS:07d}", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported, live = state_dict(out), state_dict(full / "hf_model")
    assert exported.keys() == live.keys() and all(exported[k].equal(v) for k, v in live.items())


def test_mae_exports_its_pretraining_model_and_an_encoder_that_fine_tunes(task_args, debug_args, tmp_path):
    """hf_model/ of an MAE run with an EMA of its weights (exported) is transformers' ViTMAEForPreTraining (the
    noise decides the mask); encoder/ is a ViTModel with the same encoder weights, which
    configs/digits-mae-finetune.yaml (`model: encoder/`, layer-wise lr decay, stochastic depth) trains as a
    classifier with a new head initialised from the seed."""
    from transformers import ViTMAEForPreTraining, ViTModel

    pretrain = tmp_path / "mae"
    launch(task_args("mae") + ["--max_steps", 2, "--eval_every", 0, "--save_every", 0, "--ema_decay", 0.9,
                               "--export_ema", "true", "--output_dir", pretrain], nproc=1)
    last = read_metrics(pretrain)[-1]
    assert np.isfinite(last["val_loss"]) and np.isfinite(last["val_ema_loss"])
    assert last["val_ema_loss"] != last["val_loss"]  # the averaged weights, evaluated on their own
    model = ViTMAEForPreTraining.from_pretrained(pretrain / "hf_model").eval()
    assert model.config.mask_ratio == 0.75 and model.config.norm_pix_loss
    images = torch.randn(2, 3, 16, 16)
    noise = torch.rand(2, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(images, noise=noise), model(images, noise=noise)
    assert torch.equal(a.mask, b.mask) and int(a.mask.sum()) == 2 * 48 and torch.isfinite(a.loss)
    encoder = ViTModel.from_pretrained(pretrain / "encoder", add_pooling_layer=False)
    mae = model.vit.state_dict()
    assert all(v.equal(mae[k]) for k, v in encoder.state_dict().items())

    finetune = tmp_path / "finetune"
    proc = launch(debug_args + ["--config", "configs/digits-mae-finetune.yaml", "--model", pretrain / "encoder",
                                "--max_steps", 2, "--eval_every", 0, "--save_every", 0, "--output_dir", finetune],
                  nproc=1)
    assert "is a ViTModel without a classifier; its head is initialised for 10 classes" in proc.stdout
    from transformers import AutoModelForImageClassification

    classifier = AutoModelForImageClassification.from_pretrained(finetune / "hf_model")
    assert classifier.config.model_type == "vit" and classifier.classifier.out_features == 10


@pytest.mark.parametrize("case", ["segmentation", "segformer"])  # UperNet over a Swin; SegFormer
def test_the_segmentation_export_loads_in_the_pipeline_and_tensorboard_shows_masks(task_args, tmp_path, case):
    """SegFormer's logits, at a quarter of the image, are upsampled to the masks for the metrics."""
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import pipeline

    launch(task_args(case) + ["--max_steps", 2, "--eval_every", 2, "--save_every", 0, "--ema_decay", 0.9,
                              "--report_to", "tensorboard", "--output_dir", tmp_path], nproc=1)
    summary = json.load(open(tmp_path / "summary.json"))
    assert 0 <= summary["val_ema_miou"] <= 1 and 0 <= summary["val_ema_pixel_acc"] <= 1
    assert 0 <= summary["val_miou"] <= 1 and 0 <= summary["val_pixel_acc"] <= 1
    side = int(arg(task_args(case), "image_size"))
    confusion = np.array(summary["confusion"])  # pixels: 359 images, none ignored
    assert confusion.shape == (11, 11) and confusion.sum() == 359 * side * side
    assert np.trace(confusion) / confusion.sum() == pytest.approx(summary["val_pixel_acc"])
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0}).Reload()
    assert [e.step for e in events.Images("val/masks")] == [2]
    segment = pipeline("image-segmentation", model=str(tmp_path / "hf_model"))
    labels = [r["label"] for r in segment(Image.new("RGB", (16, 16)))]
    assert labels and set(labels) <= {"background", *map(str, range(10))}


# MAE's in the default run; segmentation's and SimMIM's (whose job differs from MAE's by the mask's form alone)
# under -m slow
@pytest.mark.parametrize("task", ["mae", *(pytest.param(t, marks=pytest.mark.slow) for t in ("segmentation",
                                                                                          "simmim"))])
def test_preemption_and_a_kill_mid_evaluation_are_survived(digits, digits_seg, tmp_path, monkeypatch, task):
    """The fault harness (benchmarks/fault_injection.py) on each task's job, ZeRO-3, 20 steps: SIGTERM to the job
    at a step the seed draws (the ranks finish it, checkpoint it and exit; the relaunch continues from it) and
    kill -9 while rank 0 runs the task's evaluation (the relaunch continues from the newest checkpoint). Each
    run ends with the uninterrupted run's losses and exported weights, bitwise."""
    from benchmarks import fault_injection
    from benchmarks.fault_injection import Episode, job_args, run_all

    monkeypatch.setattr(fault_injection, "start", fork_start(fault_injection.start))
    shards = digits if task != "segmentation" else {"dir": str(digits_seg), "val": f"{digits_seg}/val-000000.tar",
                                                     "train": f"{digits_seg}/train-{{000000..000003}}.tar"}
    base = job_args(task) + ["--max_steps", 20, "--save_every", 5, "--eval_every", 10, "--num_workers", 0]
    reference = tmp_path / "reference"
    launch(base + ["--zero_stage", 3, "--train_shards", shards["train"], "--val_shards", shards["val"],
                   "--output_dir", reference])
    episodes = [Episode(kind=kind, stage=3, launcher="fork", aim="") for kind in ("sigterm", "kill-eval")]
    run_all(episodes, 0, base, shards, {3: str(reference)}, str(tmp_path), log=lambda s: None)
    for ep in episodes:
        detail = f"{ep}\n{open(next(tmp_path.glob(f'*-{ep.kind}')) / 'log.txt').read()[-3000:]}"
        assert ep.hit and ep.finished and not ep.lost, detail
        assert len(ep.exit_codes) == 2 and ep.exit_codes[0] != 0 and ep.exit_codes[1] == 0, detail
        assert ep.compared_steps == 20 and ep.losses_equal and ep.weights_equal, detail
    sigterm, kill = episodes
    assert sigterm.steps_lost == 0, sigterm  # the preempted step was checkpointed
    assert kill.steps_lost < 5, kill


@pytest.mark.parametrize("args,message", [
    (["--task", "mae", "--model", "swin-debug"], "error: task mae needs a ViT (swin-debug is a swin)"),
    (["--task", "segmentation", "--model", "vit-debug", "--num_labels", "11", "SEG"],
     "error: task segmentation needs a Swin backbone"),
    (["--task", "segmentation", "--model", "swin-debug"],  # the classification shards
     "error: train_shards: 64 of the first 64 samples of"),
    (["--task", "segmentation", "--model", "swin-debug", "--num_labels", "5", "SEG"],
     "error: num_labels is 5 but the train shards' _info.json lists 11 classes"),
    (["--task", "simmim", "--model", "vit-debug", "--mask_patch_size", "6"],
     "error: mask_patch_size 6 must be a multiple of the patch size 2 and divide image_size 16"),
    (["--task", "mae", "--model", "vit-debug", "--image_size", "15"],
     "error: image_size 15 is not a multiple of patch_size 2"),
    (["--task", "depth"], "error: config key 'task' must be one of"),
    (["--task", "mae", "--tp_size", "2"], "error: task mae with tp_size > 1"),
    (["--task", "segmentation", "--model", "segformer-debug", "--num_labels", "11", "SEG"],
     "error: image_size 16: SegFormer's stage 1 is 4 tokens wide, narrower than the 8x8 reduction"),
    (["--model", "segformer-debug", "--image_size", "32", "--tp_size", "2"],
     "error: tp_size 2: tensor parallelism splits ViT and Swin blocks, not segformer's"),
    (["--model", "segformer-b0", "--patch_size", "4"], "error: patch_size 4: segformer-b0's patch embeddings are fixed"),
])
def test_a_task_the_model_or_input_cannot_take_is_one_line(debug_args, digits_seg, tmp_path, capsys, monkeypatch,
                                                           args, message):
    """SEG: the segmentation shards (masks of 11 classes)."""
    args = [a for a in args if a != "SEG"] + (seg_shards(digits_seg) if "SEG" in args else [])
    code, err = check_input(debug_args + ["--output_dir", tmp_path / "run"] + args, capsys, monkeypatch)
    assert code == 2 and len(err) == 1 and err[0].startswith(message), err
    assert not (tmp_path / "run").exists()


def test_a_model_whose_blocks_are_not_found_is_one_line(debug_args, tmp_path, capsys, monkeypatch):
    """A local directory of a model without transformer blocks (a ResNet): one line, exit 2, nothing written."""
    from transformers import ResNetConfig, ResNetForImageClassification

    ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1],
                                              num_labels=10)).save_pretrained(tmp_path / "resnet")
    code, err = check_input(debug_args + ["--model", tmp_path / "resnet", "--output_dir", tmp_path / "run"], capsys,
                            monkeypatch)
    assert code == 2 and err == [f"error: model {tmp_path / 'resnet'}: no transformer blocks found in "
                                 f"ResNetForImageClassification (an nn.ModuleList whose elements hold an attention "
                                 f"module); this trainer trains ViT, Swin and SegFormer models"], err
    assert not (tmp_path / "run").exists()
