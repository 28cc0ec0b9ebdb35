"""The NKI kernels of ``lowerings/nki`` against the eager references of ``lowerings/ops.py``.

With the Neuron SDK installed the kernels run in ``nki.simulate``; without it they run in the strict numpy
shim of ``tests/nki_shim``, installed as ``nki`` for this module only. ``BACKEND`` names which, and every
kernel test id starts with it. The shim's own strictness is tested at the end (shim only).
"""

import subprocess
import sys

import pytest
import torch

np = pytest.importorskip("numpy")

from dflash_compile.lowerings import ops  # noqa: E402
from dflash_compile.lowerings.nki import nki_available, register_neuron_kernels  # noqa: E402
from dflash_compile.lowerings.nki.block_attention import block_attention  # noqa: E402
from dflash_compile.lowerings.nki.fused_kv_proj import fused_kv_proj  # noqa: E402
from dflash_compile.lowerings.nki.paged_kv_write import paged_kv_write  # noqa: E402

REAL_NKI = nki_available()
BACKEND = "nki-simulate" if REAL_NKI else "nki-shim"
shim_only = pytest.mark.skipif(REAL_NKI, reason="tests the numpy shim, which is not used with the real SDK")


@pytest.fixture(scope="module", autouse=True)
def _nki_backend():
    if REAL_NKI:
        yield
        return
    import nki_shim

    previous = nki_shim._install()
    yield
    nki_shim._uninstall(previous)


def _params(*cases):
    return [pytest.param(*case[1:], id=f"{BACKEND}-{case[0]}") for case in cases]


# Half-precision inputs are compared with the fp32 reference of the same (upcast) values. Without ml_dtypes,
# bf16 is simulated in fp32 and rounded to bf16 on the way out (the kernels compute in fp32 either way).
DTYPES = [
    pytest.param(torch.float32, 2e-5, 2e-5, id="fp32"),
    pytest.param(torch.float16, 4e-3, 4e-3, id="fp16"),
    pytest.param(torch.bfloat16, 2e-2, 2e-2, id="bf16"),
]


def _assert_close(actual, expected, atol, rtol):
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def _f32(x):
    return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


# --------------------------------------------------------------------------------------------- block_attention
def _attention_inputs(B, Hkv, G, T, D, page_size, NB, with_block, dtype, gen):
    num_pages = B * NB + 2  # pages nobody owns
    num_slots = num_pages * page_size + 1  # and a trash slot
    S = NB * page_size
    ctx_lens = torch.randint(0, S + 1, (B,), generator=gen)
    ctx_lens[0] = 0  # a row without context
    if B > 1:
        ctx_lens[1] = min(S, 150)  # not a multiple of 128
    if B > 2:
        ctx_lens[-1] = S  # a full row
    block_table = torch.randperm(num_pages, generator=gen)[: B * NB].view(B, NB)
    used = (torch.arange(NB)[None, :] * page_size) < ctx_lens[:, None]
    block_table = torch.where(used, block_table, -1)  # unused pages: -1, as a real allocator pads them
    q_positions = (ctx_lens - torch.randint(0, 4, (B,), generator=gen)).clamp(min=0)[:, None] + torch.arange(T)
    return dict(
        q=torch.randn(B, Hkv * G, T, D, generator=gen).to(dtype),
        k_pool=torch.randn(num_slots, Hkv, D, generator=gen).to(dtype),
        v_pool=torch.randn(num_slots, Hkv, D, generator=gen).to(dtype),
        block_table=block_table,
        ctx_lens=ctx_lens,
        q_positions=q_positions,
        k_block=torch.randn(B, Hkv, T, D, generator=gen).to(dtype) if with_block else None,
        v_block=torch.randn(B, Hkv, T, D, generator=gen).to(dtype) if with_block else None,
        page_size=page_size,
    )


def _attention_reference(inputs, causal, window, scale):
    return ops._block_attention_reference(**{k: _f32(v) for k, v in inputs.items()}, causal=causal, window=window,
                                          scale=scale)


ATTENTION_CASES = _params(
    # name, B, Hkv, G, T, D, page_size, NB, with_block, causal, window
    ("T1-ps16-gqa1-d64-ctx-only", 2, 2, 1, 1, 64, 16, 12, False, False, 0),
    ("T3-ps4-gqa2-d128-causal", 3, 2, 2, 3, 128, 4, 40, True, True, 0),
    ("T5-ps16-gqa4-d64-causal-window", 3, 1, 4, 5, 64, 16, 10, True, True, 7),
    ("T5-ps4-gqa4-d128-noncausal-window", 2, 2, 4, 5, 128, 4, 37, True, False, 5),
    ("T3-ps16-gqa2-d64-noncausal", 2, 2, 2, 3, 64, 16, 9, True, False, 0),
    ("T3-ps48-gqa1-d64-causal", 2, 2, 1, 3, 64, 48, 4, True, True, 0),
    ("T3-ps256-gqa2-d64-ctx-only-causal", 2, 1, 2, 3, 64, 256, 2, False, True, 0),
    ("T3-ps16-gqa2-d192-causal", 2, 1, 2, 3, 192, 16, 4, True, True, 0),
    ("T40-ps16-gqa4-d64-rows-over-128", 2, 1, 4, 40, 64, 16, 8, True, True, 0),
    ("T130-ps4-gqa1-d64-queries-over-128", 2, 1, 1, 130, 64, 4, 40, True, True, 9),
    ("T130-ps16-gqa2-d64-queries-over-128", 1, 1, 2, 130, 64, 16, 10, True, True, 0),
)


@pytest.mark.parametrize("B, Hkv, G, T, D, page_size, NB, with_block, causal, window", ATTENTION_CASES)
def test_block_attention_fp32(B, Hkv, G, T, D, page_size, NB, with_block, causal, window):
    gen = torch.Generator().manual_seed(T * 1000 + D + page_size)
    inputs = _attention_inputs(B, Hkv, G, T, D, page_size, NB, with_block, torch.float32, gen)
    scale = D**-0.5
    out = block_attention(**inputs, causal=causal, window=window, scale=scale)
    expected = _attention_reference(inputs, causal, window, scale)
    assert out.dtype == torch.float32 and out.shape == inputs["q"].shape
    _assert_close(out, expected, 2e-5, 2e-5)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("causal, window", _params(("causal-window", True, 6), ("noncausal", False, 0)))
def test_block_attention_dtypes(dtype, atol, rtol, causal, window):
    gen = torch.Generator().manual_seed(7)
    inputs = _attention_inputs(3, 2, 2, 5, 64, 16, 12, True, dtype, gen)
    out = block_attention(**inputs, causal=causal, window=window, scale=0.125)
    assert out.dtype == dtype
    _assert_close(out, _attention_reference(inputs, causal, window, 0.125), atol, rtol)


@pytest.mark.parametrize("case", [pytest.param(None, id=f"{BACKEND}-nan-in-masked-keys")])
def test_block_attention_masked_nan_keys_do_not_contribute(case):
    gen = torch.Generator().manual_seed(3)
    T, page_size, window = 3, 4, 4
    inputs = _attention_inputs(2, 2, 2, T, 64, page_size, 16, True, torch.float32, gen)
    ctx_lens = torch.tensor([41, 23])
    inputs["ctx_lens"] = ctx_lens
    inputs["q_positions"] = ctx_lens[:, None] + torch.arange(T)
    bt = inputs["block_table"] = torch.randperm(2 * 16 + 2, generator=gen)[:32].view(2, 16)  # garbage pages too
    # every slot that holds no visible key (outside the window, beyond ctx_len, or owned by nobody) is NaN
    visible = torch.zeros(inputs["k_pool"].shape[0], dtype=torch.bool)
    for b in range(2):
        for p in range(int(ctx_lens[b]) - window, int(ctx_lens[b])):
            visible[bt[b, p // page_size] * page_size + p % page_size] = True
    inputs["k_pool"][~visible] = float("nan")
    inputs["v_pool"][~visible] = float("nan")
    out = block_attention(**inputs, causal=True, window=window, scale=0.125)
    expected = _attention_reference(inputs, True, window, 0.125)
    assert torch.isfinite(expected).all()
    assert torch.isfinite(out).all()
    _assert_close(out, expected, 2e-5, 2e-5)


@pytest.mark.parametrize("case", [pytest.param(None, id=f"{BACKEND}-no-visible-key")])
def test_block_attention_query_without_keys_is_zero(case):
    gen = torch.Generator().manual_seed(5)
    inputs = _attention_inputs(2, 1, 2, 3, 64, 16, 4, False, torch.float32, gen)
    inputs["ctx_lens"] = torch.tensor([0, 20])
    inputs["q_positions"] = torch.tensor([[0, 1, 2], [30, 31, 32]])
    out = block_attention(**inputs, causal=True, window=5, scale=0.125)  # row 1: window 5 misses p < 20
    assert (out == 0).all()
    _assert_close(out, _attention_reference(inputs, True, 5, 0.125), 0, 0)


# ---------------------------------------------------------------------------------------------- paged_kv_write
@pytest.mark.parametrize(
    "lead, num_slots, N, pool_dtype, value_dtype",
    _params(
        ("nolead-N5-fp32", (), 40, 5, torch.float32, torch.float32),
        ("lead2-N5-fp16pool-fp32values", (2,), 40, 5, torch.float16, torch.float32),
        ("lead2x3-N3-fp32", (2, 3), 17, 3, torch.float32, torch.float32),
        ("lead2-N130-fp16", (2,), 300, 130, torch.float16, torch.float16),
        ("lead2-N5-bf16pool-fp32values", (2,), 40, 5, torch.bfloat16, torch.float32),
    ),
)
def test_paged_kv_write(lead, num_slots, N, pool_dtype, value_dtype):
    gen = torch.Generator().manual_seed(N)
    Hkv, D = 2, 8
    pool = torch.randn(*lead, num_slots, Hkv, D, generator=gen).to(pool_dtype)
    values = torch.randn(*lead, N, Hkv, D, generator=gen).to(value_dtype)
    # distinct slots, the last one (a padded row's trash slot) among them; some counted from the end (-1: last)
    slots = torch.cat([torch.tensor([num_slots - 1]), torch.randperm(num_slots - 1, generator=gen)[: N - 1]])
    negative = torch.rand(N, generator=gen) < 0.3
    negative[0] = True
    slots = torch.where(negative, slots - num_slots, slots)
    expected = pool.clone()
    ops.paged_kv_write(expected, slots, values)
    paged_kv_write(pool, slots, values)
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("case", [pytest.param(None, id=f"{BACKEND}-out-of-range-slots-dropped")])
def test_paged_kv_write_drops_out_of_range_slots(case):
    """The reference raises; the kernel drops such rows (sent one past the pool, never as a negative index)."""
    pool = torch.randn(2, 20, 2, 8)
    values = torch.randn(2, 3, 2, 8)
    slots = torch.tensor([3, 20, -21])
    expected = pool.clone()
    expected[:, 3] = values[:, 0]
    paged_kv_write(pool, slots, values)
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("case", [pytest.param(None, id=f"{BACKEND}-noncontiguous-pool")])
def test_paged_kv_write_noncontiguous_pool(case):
    storage = torch.zeros(20, 2, 2, 8)
    pool = storage.transpose(0, 1)  # [2, 20, 2, 8], not contiguous
    values = torch.randn(2, 3, 2, 8)
    slots = torch.tensor([4, -1, -20])  # slots 4, 19 and 0
    expected = pool.clone()
    ops.paged_kv_write(expected, slots, values)
    paged_kv_write(pool, slots, values)
    assert torch.equal(pool, expected)


# ----------------------------------------------------------------------------------------------- fused_kv_proj
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize(
    "N, H, L, Hkv, D",
    _params(
        ("N1-H96-L2-kv2-d64", 1, 96, 2, 2, 64),
        ("N3-H200-L1-kv4-d128", 3, 200, 1, 4, 128),
        ("N5-H256-L2-kv3-d64", 5, 256, 2, 3, 64),
        ("N130-H64-L1-kv2-d64", 130, 64, 1, 2, 64),
        ("N5-H130-L3-kv1-d32", 5, 130, 3, 1, 32),
        ("N3-H96-L3-kv3-d64-two-feature-tiles", 3, 96, 3, 3, 64),
    ),
)
def test_fused_kv_proj(N, H, L, Hkv, D, dtype, atol, rtol):
    gen = torch.Generator().manual_seed(N * 100 + H)
    ctx = torch.randn(N, H, generator=gen).to(dtype)
    weight = (torch.randn(2 * L * Hkv * D, H, generator=gen) * H**-0.5).to(dtype)
    k_norm_weight = (1 + 0.1 * torch.randn(L, D, generator=gen)).to(dtype)
    angle = torch.randn(N, D, generator=gen)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    k, v = fused_kv_proj(ctx, weight, k_norm_weight, cos, sin, 1e-6)
    k_ref, v_ref = ops._fused_kv_proj_reference(*(_f32(x) for x in (ctx, weight, k_norm_weight, cos, sin)), 1e-6)
    assert k.dtype == v.dtype == dtype and k.shape == v.shape == (L, N, Hkv, D)
    _assert_close(k, k_ref, atol, rtol)
    _assert_close(v, v_ref, atol, rtol)


# ------------------------------------------------------------------------------------------------ registration
def test_register_without_sdk_returns_false(monkeypatch):
    monkeypatch.setitem(sys.modules, "nki", None)  # makes ``import nki`` fail
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)
    assert not nki_available()
    assert register_neuron_kernels() is False
    assert register_neuron_kernels() is False
    for op in ("fused_kv_proj", "paged_kv_write", "block_attention"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"dflash::{op}", "PrivateUse1")


def test_nki_version_floor(monkeypatch):
    import types

    from dflash_compile.lowerings.nki import _runtime

    assert _runtime.NKI_MIN_VERSION == (0, 5, 0)
    fake = types.ModuleType("nki")
    fake.jit = fake.simulate = lambda fn: fn
    monkeypatch.setattr(_runtime, "import_nki", lambda: (fake, None, None))
    for version, ok in [("0.4.2", False), ("0.5.0", True), ("0.5.1.dev3", True), ("1.0", True)]:
        fake.__version__ = version
        assert _runtime.nki_version(fake) is not None
        assert _runtime.nki_available() is ok, version


def test_logical_nc_config(monkeypatch):
    from dflash_compile.lowerings.nki import logical_nc_config

    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    assert logical_nc_config() == 1  # NKI's default when unset; Trn2's runtime defaults to 2: set it there
    for value in ("1", "2"):
        monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", value)
        assert logical_nc_config() == int(value)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "4")
    with pytest.raises(ValueError, match="1 or 2"):
        logical_nc_config()


def test_launch_on_a_device_uses_the_lnc_degree(monkeypatch):
    from dflash_compile.lowerings.nki import _runtime

    class Kernel:
        def __getitem__(self, lnc):
            return lambda *args: ("launched", lnc, len(args))

    meta = torch.empty(2, device="meta")  # any non-CPU tensor takes the device path
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert _runtime.launch(Kernel(), meta, 3) == ("launched", 2, 2)


def test_neuron_device_type_follows_the_renamed_privateuse1_backend():
    code = (
        "import torch\n"
        "from dflash_compile.lowerings.nki import _neuron_device_type\n"
        "assert _neuron_device_type(torch) == 'privateuseone'\n"
        "torch.utils.rename_privateuse1_backend('neuron')  # what torch_neuronx does on import\n"
        "assert _neuron_device_type(torch) == 'neuron'\n"
        "torch.library.define('dflash_test::f', '(Tensor x) -> Tensor')\n"
        "torch.library.register_kernel('dflash_test::f', 'neuron', lambda x: x)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_does_not_need_nki():
    code = (
        "import sys; sys.modules['nki'] = None; sys.modules['torch_neuronx'] = None\n"
        "import dflash_compile\n"
        "from dflash_compile.lowerings.nki import block_attention, fused_kv_proj, paged_kv_write\n"
        "from dflash_compile.lowerings.nki import register_neuron_kernels\n"
        "assert register_neuron_kernels() is False\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------------------------------- the shim is strict
@pytest.fixture
def shim():
    import nki
    import nki.isa as nisa
    import nki.language as nl

    return nki, nl, nisa


def _run(shim, body, *arrays):
    nki, nl, nisa = shim

    @nki.jit
    def kernel(*args):
        return body(nl, nisa, *args)

    return nki.simulate(kernel)(*arrays)


@shim_only
def test_shim_unimplemented_api_raises(shim):
    nki, nl, nisa = shim
    with pytest.raises(NotImplementedError, match="nki.language.softmax"):
        nl.softmax
    with pytest.raises(NotImplementedError, match="nki.isa.nc_matmul_mx"):
        nisa.nc_matmul_mx
    with pytest.raises(NotImplementedError, match="nki.benchmark"):
        nki.benchmark
    with pytest.raises(NotImplementedError, match="high-level"):
        nl.exp(1.0)  # operators exist only as the op of an instruction
    with pytest.raises(NotImplementedError, match="vector_select"):
        _run(shim, lambda nl, nisa, x: x.vector_select(0, None), np.zeros((4, 4), np.float32))


@shim_only
@pytest.mark.parametrize("buffer", ["sbuf", "psum"])
def test_shim_129_partitions_raise(shim, buffer):
    nki, nl, nisa = shim
    with pytest.raises(nisa.NkiValidationError, match="partition dim 129"):
        nl.ndarray((129, 4), dtype=nl.float32, buffer=getattr(nl, buffer))
    nl.ndarray((128, 4), dtype=nl.float32, buffer=getattr(nl, buffer))


def _matmul_body(k, m, n, dst_dtype="float32", dst_buffer="psum"):
    def body(nl, nisa):
        stationary = nl.ndarray((k, m), dtype=nl.float32, buffer=nl.sbuf)
        moving = nl.ndarray((k, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=stationary, value=1.0)
        nisa.memset(dst=moving, value=1.0)
        dst = nl.ndarray((min(m, 128), n), dtype=getattr(nl, dst_dtype), buffer=getattr(nl, dst_buffer))
        nisa.nc_matmul(dst=dst, stationary=stationary, moving=moving)

    return body


@shim_only
def test_shim_matmul_tile_limits(shim):
    nki, nl, nisa = shim
    _run(shim, _matmul_body(128, 128, 512))
    with pytest.raises(nisa.NkiValidationError, match="moving free dim 513 exceeds 512"):
        _run(shim, _matmul_body(128, 128, 513))
    with pytest.raises(nisa.NkiValidationError, match="stationary free dim 129 exceeds 128"):
        _run(shim, _matmul_body(128, 129, 16))
    with pytest.raises(nisa.NkiValidationError, match="float32"):
        _run(shim, _matmul_body(16, 16, 16, dst_dtype="float16"))
    with pytest.raises(nisa.NkiValidationError, match="sbuf tensor cannot be used"):
        _run(shim, _matmul_body(16, 16, 16, dst_buffer="sbuf"))


@shim_only
def test_shim_psum_accumulates_fp32(shim):
    """Three K=128 fp16 matmuls accumulate in fp32 PSUM: 384 * (1 + 2**-10) = 384.375 exactly.

    In fp16 (ulp 0.25 at 384) the running sum could not hold it; in fp32 it is exact."""
    nki, nl, nisa = shim

    def body(nl, nisa, moving_hbm):
        ones = nl.ndarray((128, 1), dtype=nl.float16, buffer=nl.sbuf)
        nisa.memset(dst=ones, value=1.0)
        acc = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.psum)
        for i in range(3):
            moving = nl.ndarray((128, 4), dtype=nl.float16, buffer=nl.sbuf)
            nisa.dma_copy(dst=moving, src=moving_hbm[i * 128:(i + 1) * 128, :])
            nisa.nc_matmul(dst=acc, stationary=ones, moving=moving, accumulate=i > 0)
        res = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=acc)
        out = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=res)
        return out

    moving = np.full((384, 4), 1 + 2**-10, dtype=np.float16)
    out = _run(shim, body, moving)
    assert out.dtype == np.float32
    assert (out == 384.375).all()
    assert float(np.float16(384.375)) != 384.375  # the same sum held in fp16 would be rounded

    def accumulate_on_fresh_psum(nl, nisa):
        a = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=a, value=1.0)
        acc = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=a, moving=a, accumulate=True)

    with pytest.raises(nisa.NkiValidationError, match="accumulate=True"):
        _run(shim, accumulate_on_fresh_psum)


@shim_only
def test_shim_memory_rules(shim):
    nki, nl, nisa = shim

    def dma_from_psum(nl, nisa, x):
        p = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
        nisa.dma_copy(dst=x, src=p)

    def compute_on_hbm(nl, nisa, x):
        t = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=t, src=x)

    def oob_gather(nl, nisa, x):
        idx = nl.ndarray((2, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=idx, value=9)
        t = nl.ndarray((2, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x.ap(pattern=[[4, 2], [1, 4]], offset=0, vector_offset=idx, indirect_dim=0))

    x = np.zeros((4, 4), np.float32)
    with pytest.raises(nisa.NkiValidationError, match="PSUM"):
        _run(shim, dma_from_psum, x)
    with pytest.raises(nisa.NkiValidationError, match="shared_hbm tensor cannot be used"):
        _run(shim, compute_on_hbm, x)
    with pytest.raises(nisa.NkiValidationError, match="out-of-bounds"):
        _run(shim, oob_gather, x)
    with pytest.raises(nisa.NkiValidationError, match="64-bit"):
        _run(shim, lambda nl, nisa, y: None, np.zeros(3, np.int64))
