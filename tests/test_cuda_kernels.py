"""CPU tier of the CUDA (NVRTC) kernels in ``qpass.backends.cuda``.

The kernels run only on a GPU (``python -m qpass.apps.bench.cuda_check`` checks them there against
the reference, bit for bit where the arithmetic is exact); here:

* the power-of-two carrier of the tensor-core operand decode (SPEC §3.1), modelled with the same bit
  operations and roundings as ``kernels/nvfp4_mma.cu``, is exact for all 16 codes x 256 scale bytes;
* every kernel variant the host code can pick compiles with NVRTC for sm_90 without register spills;
* the kernel configuration is a fixed function of the shape.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from qpass.backends.cuda import linear as cl
from qpass.backends.cuda import runtime
from qpass.quant.rac import topk_channels

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _bits_to(dtype: torch.dtype, bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int16).view(dtype).double()


def _carrier_e2m1(code: torch.Tensor, fp16: bool) -> torch.Tensor:
    """The kernel's e2m1_pair on one nibble placed at bits 12..15 of a half."""
    q = code.to(torch.int32) << 12
    half = (q & 0x8000) | ((q & 0x7000) >> (3 if fp16 else 6))
    return _bits_to(torch.float16 if fp16 else torch.bfloat16, half)


def _carrier_scale(byte: torch.Tensor, fp16: bool) -> torch.Tensor:
    """cvt e4m3 -> f16 (exact), -> f32, * 2^C, -> bf16/fp16 with one RNE rounding."""
    s = byte.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16).float()
    c = 2.0 ** (7 if fp16 else 119)
    return (s * c).to(torch.float16 if fp16 else torch.bfloat16).double()


@pytest.mark.parametrize("fp16", [False, True])
def test_operand_carrier_exact_for_every_code_and_scale_byte(fp16):
    codes = torch.arange(16)
    scales = torch.arange(256)
    e = _carrier_e2m1(codes, fp16)  # [16]
    ref_e = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64)
    assert torch.equal(e, ref_e * 2.0 ** (-14 if fp16 else -126))
    s = _carrier_scale(scales, fp16)
    s_ref = scales.to(torch.uint8).view(torch.float8_e4m3fn).double()
    finite = torch.isfinite(s_ref)
    assert int(finite.sum()) == 254  # 0x7F and 0xFF are NaN in float8_e4m3fn
    assert torch.equal(s[finite], s_ref[finite] * 2.0 ** (7 if fp16 else 119))
    prod = e.unsqueeze(1) * s.unsqueeze(0)  # exact in float64
    dtype = torch.float16 if fp16 else torch.bfloat16
    rounded = prod.to(dtype).double()  # the packed multiply's one rounding
    b = ref_e.unsqueeze(1) * s_ref.unsqueeze(0)  # SPEC §3.1 B = e2m1 * s_b
    fin = torch.isfinite(b)
    assert torch.equal(rounded[fin], prod[fin])  # no rounding happened
    assert torch.equal(rounded[fin], b[fin] * 2.0 ** -7)  # carrier B * 2^-7
    info = torch.finfo(dtype)
    nz = rounded[fin] != 0
    # bf16: every non-zero carrier is a normal number; fp16: the exactness above covers its subnormals
    if not fp16:
        assert float(rounded[fin][nz].abs().min()) >= info.tiny
    assert float(rounded[fin].abs().max()) <= 2688 * 2.0 ** -7 * 448 / 448


def test_choose_config_is_a_fixed_function_of_the_shape():
    assert cl.choose_config(1, 4096, 4096) == cl.MMAConfig(1, 8)
    assert cl.choose_config(1, 4096, 14336) == cl.MMAConfig(1, 8)
    assert cl.choose_config(16, 14336, 4096) == cl.MMAConfig(2, 2)
    assert cl.choose_config(1, 576, 576) == cl.MMAConfig(1, 2)
    assert cl.choose_config(32, 192, 576) == cl.MMAConfig(4, 2)
    assert cl.choose_config(9, 1536, 576).nt == 2


def _cuobjdump() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(tool) if tool.exists() else None


MMA_VARIANTS = [dict(NT=nt, NW=nw, XH=xh, OUT_KIND=ok, HAS_X2=x2, HAS_BIAS=b, ALPHA_KIND=a)
                for nt, nw, xh, ok, x2, b, a in [(1, 8, 0, 0, 0, 0, 0), (2, 2, 0, 0, 1, 1, 1), (4, 2, 1, 1, 0, 1, 2),
                                                  (1, 16, 0, 2, 1, 0, 2), (4, 4, 0, 0, 1, 1, 1)]]
# the one-launch W4A4 builds (QX: the kernel quantizes its own activations; X_KIND = the input dtype)
MMA_VARIANTS += [dict(NT=nt, NW=nw, XH=0, OUT_KIND=ok, HAS_X2=0, HAS_BIAS=b, ALPHA_KIND=a, QX=1, X_KIND=xk)
                 for nt, nw, ok, b, a, xk in [(1, 8, 0, 0, 1, 0), (1, 16, 1, 1, 2, 1), (2, 4, 0, 1, 1, 0)]]
ACT_VARIANTS = [dict(X_KIND=xk, PER_TOKEN=pt, RAC=r, THREADS=th)
                for xk, pt, r, th in [(0, 0, 0, 256), (0, 0, 1, 256), (1, 1, 1, 256), (2, 0, 1, 256), (0, 0, 0, 1024),
                                          (0, 0, 1, 1024), (0, 1, 1, 1024)]]
# the select's stage-1 variants (SEL_AGG: ballot-grouped, __match_any_sync-grouped) that cuda_check times
ACT_VARIANTS += [dict(X_KIND=0, PER_TOKEN=0, RAC=1, THREADS=1024, SEL_AGG=a) for a in (1, 2)]


@pytest.mark.skipif(not runtime.available(), reason="cuda-bindings (NVRTC) not installed: pip install 'qpass[cuda]'")
@pytest.mark.parametrize("name,defines", [("nvfp4_mma", d) for d in MMA_VARIANTS] + [("nvfp4_act", d) for d in ACT_VARIANTS])
def test_kernels_compile_for_sm90_without_spills(name, defines, tmp_path, monkeypatch):
    monkeypatch.setenv("QPASS_CUDA_CACHE", str(tmp_path))
    cubin = runtime.compile_cubin(name, defines, "sm_90")
    assert cubin[:4] == b"\x7fELF"
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump (from the triton wheel) not available")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    # act.py launches the 1024-thread build only for act_fused and rac_select (the one-CTA kernels), the
    # 256-thread build for the multi-CTA chain
    launched = None
    if name == "nvfp4_act":
        launched = {"act_fused", "rac_select"} if defines["THREADS"] == 1024 else {"act_amax", "act_quant", "rac_residual"}
    checked = 0
    # QX builds: the block quantizer's float division has a slow-path subroutine (CALL.REL), and the
    # calling convention saves up to two registers live across it on the stack; anything more is a spill
    stack_ok = 16 if defines.get("QX") else 0
    for m in re.finditer(r"Function (\w+):\s+REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res):
        if launched is None or m.group(1) in launched:
            assert int(m.group(3)) <= stack_ok and int(m.group(5)) == 0, (m.group(1), res)
            checked += 1
    assert checked >= (2 if launched else 1), res
    if launched:  # every launched entry point was found (a renamed kernel cannot make this vacuous)
        assert launched <= set(re.findall(r"Function (\w+):", res)) | ({"rac_residual"} if not defines["RAC"] else set()), res
    if name == "nvfp4_mma":
        assert "HMMA.16816.F32" in sass  # the tensor-core path, not FFMA
        assert "HMUL2" in sass  # one packed multiply per operand pair (the exact B)
    # the compile is cached on disk: a second call reads the file
    assert runtime.compile_cubin(name, defines, "sm_90") == cubin
    assert any(tmp_path.iterdir())


@pytest.mark.skipif(not runtime.available(), reason="cuda-bindings (NVRTC) not installed")
def test_a_clean_compile_leaves_python_bytes_objects_alone(tmp_path, monkeypatch):
    """NVRTC writes its log and cubin into the buffers it is given. A clean compile has a 1-byte log
    ("\\0"); were that buffer ``b" " * 1``, CPython's shared one-byte ``b" "`` object would become
    ``b"\\x00"`` for the whole process (torch.load then returned empty tensors in later tests)."""
    monkeypatch.setenv("QPASS_CUDA_CACHE", str(tmp_path))
    for name, variants in (("nvfp4_act", ACT_VARIANTS), ("nvfp4_mma", MMA_VARIANTS)):
        for defines in variants:
            runtime.compile_cubin(name, defines, "sm_90")
            # bytes([32]) is the interpreter's cached one-byte object, the one b" " * 1 returns
            assert bytes([32])[0] == 32, (name, defines)


@pytest.mark.skipif(not runtime.available(), reason="cuda-bindings (NVRTC) not installed")
def test_compile_error_names_the_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("QPASS_CUDA_CACHE", str(tmp_path))
    with pytest.raises(runtime.CudaKernelError, match="nvfp4_mma.cu"):
        runtime.compile_cubin("nvfp4_mma", dict(NT=0), "sm_90")  # NT = 0: zero-length arrays do not compile


def test_channel_mask_bits():
    from qpass.backends.cuda.act import channel_mask

    ch = torch.tensor([0, 5, 31, 32, 63, 70])
    m = channel_mask(ch, 80)
    assert m.dtype == torch.int32 and m.shape == (3,)
    w = m.to(torch.int64) & 0xFFFFFFFF
    assert int(w[0]) == (1 << 0) | (1 << 5) | (1 << 31)
    assert int(w[1]) == (1 << 0) | (1 << 31)
    assert int(w[2]) == 1 << 6


def test_fused_smem_holds_the_scores_and_r_only():
    # act_fused's dynamic shared memory: keys = dyn_smem[0:K] (u64), rbuf = (float*)(dyn_smem + K)
    # (nvfp4_act.cu); nothing else since run 3's candidate list was removed
    from qpass.backends.cuda.act import SMEM_BUDGET, fused_smem_bytes

    assert fused_smem_bytes(16, 576, rac=False) == (0, False)
    assert fused_smem_bytes(1, 576, rac=True) == (8 * 576 + 4 * 576, True)
    assert fused_smem_bytes(16, 1024, rac=True) == (8 * 1024 + 4 * 16 * 1024, True)
    k = 4096  # 8K + 4MK = 32768 + 180224 > SMEM_BUDGET at M = 11: the scores only
    assert 8 * k + 4 * 11 * k > SMEM_BUDGET >= 8 * k + 4 * 10 * k
    assert fused_smem_bytes(10, k, rac=True) == (8 * k + 4 * 10 * k, True)
    assert fused_smem_bytes(11, k, rac=True) == (8 * k, False)


# ---------------------------------------------------------------------------------------------
# Models of the kernels' data movement (pure Python, mirroring the CUDA code line by line), so a
# mapping mistake shows up on the CPU before a GPU run. They check the *algorithm*; the GPU check
# (devcheck) checks the CUDA code itself.

def _e2m1_pair_bits(q: int) -> int:
    return (q & 0x80008000) | ((q & 0x70007000) >> 6)


_BF16_TABLE: list[float] = []


def _carrier_value(h: int) -> float:
    """float value of a bf16 bit pattern (subnormals included)."""
    if not _BF16_TABLE:
        _BF16_TABLE.extend(torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).double().tolist())
    return _BF16_TABLE[h]


def _bf16_value(h: int) -> float:
    return _carrier_value(h)


def _bf16_pair(xbits: list, row: int, col: int) -> int:
    """x[row, col] (low half) and x[row, col + 1] (high half) as one 32-bit word of bf16 bits."""
    return (xbits[row][col] & 0xFFFF) | ((xbits[row][col + 1] & 0xFFFF) << 16)


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte sel[4i+3:4i] of {b, a}."""
    src = a | (b << 32)
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _mma_model(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, nw: int) -> torch.Tensor:
    """acc [M, N] of nvfp4_mma_gemm (one n8 tile per 8 tokens) with exact float64 arithmetic."""
    m, k = x.shape
    n = codes.shape[0]
    nt = -(-m // 8)
    e2m1 = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64)
    sval = scales.view(torch.float8_e4m3fn).double() if scales.dtype == torch.uint8 else scales.double()
    words = codes.contiguous().view(torch.int32) if k % 8 == 0 else None  # 8 nibbles per int32 (little endian)
    acc = torch.zeros(-(-n // 16) * 16, nt * 8, dtype=torch.float64)
    xbits = x.to(torch.bfloat16).view(torch.int16).tolist()
    wlist, slist = words.tolist(), sval.tolist()
    nfull = k // 128
    per = -(-nfull // nw) if nfull else 0
    for g0 in range(0, n, 16):
        for warp in range(nw):
            c0 = min(nfull, warp * per)
            c1 = min(nfull, c0 + per)
            chunks = [(c, 2) for c in range(c0, c1)]
            if k % 128 and warp == nw - 1:
                chunks.append((nfull, None))
            for c, full in chunks:
                d = [[0.0] * (nt * 8) for _ in range(16)]  # this warp's accumulator tile
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    kb = c * 128 + 32 * t
                    nb = 2 if full else max(0, min(2, (k - kb) // 16))
                    for r, row in enumerate((g0 + g, g0 + g + 8)):
                        rc = min(row, n - 1)
                        for w in range(4):
                            if w >= 2 * nb:
                                continue
                            word = wlist[rc][(kb // 8) + w] & 0xFFFFFFFF
                            s = slist[rc][kb // 16 + w // 2]
                            for h in range(2):
                                gw = (word << (8 * h)) & 0xFFFFFFFF
                                for qq, sh in ((0, 0), (1, 4)):  # a0/a1 from gw, a2/a3 from gw << 4
                                    pair = _e2m1_pair_bits((gw << sh) & 0xFFFFFFFF)
                                    a_lo, a_hi = _carrier_value(pair & 0xFFFF), _carrier_value(pair >> 16)
                                    for j in range(nt):
                                        for col in range(8):
                                            tok = 8 * j + col
                                            xt = tok if tok < m else 0
                                            xw = [_bf16_pair(xbits, xt, kb + 8 * w + 2 * i) for i in range(4)]
                                            lo_w, hi_w = xw[1 - h], xw[3 - h]
                                            bsel = _prmt(lo_w, hi_w, 0x7632 if qq == 0 else 0x5410)
                                            b_lo, b_hi = _bf16_value(bsel & 0xFFFF), _bf16_value(bsel >> 16)
                                            d[8 * r + g][tok] += (a_lo * s * 2.0**126) * b_lo + (a_hi * s * 2.0**126) * b_hi
                acc[g0:g0 + 16] += torch.tensor(d, dtype=torch.float64)
    return acc[:n, :m].t()


def test_mma_kernel_mapping_model_computes_x_times_b():
    """Every (row, k) product is fed exactly once: with small-integer operands (exact sums in any
    order) the model of the kernel's lane / word / pair / slot mapping equals X·B^T exactly."""
    gen = torch.Generator().manual_seed(0)
    for m, n, k, nw in [(3, 20, 160, 1), (9, 16, 128 + 32 + 16, 2)]:
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        scales = torch.tensor([0x38, 0x40, 0x30, 0x48], dtype=torch.uint8)[torch.randint(0, 4, (n, k // 16), generator=gen)]
        x = torch.randint(-4, 5, (m, k), generator=gen).double()
        e2m1 = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64)
        b = e2m1[torch.stack([codes & 15, codes >> 4], -1).reshape(n, k).long()] * \
            scales.view(torch.float8_e4m3fn).double().repeat_interleave(16, dim=1)
        got = _mma_model(x, codes, scales, nw)
        assert torch.equal(got, x @ b.t()), (m, n, k, nw)


def _pick_bin(hist: list[int], need: int) -> tuple[int, int, bool]:
    """pick_bin of nvfp4_act.cu: the bin holding the need-th largest key, scanning from the top."""
    before = 0
    for d in range(len(hist) - 1, -1, -1):
        if before < need <= before + hist[d]:
            return d, need - before, hist[d] == need - before
        before += hist[d]
    raise AssertionError("need exceeds the candidates")


def _or_and_diff(keys: list[int]) -> int:
    o, a = 0, (1 << 64) - 1
    for key in keys:
        o, a = o | key, a & key
    return o ^ a


def _stage1_bin(key: int, sub: int) -> int:
    """stage1_bin of nvfp4_act.cu: bit length, then the ``sub`` bits below the leading one."""
    length = key.bit_length()
    if length <= 1:
        return length << sub
    below = key & ((1 << (length - 1)) - 1)
    top = below >> (length - 1 - sub) if length - 1 >= sub else below << (sub - (length - 1))
    return length << sub | top


def _radix_select_model(scores: list[int], k: int, passes: list | None = None, bits: int = 10) -> set[int]:
    """select_topk of nvfp4_act.cu at 2**bits threads (one bin per thread): bit length and ``bits - 7``
    bits below the leading one first, then ``bits``-bit windows starting at the highest bit where the
    candidates still differ; stop when the chosen bin's candidates are exactly the ones needed or no
    lower bit differs; ties to the lower index. ``passes`` collects each stage-2 window."""
    k = min(k, len(scores))
    sub = bits - 7
    prefix, pmask, need, all_ = 0, 0, k, False
    full = (1 << 64) - 1
    if k > 0:
        hist = [0] * (1 << bits)
        for key in scores:
            hist[_stage1_bin(key, sub)] += 1
        b1, need, all_ = _pick_bin(hist, need)
        length, top = b1 >> sub, b1 & ((1 << sub) - 1)
        pmask = 0 if length == 64 else full & ~((1 << length) - 1)
        lo = 0
        if length > 0:
            pmask |= 1 << (length - 1)
            prefix = 1 << (length - 1)
            if length - 1 >= sub:
                lo = length - 1 - sub
                pmask |= ((1 << sub) - 1) << lo
                prefix |= top << lo
            else:
                pmask = full
                prefix |= top >> (sub - (length - 1))
        diff = _or_and_diff(scores)
        while not all_ and lo > 0:
            below = diff & ((1 << lo) - 1)
            if not below:
                break
            hi = below.bit_length() - 1
            wlo = hi - (bits - 1) if hi >= bits - 1 else 0
            wmask = (1 << (hi - wlo + 1)) - 1
            cands = [key for key in scores if key & pmask == prefix]
            hist = [0] * (1 << bits)
            for key in cands:
                hist[(key >> wlo) & wmask] += 1
            d, need, all_ = _pick_bin(hist, need)
            prefix |= d << wlo
            pmask |= wmask << wlo
            diff = _or_and_diff(cands)
            lo = wlo
            if passes is not None:
                passes.append((hi, wlo))
    out, before = set(), 0
    if k > 0:
        for j, key in enumerate(scores):
            km = key & pmask
            if km > prefix:
                out.add(j)
            elif km == prefix:
                if all_ or before < need:
                    out.add(j)
                before += 1
    return out


@pytest.mark.parametrize("bits", [8, 9, 10])
def test_rac_select_model_matches_the_reference_top_k(bits):
    gen = torch.Generator().manual_seed(3)
    logspread = (torch.rand(300, generator=gen, dtype=torch.float64) * 61).exp2().floor().to(torch.int64)
    cases = [torch.randint(0, 2**62, (200,), generator=gen), torch.randint(0, 4, (97,), generator=gen),
             torch.zeros(64, dtype=torch.int64), (torch.randint(0, 3, (300,), generator=gen) << 40), logspread,
             torch.cat([logspread[:100], logspread[:100], torch.zeros(50, dtype=torch.int64)]),
             # small keys: fewer bits below the leading one than stage 1's sub-bits
             torch.randint(0, 9, (120,), generator=gen), torch.tensor([1, 2, 3, 1, 2, 3, 0, 5, 4, 6, 7] * 9),
             torch.tensor([2**63 - 1, 2**62, 2**62 + 1, 2**63 - 2, 3 << 61] * 7),
             # one token's scores: a float32 significand shifted up (low bits zero), with repeats
             (torch.randint(2**23, 2**24, (64,), generator=gen)[torch.randint(0, 64, (400,), generator=gen)] << 33)]
    for scores in cases:
        for k in (0, 1, 5, scores.numel() // 2, scores.numel() - 1, scores.numel()):
            want = set(topk_channels(scores, k).tolist())
            assert _radix_select_model(scores.tolist(), k, bits=bits) == want, (scores[:8], k)


def test_rac_select_skips_the_bits_every_candidate_shares():
    """Scores of one token (24 significant bits shifted up by 33): stage 1 decides the bit length and 3 bits
    below the leading one, the windows cover only the rest of the significand, so at most two 10-bit
    passes run (three 8-bit passes at 256 threads; the select before 1024 bins ran three, before that seven)."""
    gen = torch.Generator().manual_seed(5)
    keys = (torch.randint(2**23, 2**24, (512,), generator=gen) << 33).tolist()
    want = set(topk_channels(torch.tensor(keys), 256).tolist())
    for bits, most in ((10, 2), (8, 3)):
        passes: list = []
        assert _radix_select_model(keys, 256, passes, bits=bits) == want
        assert passes and all(lo >= 33 for _, lo in passes) and len(passes) <= most, (bits, passes)
    same: list = []
    assert _radix_select_model([7 << 40] * 100, 30, same) == set(range(30))  # all equal: no window pass
    assert same == []


def test_cuda_backend_registers_every_op_of_the_triton_backend_and_resolves_to_reference_off_cuda():
    import qpass.backends.cuda.registry  # noqa: F401 (registers)
    from qpass.kernel_select import effective_backend
    from qpass.tables import TABLES

    triton_keys = {(op, st) for (op, st, b) in TABLES["kernels"] if b == "triton"}
    cuda_keys = {(op, st) for (op, st, b) in TABLES["kernels"] if b == "cuda"}
    assert triton_keys and triton_keys == cuda_keys
    assert effective_backend("cuda", "cpu") == "reference"
    assert effective_backend("cuda", "cuda") == "cuda"


def test_cuda_routes_refuse_what_they_cannot_serve():
    """A CPU tensor, fp32 activations, gathered RAC or token selection: no route (the caller runs Triton)."""
    from types import SimpleNamespace

    from qpass.backends.cuda import ops as cops
    from qpass.quant.rac import RACConfig

    def call(x, rac=None):
        return SimpleNamespace(x=x, in_features=x.shape[-1], rac=rac)

    assert not cops.routable(call(torch.zeros(1, 64, dtype=torch.bfloat16)))  # not on CUDA
    assert cops.nvfp4_linear(call(torch.zeros(1, 64, dtype=torch.bfloat16))) is None
    if torch.cuda.is_available() and runtime.available():  # pragma: no cover - GPU tier
        x = torch.zeros(1, 64, dtype=torch.bfloat16, device="cuda")
        assert cops.routable(call(x))
        assert not cops.routable(call(x.float()))
        assert not cops.routable(call(x, RACConfig(0.5, "gathered", "batch")))
        assert not cops.routable(call(x, RACConfig(0.5, "masked", "token")))
        assert not cops.routable(call(torch.zeros(1, 48, dtype=torch.bfloat16, device="cuda")))


def _smem_add_u64_model(words: list[int], j: int, v: int) -> None:
    """smem_add_u64 of nvfp4_act.cu on a little-endian u32 array: low word with return, carry into high."""
    m32 = (1 << 32) - 1
    lo, old = v & m32, words[2 * j]
    words[2 * j] = (old + lo) & m32
    hi = ((v >> 32) + (1 if ((old + lo) & m32) < old else 0)) & m32
    if hi:
        words[2 * j + 1] = (words[2 * j + 1] + hi) & m32


def _fused_scores_model(terms: list[list[int]], threads: int = 1024) -> list[int]:
    """Phase 2 of act_fused for M > 1: element p = c * M + m on thread p % threads of round p // threads;
    per warp, a segmented suffix sum over the lanes holding the same block c (shuffle-down steps
    o = 1, 2, 4, ... < min(M, 32)), and the segment's first lane adds the sum with smem_add_u64."""
    m_rows, n_ch = len(terms), len(terms[0])
    total = m_rows * n_ch
    words = [0] * (2 * n_ch)
    span = min(m_rows, 32)
    for base in range(0, total, threads):
        for w0 in range(base, base + threads, 32):
            lanes = [w0 + lane for lane in range(32)]
            c = [p // m_rows if p < total else -1 for p in lanes]
            a = [terms[p % m_rows][c[i]] if p < total else 0 for i, p in enumerate(lanes)]
            o = 1
            while o < span:
                a = [a[i] + (a[i + o] if i + o < 32 and c[i + o] == c[i] else 0) for i in range(32)]
                o *= 2
            for i in range(32):
                if c[i] >= 0 and (i == 0 or c[i - 1] != c[i]) and a[i]:
                    _smem_add_u64_model(words, c[i], a[i])
    return [words[2 * j] | words[2 * j + 1] << 32 for j in range(n_ch)]


def test_fused_score_sums_are_exact_for_every_batch_size():
    """The one-CTA kernel's shared-memory scores equal the column sums of the integer terms, for batch
    sizes that do and do not divide the warp, across round boundaries, with carries out of the low word."""
    rng = torch.Generator().manual_seed(11)
    for m_rows, n_ch in [(2, 48), (3, 40), (5, 33), (16, 80), (31, 9), (33, 7), (64, 20), (100, 11)]:
        big = torch.randint(0, 2**61, (m_rows, n_ch), generator=rng)
        terms = [[int(v) for v in row] for row in big]
        terms[0][0] = 0xFFFFFFFF  # a low word that carries on the next add
        got = _fused_scores_model(terms, threads=64 if m_rows * n_ch > 128 else 1024)
        assert got == [sum(terms[i][j] for i in range(m_rows)) % 2**64 for j in range(n_ch)], (m_rows, n_ch)


def test_one_launch_w4a4_rule_follows_the_run4_timings():
    """The QX route (the GEMM quantizes its own activations) where run 4 measured it faster than the two
    launches: M = 1 on 4096x4096 and the SmolLM2 shapes; not 1x14336x4096 / 1x4096x14336 (each thread of
    a CTA would quantize 4 / 3.5 blocks) nor M = 16 on the SmolLM2 shapes (9 blocks per thread)."""
    q = cl.quantizes_in_kernel
    assert q(1, 4096, 4096) and q(1, 576, 576) and q(1, 576, 1536) and q(1, 1536, 576) and q(1, 576, 192)
    assert not q(1, 4096, 14336) and not q(1, 14336, 4096) and not q(16, 576, 576) and not q(16, 1536, 576)
    assert q(16, 576) and not q(33, 1024)  # without n: only the shared-memory bound (M * K * 2 <= 64 KiB)
