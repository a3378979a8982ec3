"""compat.py: the DeepSpeed and torch behaviours it relies on, and its version checks.

The behaviours that need real DeepSpeed processes are checked where those already run: the shared-memory
buffer's name and DeepSpeed's process-wide ZeRO-3 linear in tests/ac_equivalence.py (every policy under
ZeRO 1-3), the gathered-weight count in the cpu-smoke benchmark (tests/integration/test_benchmarks.py), the corrections
to DeepSpeed's ZeRO-3 universal-checkpoint load and ZeRO-1/2's float64 gradient norm in tests/integration/test_elastic.py
(bitwise losses need them), hpZ's partition group in tests/integration/test_multinode.py, AutoTP's view of a Swin's head
counts and its consolidation of the shards in tests/integration/test_tensor_parallel.py (a Swin split over 2 ranks, its
export's logits).
"""
import os

import pytest
import torch
from conftest import REPO
from torch.utils._python_dispatch import TorchDispatchMode

import compat


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("function, args", [
    (compat.deepspeed_shm_name, (0,)), (compat.make_zero3_linear_out_of_place, ()),
    (compat.zero3_gathered_bytes, (torch.nn.Linear(2, 2),)), (compat.torch_linear, ()),
    (compat.flop_counter, ()), (compat.flop_count, (None, (), {}, None)), (compat.param_numel, (None,)),
    (compat.param_ndim, (None,)), (compat.is_zero3_partitioned, (None,)), (compat.dispatch_mode_class, ()),
    (compat.op_packet, (None,)), (compat.attention_kernels, ()), (compat.internal_copy_and_view_ops, ()),
    (compat.view_base, (None,)), (compat.storage_id, (None,)), (compat.storage_id_function, ()),
    (compat.hf_init_module, (None, None)), (compat.quiet_deepspeed_deprecations, ()),
    (compat.zero3_hpz_ranks, (None,)), (compat.universal_load_keeps_group_settings, (None,)),
    (compat.is_compiled_in_place, (None,)), (compat.autotp_sees_one_head_count, (None,)),
    (compat.tp_gathered_parameters, (None,)), (compat.mae_fixed_position_embeddings, (None,)),
    (compat.zero12_grad_norm_in_float64, (None,)), (compat.deepspeed_arch_list, ()),
    (compat.local_tensor, (None,)), (compat.foreach_norms_float64, ([],)), (compat.foreach_scale_, ([], None))])
def test_each_function_refuses_another_version(monkeypatch, function, args):
    monkeypatch.setattr(compat, "SUPPORTED", {k: ((0, 0), (0, 1)) for k in compat.SUPPORTED})
    with pytest.raises(compat.CompatError, match=rf"compat.py:{function.__name__} relies on (torch|deepspeed|transformers) "
                                                 rf"0\.0-0\.1 internals and the installed .* is \d"):
        result = function(*args)
        if hasattr(result, "__enter__"):  # a context manager checks when it is entered
            with result:
                pass


def test_installed_and_pinned_versions_lie_in_the_supported_ranges():
    """What runs this test, what `make` installs (requirements.txt) and what the GPU machine has
    (benchmarks/device/stack.txt) are all inside SUPPORTED; the two pinned stacks are its two ends."""
    import importlib

    stack = importlib.import_module("benchmarks.device.stack")
    with open(os.path.join(REPO, "requirements.txt")) as f:
        make = {line.split("==")[0].lower(): line.split("==")[1].split()[0] for line in f if "==" in line}
    device = stack.pins("installed") | stack.pins("carried")
    for package, (low, high) in compat.SUPPORTED.items():
        assert low <= compat.series(compat.installed_version(package)) <= high, package
        assert compat.series(make[package]) == high, (package, make[package])
        assert compat.series(device[package]) == low or package == "deepspeed", (package, device[package])
        assert low <= compat.series(device[package]) <= high, (package, device[package])


def test_series_reads_local_and_pre_release_versions():
    assert compat.series("2.11.0+cu130") == (2, 11)
    assert compat.series("5.24.0") == (5, 24)
    assert compat.series("2.14.0a0+git1234") == (2, 14)
    assert compat.series("0.19.8") == (0, 19)


def test_use_torch_linear_keeps_the_numbers_and_restores_no_global():
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(3, 5, 8)
    expected = layer(x)
    compat.use_torch_linear(layer)
    assert torch.equal(layer(x), expected)
    with compat.functional_linear_is_torchs():
        torch.nn.functional.linear = None  # whatever happens inside, the previous one comes back
    assert torch.nn.functional.linear is compat.torch_linear()


def test_deepspeed_zero3_linear_adds_its_bias_in_place_on_3d_inputs():
    """DeepSpeed's ZeRO-3 linear adds the bias in place into its matmul output for inputs of more than 2
    dimensions (what `_zero3_linear` avoids); for 2-D inputs it runs one out-of-place addmm, which
    `_zero3_linear` flattens to. If DeepSpeed changes either, this fails and the workaround can be revisited."""
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3

    x, w, b = torch.randn(2, 3, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True), torch.randn(4)
    with OpLog() as theirs:
        LinearFunctionForZeroStage3.apply(x, w, b)
    assert "add_" in theirs.ops
    with OpLog() as ours:
        out = compat._zero3_linear(x, w, b)
    assert "addmm" in ours.ops and "add_" not in ours.ops
    expected = torch.nn.functional.linear(x, w, b)
    assert torch.allclose(out, expected, atol=1e-6)
    grads = torch.autograd.grad(out.sum(), (x, w))
    assert all(torch.allclose(g, e, atol=1e-5) for g, e in zip(grads, torch.autograd.grad(expected.sum(), (x, w))))


def test_flop_counter_counts_cpu_attention():
    """torch's counter has no formula for the CPU flash-attention kernel SDPA runs on; compat's counts it as
    the GPU kernel: 2 matmuls of 2*B*H*N*N*D FLOPs."""
    b, h, n, d = 2, 3, 16, 8
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    with OpLog() as log:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert "_scaled_dot_product_flash_attention_for_cpu" in log.ops
    with compat.flop_counter() as counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert counter.get_total_flops() == 2 * 2 * b * h * n * n * d


def test_deepspeed_calls_the_deprecated_collectives_it_quiets():
    """The warnings `quiet_deepspeed_deprecations` hides are torch's for collectives DeepSpeed's ZeRO calls: torch
    2.13 deprecates both (before it, there is nothing to quiet)."""
    import importlib
    import inspect

    theirs = inspect.getsource(importlib.import_module("deepspeed.comm.torch"))
    torchs = inspect.getsource(torch.distributed.distributed_c10d)
    for name in compat.DEEPSPEED_DEPRECATED_COLLECTIVES:
        assert f"torch.distributed.{name}" in theirs, name
        deprecated = f"`torch.distributed.{name}` is deprecated" in torchs
        assert deprecated or compat.series(torch.__version__) < (2, 13), name


def test_dispatcher_names_the_profile_relies_on():
    """The op names the checkpointing profile matches: `.to()` reaches the dispatcher as `_to_copy`, a copying
    reshape as `_unsafe_view`, SDPA on CPU as one of `attention_kernels()`, and views keep their `_base`."""
    to_copy, unsafe_view = compat.internal_copy_and_view_ops()
    x = torch.randn(4, 6)
    with OpLog() as log:
        x.to(torch.float64)
        x.t().reshape(24)
    assert to_copy.__name__ in log.ops and unsafe_view.__name__ in log.ops
    q = torch.randn(1, 2, 8, 4)
    seen = []

    class Kernels(compat.dispatch_mode_class()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Kernels():
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert compat.attention_kernels() & set(seen)
    w = torch.nn.Parameter(torch.randn(3, 3))
    assert compat.view_base(w.t()[1:]) is w and compat.op_packet(torch.ops.aten.mm.default) is torch.ops.aten.mm


def test_hf_init_module_initialises_one_module():
    from models import build_model

    model, _ = build_model("vit-debug", 10, 16)
    layer = model.classifier
    torch.nn.init.zeros_(layer.weight)
    compat.hf_init_module(model, layer)
    assert layer.weight.std() > 0


def test_mae_fixed_position_embeddings_sets_the_tables_transformers_leaves_at_zero():
    """A ViTMAE built from its config has zero sin-cos tables under transformers 5.24 (the reason for the fix);
    after mae_fixed_position_embeddings they are set, the decoder's equal to the encoder's at equal width, and
    they hold the values of ViTMAE's own table function."""
    from transformers import ViTMAEConfig, ViTMAEForPreTraining
    from transformers.models.vit_mae.modeling_vit_mae import build_2d_sinusoidal_position_embedding

    config = ViTMAEConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                          image_size=16, patch_size=4, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                          decoder_num_attention_heads=2, decoder_intermediate_size=64)
    model = ViTMAEForPreTraining(config)
    encoder, decoder = model.vit.embeddings.position_embeddings, model.decoder.decoder_pos_embed
    if compat.series(compat.installed_version("transformers")) == (5, 24):
        assert not encoder.any() and not decoder.any()
    with torch.no_grad():
        compat.mae_fixed_position_embeddings(model)
    table = build_2d_sinusoidal_position_embedding(height=4, width=4, embed_dim=32, cls_token=True)
    assert encoder.any() and torch.equal(encoder, decoder)
    assert sorted(encoder[0].flatten().tolist()) == sorted(table.flatten().tolist())  # its halves swapped, as ViTMAE's


def test_compiling_in_place_is_seen():
    module = torch.nn.Linear(2, 2)
    assert not compat.is_compiled_in_place(module)
    module.compile()  # nothing is compiled before the first call
    assert compat.is_compiled_in_place(module)


def test_deepspeed_arch_list_is_one_deepspeeds_builder_parses(monkeypatch):
    """DeepCompile's op builder (DeepSpeed's own compute_capability_args) stops on Hopper's `9.0a`, which CUDA
    images set; after deepspeed_arch_list it builds for the same architectures."""
    from deepspeed.ops.op_builder.dc import DeepCompileBuilder

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 9.0a;9.0+PTX")
    with pytest.raises(ValueError, match="0a"):
        DeepCompileBuilder().compute_capability_args()
    assert compat.deepspeed_arch_list() == "8.0;9.0;9.0+PTX"
    args = DeepCompileBuilder().compute_capability_args()
    assert sorted(a for a in args if "compute_" in a) == ["-gencode=arch=compute_80,code=sm_80",
                                                          "-gencode=arch=compute_90,code=compute_90",
                                                          "-gencode=arch=compute_90,code=sm_90"]
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert compat.deepspeed_arch_list() is None
