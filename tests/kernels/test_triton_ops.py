"""Triton glue: backend resolution, constraint errors on bad input, tuned-config files."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from compress.kernels import KernelConstraintError, dispatch, reference

triton = pytest.importorskip("triton")


def _int4_inputs(m=4, n=32, k=128, group_size=32, device="cpu"):
    x = torch.randn(m, k, dtype=torch.float16, device=device)
    w_packed = reference.pack_int4(torch.randint(-8, 8, (n, k), dtype=torch.int8)).to(device)
    scales = torch.full((n, k // group_size), 0.01, dtype=torch.float16, device=device)
    return x, w_packed, scales


# ---- unsupported_reason and dispatch ------------------------------------------------------
@pytest.mark.parametrize(
    ("op", "n", "k", "group_size", "match"),
    [
        ("int4", 64, 96, 64, "not divisible by group_size"),
        ("int4", 64, 96, 24, "multiple of 16"),
        ("int8", 64, 96, 48, "group_size % 32"),
        ("int2", 64, 64, 32, "unknown op"),
    ],
    ids=["int4-K-not-div", "int4-g24", "int8-g48", "bad-op"],
)
def test_unsupported_reason_names_the_problem(op, n, k, group_size, match, device):
    from compress.kernels import triton_ops

    reason = triton_ops.unsupported_reason(
        op, device=device, n=n, k=k, group_size=group_size, symmetric=True
    )
    assert reason is not None and match in reason


@pytest.mark.parametrize(
    ("op", "k", "group_size"),
    [("int4", 128, 32), ("int4", 576, 576), ("int8", 200, 200), ("int8", 256, 64)],
    ids=["int4-g32", "int4-per-channel", "int8-per-channel", "int8-g64"],
)
def test_supported_shapes_resolve_to_triton(op, k, group_size, device):
    backend = dispatch.resolve_backend(
        "triton", op, device=device, n=64, k=k, group_size=group_size, symmetric=False
    )
    assert backend == "triton"


def test_forced_triton_on_bad_shape_raises_with_shape(device):
    with pytest.raises(KernelConstraintError, match="K=96 group_size=64"):
        dispatch.resolve_backend(
            "triton", "int4", device=device, n=64, k=96, group_size=64, symmetric=True
        )


def test_auto_never_picks_triton_on_cpu():
    backend = dispatch.resolve_backend(
        "auto", "int4", device=torch.device("cpu"), n=64, k=96, group_size=64, symmetric=True
    )
    assert backend == "reference"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-without-interpreter case")
def test_cpu_without_interpreter_is_unsupported():
    # A fresh process without TRITON_INTERPRET: jit builds real kernels that need a driver
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code = (
        "import torch; from compress.kernels import triton_ops as t; "
        "print(t.unsupported_reason('int4', device=torch.device('cpu'), n=64, k=128, "
        "group_size=32, symmetric=True))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "not CUDA" in out.stdout and "TRITON_INTERPRET=1" in out.stdout


# ---- bad input to the launchers -----------------------------------------------------------
def _bad_int4_cases(device):
    x, w, s = _int4_inputs(device=device)
    misaligned = torch.empty(4 * 128 + 1, dtype=torch.float16, device=device)[1:].view(4, 128)
    return {
        "x-int32": ((x.to(torch.int32), w, s, None), 32, "dtype must be one of"),
        "x-non-contiguous": ((torch.randn(128, 4, device=device).half().t(), w, s, None), 32,
                             "must be contiguous"),
        "x-misaligned": ((misaligned, w, s, None), 32, "16-byte aligned"),
        "K-not-div-group": ((x[:, :96].contiguous(), w[:, :12].contiguous(), s[:, :1], None),
                            64, "not divisible by group_size"),
        "scales-shape": ((x, w, s[:, :2].contiguous(), None), 32, r"expected shape \(32, 4\)"),
        "w-float": ((x, w.float(), s, None), 32, "w_packed"),
        "zeros-int8": ((x, w, s, torch.zeros(4, 4, dtype=torch.int8, device=device)), 32,
                       "zeros"),
    }  # fmt: skip


@pytest.mark.parametrize(
    "case",
    ["x-int32", "x-non-contiguous", "x-misaligned", "K-not-div-group", "scales-shape", "w-float",
     "zeros-int8"],
)  # fmt: skip
def test_int4_bad_input_raises(case, device):
    from compress.kernels import int4_gemm

    args, group_size, match = _bad_int4_cases(device)[case]
    with pytest.raises(KernelConstraintError, match=match):
        int4_gemm.int4_gemm_triton(*args, group_size=group_size)


def test_int4_config_block_k_must_divide_group(device):
    from compress.kernels import int4_gemm

    x, w, s = _int4_inputs(device=device)
    with pytest.raises(KernelConstraintError, match="BLOCK_K=64 does not divide group_size=32"):
        int4_gemm.int4_gemm_triton(x, w, s, None, group_size=32, config=int4_gemm._config(
            16, 32, 64, 1, 4, 2))  # fmt: skip


def test_int8_bad_input_raises(device):
    from compress.kernels import int8_gemm

    x_q = torch.zeros(4, 64, dtype=torch.int8, device=device)
    w_q = torch.zeros(8, 64, dtype=torch.int8, device=device)
    with pytest.raises(KernelConstraintError, match=r"x_scales torch.float16 \(4, 1\)"):
        int8_gemm.int8_int8_gemm_triton(
            x_q, torch.ones(4, 1, dtype=torch.float16, device=device), w_q,
            torch.ones(8, 1, device=device),
        )  # fmt: skip
    with pytest.raises(KernelConstraintError, match="groups of a multiple of 32"):
        int8_gemm.int8_weight_gemm_triton(
            torch.ones(4, 64, dtype=torch.float16, device=device), w_q,
            torch.ones(8, 4, dtype=torch.float16, device=device),
        )  # fmt: skip


# ---- glue functions and tuned configs -----------------------------------------------------
def _w8a8_inputs(m, n=48, k=256, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float32)
    w_q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w_scales = (torch.rand(n, 1, generator=g) * 0.01).to(torch.float16)
    return x, w_q, w_scales


def _int8_reference(x, w_q, w_scales):
    """Per-token int8 x, exact integer product, then (acc * sx) * sw in fp32; also the
    magnitude (|x_q| @ |w_q|^T) * sx * sw that bounds rounding of a reordered sum."""
    x_q, x_scales = reference.quantize_per_token_int8(x)
    acc = x_q.to(torch.int64) @ w_q.to(torch.int64).t()
    mag = x_q.to(torch.int64).abs() @ w_q.to(torch.int64).abs().t()
    sw = w_scales.to(torch.float32).t()
    return (acc.to(torch.float32) * x_scales * sw), mag.double() * x_scales.double() * sw.double()


@pytest.mark.parametrize("m", [17, 24, 33], ids=lambda m: f"M{m}")
def test_int8_int8_linear_equals_the_int8_reference_exactly(m, device):
    """M > 16 takes the GEMM launch (no split-K): int32 accumulation is exact and the epilogue
    multiplies in the reference's order, so the result is bit-identical."""
    from compress.kernels import triton_ops

    x, w_q, w_scales = _w8a8_inputs(m)
    y = triton_ops.int8_int8_linear(x.to(device), w_q.to(device), w_scales.to(device))
    expected, _ = _int8_reference(x, w_q, w_scales)
    assert y.dtype == torch.float32 and torch.equal(y.cpu(), expected)


@pytest.mark.parametrize("m", [1, 5, 16], ids=lambda m: f"M{m}")
def test_int8_int8_linear_decode_is_exact_up_to_split_k_rounding(m, device):
    """M <= 16 takes the decode launch, which splits K and adds scaled fp32 partials
    atomically: not bit-identical (measured up to 0.3 eps x magnitude), bounded by 4 eps."""
    from compress.kernels import triton_ops

    x, w_q, w_scales = _w8a8_inputs(m)
    y = triton_ops.int8_int8_linear(x.to(device), w_q.to(device), w_scales.to(device))
    expected, magnitude = _int8_reference(x, w_q, w_scales)
    error = (y.cpu().double() - expected.double()).abs()
    assert (error <= 4 * torch.finfo(torch.float32).eps * magnitude).all()


@pytest.fixture(scope="module")
def w8a8_layer():
    """A W8A8 layer as quantize.smoothquant makes it (down_proj of the tiny Llama: K=128)."""
    from compress.core.registry import run_passes
    from compress.recipe import parse_recipe
    from compress.testing import make_tiny_llama
    from tests.quant.quant_helpers import tiny_state

    model = make_tiny_llama()
    cfg = parse_recipe({"name": "t", "passes": [{"pass": "quantize.smoothquant"}]}).passes[0]
    run_passes(model, [cfg], tiny_state())
    layer = model.model.layers[0].mlp.down_proj
    assert hasattr(layer, "input_activations")  # a W8A8 layer, wherever its class lives
    return layer


@pytest.mark.parametrize(
    ("shape", "exact"), [((2, 12), True), ((1, 1), False)], ids=["M24-gemm", "M1-decode"]
)
def test_w8a8_layer_triton_branch_matches_the_int8_reference(
    w8a8_layer, shape, exact, device, monkeypatch
):
    """The layer's ``triton`` branch (per-token quantization and GEMM in Triton) against the
    int8 x int8 reference of the same stored weights; on CPU it runs in the interpreter."""
    import copy

    from compress.kernels import triton_ops

    layer = copy.deepcopy(w8a8_layer).to(device)
    layer.backend = "triton"
    if device.type == "cpu" and hasattr(type(layer), "resolved_backend"):
        # W8A8Linear accepts backend "triton" on CUDA only; the interpreter runs it on CPU
        monkeypatch.setattr(type(layer), "resolved_backend", lambda self, dev: "triton")
    calls = []
    real = triton_ops.int8_int8_linear
    monkeypatch.setattr(
        triton_ops, "int8_int8_linear", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    x = torch.randn(*shape, 128, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = layer(x.to(device)).cpu()
    assert calls == [1]  # the branch ran, once per call
    expected, magnitude = _int8_reference(
        x.reshape(-1, 128), layer.weight.cpu(), layer.weight_scale.cpu().reshape(-1, 1)
    )
    expected = expected.reshape(*shape, -1)
    if exact:
        assert torch.equal(y, expected)
    else:
        bound = 4 * torch.finfo(torch.float32).eps * magnitude.reshape(*shape, -1)
        assert ((y.double() - expected.double()).abs() <= bound).all()


@pytest.mark.parametrize(
    ("gpu", "file"),
    [("NVIDIA H100 80GB HBM3", "hopper.json"), ("NVIDIA H200", "hopper.json"),
     ("NVIDIA A100-SXM4-80GB", "ampere.json")],
    ids=["H100", "H200", "A100"],
)  # fmt: skip
def test_tuned_configs_load_and_fit_their_gpu(gpu, file):
    from compress.kernels import int4_gemm, triton_ops

    tuned = triton_ops.load_tuned_configs(gpu)
    limit = triton_ops.read_config_file(file)["shared_memory_bytes"]
    assert tuned is not None and set(tuned) == set(triton_ops.CONFIG_LISTS)
    for path, configs in tuned.items():
        assert configs, path
        decode = path.endswith("decode")
        weight_bytes = 0.5 if path.startswith("int4") else 1
        for c in configs:
            assert (c.kwargs["BLOCK_M"] == 16) == decode, (path, c)
            assert c.kwargs["SPLIT_K"] == 1 or decode, (path, c)
            # fp16 activations, the worst case; the runtime prune would drop a config over it
            assert int4_gemm.shared_memory_estimate(c, 2, weight_bytes) <= limit, (path, c)
        # every int4 group size the exporter writes (32, 64, 128) needs a fitting BLOCK_K
        if path.startswith("int4"):
            assert any(c.kwargs["BLOCK_K"] <= 32 for c in configs), path


def test_unknown_gpu_has_no_tuned_configs():
    from compress.kernels import triton_ops

    assert triton_ops.load_tuned_configs("Tesla T4") is None
