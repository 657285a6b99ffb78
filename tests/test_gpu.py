"""Correctness on the GPU itself (``pytest -m gpu`` on the device; skipped elsewhere): the
compiled kernels against their XLA references, on fresh random data, within the tolerance of
their operand precision (BF16 operands: relative error between 1e-3 and 1e-2 of the norm)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels as pk
from quads_jax import precision as P
from quads_jax.model import ModelConfig, Transformer, token_logprobs

pytestmark = pytest.mark.gpu


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


_TOKAMAX_DW = pytest.mark.xfail(reason="tokamax 0.0.17's dW kernel: 3.5e-2 to 4.7e-2 off ragged_dot's here, 9e-3 off FP32 "
                                "at the bench shapes (H100, 2026-12-05); the default dW is our kernel", strict=False)


@pytest.mark.parametrize("tiles", [pytest.param(pk.GroupedTiles(), marks=_TOKAMAX_DW), pk.KernelConfig().grouped_tiles,
                                   pk.GroupedTiles(dw=pk.DwTiles()), pk.GroupedTiles(dw=pk.DwTiles(block_n=256))],
                         ids=["heuristic", "default", "pallas_dw", "pallas_dw_256"])
def test_tokamax_grouped_dot_fwd_bwd_equals_ragged_dot(tiles):
    rng = np.random.default_rng()
    m, e, k, n = 4096, 16, 512, 256
    counts = rng.multinomial(m, rng.dirichlet(np.ones(e)))
    gs = jnp.asarray(counts, jnp.int32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((e, n, k)) * k**-0.5, jnp.bfloat16)
    ct = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    # the gradients of <y, ct>: dx = ct_e @ W_e and dW_e = ct_e^T @ x_e, BF16 operands
    f = lambda impl: jax.jit(jax.grad(
        lambda x, w: jnp.sum(pk.grouped_dot(x, w, gs, impl=impl, tiles=tiles).astype(jnp.float32) * ct), argnums=(0, 1)))
    gt, gr = f("tokamax")(x, w), f("xla")(x, w)
    assert rel(pk.grouped_dot(x, w, gs, impl="tokamax", tiles=tiles), pk.grouped_dot_xla(x, w, gs)) < 1e-2
    for a, b in zip(gt, gr):
        assert rel(a, b) < 1e-2


@pytest.mark.parametrize("impl", ["cudnn", "tokamax"])
def test_flash_attention_fwd_bwd_equals_xla(impl):
    rng = np.random.default_rng()
    b, t, h, hkv, d = 2, 512, 8, 2, 64
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((b, t, h, d), (b, t, hkv, d), (b, t, hkv, d)))
    lengths = jnp.asarray([t, 300], jnp.int32)
    real = (jnp.arange(t)[None, :] < lengths[:, None])[..., None, None]
    ct = jnp.where(real, jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16), 0)
    f = lambda impl: jax.jit(jax.grad(
        lambda q, k, v: jnp.sum(pk.causal_attention(q, k, v, lengths, impl=impl).astype(jnp.float32) * ct), argnums=(0, 1, 2)))
    o = pk.causal_attention(q, k, v, lengths, impl=impl)
    r = pk.causal_attention(q, k, v, lengths, impl="xla")
    assert rel(jnp.where(real, o, 0), jnp.where(real, r, 0)) < 1e-2
    for a, bb in zip(f(impl)(q, k, v), f("xla")(q, k, v)):
        assert rel(a, bb) < 2e-2


def test_fast_train_path_equals_reference_loss_and_grads():
    cfg = ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=8,
                      experts_per_token=2, expert_ffn=128, max_seq_len=256, compute_dtype="bfloat16")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    g, st = nnx.split(model, nnx.Param)
    rng = np.random.default_rng()
    tokens = jnp.asarray(rng.integers(0, 512, (4, 256)))
    mask = jnp.arange(256)[None, :] < jnp.asarray([[256], [200], [129], [256]])

    def run(kc, remat, chunk):
        prec = P.train_policy_with("nvfp4_w", kc)
        c = cfg.replace(remat=remat, logits_chunk=chunk)
        gg, _ = nnx.split(Transformer(c, rngs=nnx.Rngs(0)), nnx.Param)

        def f(st):
            lp = token_logprobs(nnx.merge(gg, st), tokens, mask, precision=prec)
            return -jnp.sum(jnp.where(mask, lp, 0)) / mask.sum()
        return jax.jit(jax.value_and_grad(f))(st)

    lr, gr = run(pk.KernelConfig(grouped="xla", attention="xla"), "none", 0)
    for kc in (pk.KernelConfig(grouped="tokamax", attention="cudnn"), pk.KernelConfig(grouped="tokamax", attention="tokamax")):
        l, gg = run(kc, "full", 256)
        assert abs(float(l) - float(lr)) < 1e-2 * abs(float(lr))
        num = sum(float(jnp.sum((a.astype(jnp.float32) - b.astype(jnp.float32)) ** 2)) for a, b in zip(jax.tree.leaves(gg), jax.tree.leaves(gr)))
        den = sum(float(jnp.sum(b.astype(jnp.float32) ** 2)) for b in jax.tree.leaves(gr))
        assert (num / den) ** 0.5 < 3e-2, kc


@pytest.mark.parametrize("rac", [0.0, 0.5])
@pytest.mark.parametrize("t", [16, 64, 256])
def test_pallas_nvfp4_matmul_equals_xla(t, rac):
    rng = np.random.default_rng()
    n, k = 1024, 2048
    x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
    w = P.prepare_weight(jnp.asarray(rng.standard_normal((n, k)) * k**-0.5, jnp.float32), "w4a4")
    a = pk.nvfp4_matmul(x, w, rac_ratio=rac, act_scale="token", backend="pallas")
    b = pk.nvfp4_matmul(x, w, rac_ratio=rac, act_scale="token", backend="xla")
    assert rel(a, b) < 2e-3  # the same FP32 products summed in another order, rounded to BF16


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
@pytest.mark.parametrize("grouped", [False, True])
def test_word_decode_keeps_subnormal_operands(grouped, mode):
    """The word decode places each E2M1 code's bits in an FP16 (W4A4) or BF16 (W4A16)
    pattern, the code 0.5 on the type's subnormal 2**(-bias), and ``mul.rn`` by the block
    scale gives E2M1 x E4M3 x 2**-7 (``tile_math.WORD_VALUE_SCALE``). So every weight has
    subnormal inputs to that product, and odd output channels here carry only E4M3's
    subnormal block scales (2**-9 .. 7 x 2**-9, as a checkpoint quantized elsewhere may;
    the project's quantizer keeps scales >= 2**-6), whose FP16 products are subnormal MMA
    inputs. Both match XLA: a flush of subnormals would zero or move them."""
    rng = np.random.default_rng()
    t, n, k = 64, 256, 1024
    x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
    lead = (2,) if grouped else ()
    w = P.prepare_weight(jnp.asarray(rng.standard_normal((*lead, n, k)) * k**-0.5, jnp.float32), "w4a4")
    tiny = (rng.integers(1, 8, (*lead, n // 2, k // 16)) * 2.0**-9).astype(jnp.float8_e4m3fn)  # odd rows: subnormal scales
    w = dataclasses.replace(w, scales=jnp.asarray(w.scales).at[..., 1::2, :].set(tiny))
    kw = dict(act_scale="token", mode=mode, out_dtype=jnp.float32)
    if grouped:
        gs = jnp.asarray([40, 24], jnp.int32)
        f = lambda backend: pk.nvfp4_grouped_matmul(x, w, gs, backend=backend, **kw)
    else:
        f = lambda backend: pk.nvfp4_matmul(x, w, backend=backend, **kw)
    a, b = np.asarray(f("pallas")), np.asarray(f("xla"))
    assert np.abs(b[:, 1::2]).max() > 0 and rel(a[:, 1::2], b[:, 1::2]) < 1e-5  # the same exact products, summed in another order
    assert rel(a, b) < 1e-5


@pytest.mark.parametrize("rac", [0.0, 0.5])
@pytest.mark.parametrize("tokens,decode", [(64, "words"), (256, "words"), (128, "bits"), (1024, "bits")])
def test_pallas_grouped_w4a4_equals_xla_with_each_decode(tokens, decode, rac):
    """The MoE's grouped W4A4 GEMM compiled with the word decode (the rollout's batches) and the
    bit decode (prefill sizes; K tiles of 64), RAC's FP16 token operand through the scaled
    FP16 tables, at the bench model's expert shapes, top-8 of 64, some experts empty."""
    rng = np.random.default_rng()
    e, n, k, topk = 64, 1024, 1024, 8
    m = tokens * topk
    sizes = rng.multinomial(m, rng.dirichlet(np.full(e, 0.5)))
    w = P.prepare_weight(jnp.asarray(rng.standard_normal((e, n, k)) * k**-0.5, jnp.float32), "w4a4")
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    cfg = pk.gemm_config(-(-m // e), n, k, programs_per_row_tile=e)
    if decode == "bits":
        cfg = dataclasses.replace(cfg, decode="bits", block_k=64)
    a = pk.nvfp4_grouped_matmul(x, w, gs, rac_ratio=rac, act_scale="token", backend="pallas", config=cfg)
    b = pk.nvfp4_grouped_matmul(x, w, gs, rac_ratio=rac, act_scale="token", backend="xla")
    assert rel(a, b) < 2e-3, (int((sizes == 0).sum()), cfg)  # FP32 sums in another order, rounded to BF16


def test_pallas_grouped_w4a4_finds_work_items_with_padded_group_sizes():
    """The compiled kernel's programs find their work items from group sizes padded to a power
    of two (48 experts load as 64; empty experts, including the last), and its spare programs
    zero the 40 trailing rows past the sizes' sum: equal to XLA's."""
    rng = np.random.default_rng()
    e, n, k, m = 48, 512, 1024, 512
    sizes = rng.multinomial(m - 40, rng.dirichlet(np.full(e, 0.3)))
    sizes[-1] = 0
    sizes[0] += m - 40 - sizes.sum()
    w = P.prepare_weight(jnp.asarray(rng.standard_normal((e, n, k)) * k**-0.5, jnp.float32), "w4a4")
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    a = pk.nvfp4_grouped_matmul(x, w, gs, rac_ratio=0.5, act_scale="token", backend="pallas")
    b = pk.nvfp4_grouped_matmul(x, w, gs, rac_ratio=0.5, act_scale="token", backend="xla")
    assert rel(a, b) < 2e-3, int((sizes == 0).sum())
    np.testing.assert_array_equal(np.asarray(a[m - 40:], np.float32), 0.0)


@pytest.mark.parametrize("order", [("words", 128), ("plain", 16)])
@pytest.mark.parametrize("tokens", [64, 256])
def test_grouped_gemm_gathers_quantized_rows_in_its_loads(tokens, order):
    """The MoE dispatch's operand: N tokens quantized once, taken by sorted assignment and
    gathered inside the grouped kernel's loads; the same bits as the gathered operand."""
    rng = np.random.default_rng()
    e, n, k, topk = 64, 1024, 1024, 8
    x = jnp.asarray(rng.standard_normal((tokens, k)), jnp.bfloat16)
    ids = rng.integers(0, e, (tokens, topk))
    token = jnp.asarray(np.argsort(ids.reshape(-1), kind="stable") // topk, jnp.int32)
    gs = jnp.asarray(np.bincount(ids.reshape(-1), minlength=e), jnp.int32)
    w = P.prepare_weight(jnp.asarray(rng.standard_normal((e, n, k)) * k**-0.5, jnp.float32), "w4a4")
    lazy = pk.quantize_rows(x, rac_ratio=0.5, order=order, backend="pallas").take(token)
    mm = lambda rows: pk.nvfp4_grouped_matmul(rows, w, gs, rac_ratio=0.5, act_scale="token", backend="pallas")
    np.testing.assert_array_equal(np.asarray(mm(lazy)), np.asarray(mm(lazy.gathered())))


def test_one_launch_over_weights_sharing_an_input_equals_xla():
    """q/k/v and gate/up: several NVFP4 weights in one Pallas launch, each equal to XLA's."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((16, 1024)), jnp.bfloat16)
    ws = [P.prepare_weight(jnp.asarray(rng.standard_normal((n, 1024)) * 1024**-0.5, jnp.float32), "w4a4") for n in (512, 128, 128)]
    got = pk.nvfp4_matmul(x, ws, rac_ratio=0.5, act_scale="token", backend="pallas")
    for g, w in zip(got, ws):
        assert rel(g, pk.nvfp4_matmul(x, w, rac_ratio=0.5, act_scale="token", backend="xla")) < 2e-3


def where_bits_differ(a, b) -> str:
    """'' when a and b hold the same bits, else how many elements differ and the first few."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    bad = np.argwhere(a.view(f"u{a.itemsize}") != b.view(f"u{b.itemsize}"))
    if not len(bad):
        return ""
    first = ", ".join(f"{tuple(int(i) for i in ix)}: {a[tuple(ix)]!r} vs {b[tuple(ix)]!r}" for ix in bad[:4])
    return f"{len(bad)} of {a.size} differ (rows {sorted(set(int(i) for i in bad[:, 0]))[:8]}...), first {first}"


def test_xla_division_and_e4m3_rounding_jitted_on_gpu_equal_the_cpu():
    """The reference's two rounding-sensitive pieces (``nvfp4.ieee_div``, ``round_e4m3`` of a
    block scale), jitted for the GPU and for the CPU, on quotients near E4M3 rounding
    midpoints: which of them makes XLA:GPU's reference depart from the CPU's in rare blocks."""
    from quads_jax import nvfp4

    rng = np.random.default_rng()
    n = 1 << 22
    b = np.float32(rng.uniform(1e-4, 1e-2)) * np.ones(n, np.float32)
    a = (rng.uniform(0.5, 448, n) * b * 6).astype(np.float32)
    cpu = jax.devices("cpu")[0]
    fns = {"ieee_div": lambda a, b: nvfp4.ieee_div(nvfp4.ieee_div(a, 6.0), b),
           "ieee_div + round_e4m3": lambda a, b: nvfp4.round_e4m3(jnp.clip(nvfp4.ieee_div(nvfp4.ieee_div(a, 6.0), b), 2.0**-6, 448.0)),
           "long_div": lambda a, b: nvfp4.long_div(nvfp4.long_div(a, jnp.full_like(a, 6.0)), b)}
    problems = []
    for name, f in fns.items():
        with jax.default_device(cpu):
            want = jax.device_get(jax.jit(f)(jax.device_put(a, cpu), jax.device_put(b, cpu)))
        d = where_bits_differ(jax.device_get(jax.jit(f)(a, b)), want)
        if d:
            problems.append(f"{name}: {d}")
    assert not problems, "\n".join(problems)


# the kernel registry's and the rollout's; (64, 768): 48 blocks a row, energies padded to 64
QUANT_SHAPES = [(16, 2048), (64, 1024), (256, 1024), (256, 2048), (2048, 512), (64, 768)]


@pytest.mark.parametrize("t,k", QUANT_SHAPES)
def test_quantizer_jitted_on_gpu_equals_the_cpu_reference(t, k):
    """The rollout's quantizer (default layout, per-token scales, RAC 0 and 0.5), compiled, and
    its XLA reference jitted for the GPU, both against the XLA reference on the CPU (the bits
    the interpret-mode tests hold the kernel to). Reports where the bits differ."""
    rng = np.random.default_rng()
    x = np.asarray(rng.standard_normal((t, k)) * np.exp(rng.standard_normal((1, k))), jnp.bfloat16)
    cpu = jax.devices("cpu")[0]
    problems = []
    for rho in (0.0, 0.5):
        f = lambda backend, rho=rho: jax.jit(lambda v: pk.quantize_operand(v, rac_ratio=rho, order=pk.default_order(k), backend=backend))
        with jax.default_device(cpu):
            want = jax.device_get(f("xla")(jax.device_put(x, cpu)))
        for name, got in (("pallas", f("pallas")(x)), ("xla on the gpu", f("xla")(x))):
            for out, u, v in zip(("operand", "gx"), jax.device_get(got), want):
                d = where_bits_differ(u, v)
                if d:
                    problems.append(f"rho={rho} {name} {out}: {d}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("t,k", [(16, 2048), (256, 2048)])
@pytest.mark.parametrize("tiles", [dict(parts=1), dict(num_warps=4)], ids=["one_row", "w4"])
def test_per_token_quantizer_tiles_and_selections_are_bit_identical(t, k, tiles):
    """Other tiles (one program a row, fewer warps), the explicit selections and both counts
    give the default's bits. (One warp a row compiled for 75-83 s a case on an H100 and no config
    picks it.)"""
    import dataclasses

    from pallas_kernels.quantizer import quant_config

    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((t, k)) * np.exp(rng.standard_normal((1, k))), jnp.bfloat16)
    base = dataclasses.replace(quant_config(t, k), **tiles)
    for rho, select, count in ((0.0, "rank", "pairs"), (0.5, "rank", "pairs"), (0.5, "energies", "pairs"),
                               (0.5, "rank", "bits"), (0.5, "energies", "bits")):
        cfg = dataclasses.replace(base, select=select, count=count)
        a = pk.quantize_operand(x, rac_ratio=rho, order=pk.default_order(k), backend="pallas", config=cfg)
        b = pk.quantize_operand(x, rac_ratio=rho, order=pk.default_order(k), backend="pallas")
        for u, v in zip(a, b):
            assert not where_bits_differ(u, v), f"rho={rho} {cfg}: {where_bits_differ(u, v)}"


@pytest.mark.parametrize("shape", [(64, 1024, 1024), (2048, 1024)])
def test_weight_fake_quant_kernel_equals_xla(shape):
    """The trainer's QAT weight (FP32 master -> BF16 fake quant), the kernel against
    nvfp4.fake_quant jitted on the GPU and on the CPU."""
    rng = np.random.default_rng()
    w = np.asarray(rng.standard_normal(shape) * np.exp(rng.standard_normal(shape[-1])), np.float32)
    f = lambda backend: jax.jit(lambda v: pk.weight_fake_quant(v, dtype=jnp.bfloat16, backend=backend))
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        want = jax.device_get(f("xla")(jax.device_put(w, cpu)))
    for name, got in (("pallas", f("pallas")(w)), ("xla on the gpu", f("xla")(w))):
        d = where_bits_differ(jax.device_get(got), want)
        assert not d, f"{name}: {d}"


@pytest.mark.parametrize("b,s,splits,h", [(64, 576, None, 16), (8, 2048, None, 16), (256, 576, 1, 16), (32, 576, 2, 24)])
def test_decode_attention_kernel_equals_xla(b, s, splits, h):
    """The live-key decode kernel compiled for the GPU against the masked reference (24 query
    heads: padded to 32 MMA rows)."""
    rng = np.random.default_rng()
    hkv, d = 4, 64
    q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.bfloat16) for _ in range(2))
    lengths = jnp.asarray(rng.integers(0, s + 1, b), jnp.int32).at[0].set(0).at[1].set(s)
    out = pk.decode_attention(q, k, v, lengths, config=pk.DecodeAttentionConfig(splits=splits))
    ref = pk.decode_attention(q, k, v, lengths, impl="xla")
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0)
    assert rel(out, ref) < 1e-2
    # the decode step's form: the kernel writes the new keys in place and attends to them
    kn, vn = (jnp.asarray(rng.standard_normal((b, hkv, d)), jnp.bfloat16) for _ in range(2))
    active = jnp.asarray(rng.random(b) < 0.8)
    new = (kn, vn, active)
    o2, k2, v2 = jax.jit(lambda q, k, v, n, new: pk.decode_attention(q, k, v, n, new=new,
                                                                   config=pk.DecodeAttentionConfig(splits=splits)))(q, k, v, lengths, new)
    ro, rk, rv = pk.decode_attention(q, k, v, lengths, new=new, impl="xla")
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(rk))
    np.testing.assert_array_equal(np.asarray(v2), np.asarray(rv))
    assert rel(o2, ro) < 1e-2


@pytest.mark.parametrize("fp8", [False, True])
def test_tokamax_grouped_dot_of_stored_kn_weights_equals_ragged_dot(fp8):
    """The rollout's expert GEMM (BF16 weights stored [E, K, N]; FP8 stored [E, N, K] through
    tokamax's quantized kernel with unit scales) against lax.ragged_dot, at decode sizes."""
    rng = np.random.default_rng()
    e, k, n, m = 64, 1024, 512, 512
    gs = jnp.asarray(rng.multinomial(m, np.ones(e) / e), jnp.int32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((e, k, n)) * k**-0.5, jnp.float32)
    if fp8:
        x, w8 = x.astype(jnp.float8_e4m3fn).astype(jnp.bfloat16), (jnp.swapaxes(w, 1, 2) * 16).astype(jnp.float8_e4m3fn)
        out = pk.grouped_dot_fp8(x, w8, gs, impl="tokamax")
        ref = pk.grouped_dot_fp8(x, w8, gs, impl="xla")
        assert rel(out, ref) < 4e-3  # exact operands; tokamax writes BF16 (2**-9 rounding)
        return
    kn = pk.ExpertsKN(w.astype(jnp.bfloat16))
    out = pk.grouped_dot_kn(x, kn, gs, impl="tokamax", out_dtype=jnp.float32)
    ref = pk.grouped_dot_kn(x, kn, gs, impl="xla", out_dtype=jnp.float32)
    assert rel(out, ref) < 1e-2


@pytest.mark.parametrize("rho", [0.0, 0.5])
def test_sglang_triton_gemm_agrees_with_its_torch_reference_and_with_jax(rho):
    """The SGLang plugin's Triton W4A4 + RAC GEMM on the device: launched from torch against the
    plugin's torch reference; the plugin's torch quantizer against JAX's (same codes); and the
    same kernel launched from JAX (jax-triton) against the Pallas kernel on the same operands,
    so the SGLang engine and ours compute the same numbers."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("jax_triton")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    from quads_jax import nvfp4 as F
    from rollout.sglang_plugin import numerics as N
    from rollout.sglang_plugin import triton_gemm as TG
    from rollout.sglang_plugin.jax_launch import triton_nvfp4_matmul

    rng = np.random.default_rng()
    t, n, k = 16, 768, 2048
    xf = rng.standard_normal((t, k)).astype(np.float32)
    wf = rng.standard_normal((n, k)).astype(np.float32)
    w = F.quantize(jnp.asarray(wf))
    x = jnp.asarray(xf).astype(jnp.bfloat16)
    xq, rq = pk.quantize_activations_rac(x, rac_ratio=rho, act_scale="token")
    jt = triton_nvfp4_matmul(xq, rq, w, out_dtype=jnp.float32)
    # the Pallas kernel sums RAC's products in FP16 (pallas_kernels.rac), the plugin in FP32
    pallas = pk.nvfp4_matmul(x, w, rac_ratio=rho, act_scale="token", backend="pallas", out_dtype=jnp.float32)
    assert rel(jt, pallas) < 1e-3

    tx = torch.from_numpy(np.asarray(x.astype(jnp.float32))).to(torch.bfloat16).cuda()
    (xc, _, _), _ = N.packed_operands(tx, rho)
    assert np.array_equal(xc.cpu().numpy(), np.asarray(xq.codes))
    tw = torch.from_numpy(np.asarray(w.codes)).cuda()
    ts = torch.from_numpy(np.asarray(jax.lax.bitcast_convert_type(w.scales, jnp.uint8))).cuda().view(torch.float8_e4m3fn)
    gw = torch.tensor(float(np.asarray(w.global_scale)), device="cuda")
    got = TG.quads_linear_triton(tx, tw, ts, gw, rac_ratio=rho, out_dtype=torch.float32)
    ref = N.quads_linear(tx, tw, ts, gw, rac_ratio=rho, out_dtype=torch.float32)
    assert float((got - ref).norm() / ref.norm()) < 1e-3
    assert rel(got.cpu().numpy(), jt) < 1e-3
