"""GPU check + timing of the NVFP4 tensor-core kernel (``python -m qpass.apps.bench.cuda_check``; the old ``qpass.backends.cuda.devcheck`` path is an alias).

1. exhaustive operand exactness: every E2M1 code x every E4M3 scale byte, bf16 and fp16 carriers,
   read back through the kernel with one-hot activations (``Y = B`` bit for bit);
2. accumulation bound (SPEC §3.1) against fp64 on random operands, every path (bias, x2, per-token);
3. same-run timings against BF16 cuBLAS, FP8 ``_scaled_mm``, tinygemm INT4 and qpass's Triton W4A16.

Writes ``devcheck.json`` / ``devcheck.md`` to ``--out`` (a directory).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

from qpass.backends.cuda import linear as cl
from qpass.backends.cuda import runtime


def _e4m3_values() -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def _e2m1_values() -> torch.Tensor:
    v = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    return torch.tensor(v + [-a for a in v])


def exhaustive(dtype: torch.dtype) -> dict:
    """Y = B for all 16 codes x 256 scale bytes (alpha = 1, fp32 out, one-hot x)."""
    dev = torch.device("cuda")
    n, k = 256, 32
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # block 0: 0..15, block 1: 0..15
    codes[16:] = codes[16:].flip(0)
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(n, 1).to(dev)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).unsqueeze(1).repeat(1, 2).to(dev)
    ref = _e2m1_values()[codes.long()].unsqueeze(0) * _e4m3_values().unsqueeze(1)  # [256, 32] exact in fp32
    bad = 0
    got_all = torch.empty(n, k)
    for blk in range(2):
        x = torch.zeros(16, k, dtype=dtype, device=dev)
        x[torch.arange(16), torch.arange(16) + 16 * blk] = 1.0
        y = cl.nvfp4_mma_linear(x, packed, scales, torch.ones(1, device=dev), out_dtype=torch.float32)
        got_all[:, 16 * blk:16 * blk + 16] = y.t().cpu()
    nan_ref, nan_got = torch.isnan(ref), torch.isnan(got_all)
    ok = (nan_ref == nan_got) & (nan_ref | (got_all == ref))
    bad = int((~ok).sum())
    first = None
    if bad:
        i = int((~ok).flatten().nonzero()[0])
        first = {"scale_byte": i // k, "k": i % k, "code": int(codes[i % k]), "got": float(got_all.flatten()[i]),
                 "ref": float(ref.flatten()[i])}
    return {"dtype": str(dtype), "elements": n * k, "mismatches": bad, "first_mismatch": first}


def budgeted(points, budget_s: float, rows: list, label):
    """The points that start before ``budget_s`` seconds have passed; each later one gets a
    ``{..., "skipped": "budget"}`` row (``label(point)`` gives its identifying keys)."""
    t_end = time.monotonic() + budget_s
    for pt in points:
        if time.monotonic() > t_end:
            rows.append({**label(pt), "skipped": "budget"})
            continue
        yield pt


def _random_weight(n: int, k: int, dev, gen):
    from qpass.quant.nvfp4 import nvfp4_quantize

    w = (torch.randn(n, k, device=dev, generator=gen) * 0.02)
    w[:, :16] *= 1e-4  # tiny blocks: subnormal E4M3 scales
    q = nvfp4_quantize(w.to(torch.bfloat16))
    codes = q.codes
    b = _e2m1_values().to(dev)[torch.stack([codes & 15, codes >> 4], -1).reshape(n, k).long()] \
        * q.scales.float().repeat_interleave(16, dim=1)
    return q, b


def bound_check(m: int, n: int, k: int, dtype, *, x2: bool = False, per_token: bool = False, bias: bool = False,
                gen=None) -> dict:
    """Max over elements of |acc - exact| / (gamma_K * sum|x||B|) (must be <= 1), and the production
    call (real alpha, bf16 out) against the fp64 result."""
    dev = torch.device("cuda")
    q, b = _random_weight(n, k, dev, gen)
    x = (torch.randn(m, k, device=dev, generator=gen) * 3).to(dtype)
    xr = (torch.randn(m, k, device=dev, generator=gen) * 0.1).to(dtype) if x2 else None
    one = torch.ones(1, device=dev)
    u = 2.0 ** -24
    gam = k * u / (1 - k * u)
    res = {"shape": [m, n, k], "dtype": str(dtype), "x2": x2, "per_token": per_token, "bias": bias}
    acc = cl.nvfp4_mma_linear(x, q.codes, q.scales, one, out_dtype=torch.float32).double()
    exact = x.double() @ b.double().t()
    mag = x.double().abs() @ b.double().abs().t()
    res["acc_err_over_bound"] = float(((acc - exact).abs() / (gam * mag).clamp_min(1e-300)).max())
    sdx = (torch.rand(m if per_token else 1, device=dev, generator=gen) + 0.5) * 1e-2
    sdx2 = (torch.rand(m if per_token else 1, device=dev, generator=gen) + 0.5) * 1e-3 if x2 else None
    bvec = torch.randn(n, device=dev, generator=gen).to(torch.bfloat16) if bias else None
    y = cl.nvfp4_mma_linear(x, q.codes, q.scales, q.s_dec, s_dec_x=sdx, per_token=per_token, x2=xr, s_dec_x2=sdx2,
                            bias=bvec, out_dtype=torch.bfloat16).double()
    alpha = (sdx.double() * q.s_dec.double()).reshape(-1, 1)
    yref = exact * alpha
    if x2:
        yref = yref + (xr.double() @ b.double().t()) * (sdx2.double() * q.s_dec.double()).reshape(-1, 1)
    if bias:
        yref = yref + bvec.double()
    rel = float((y - yref).norm() / yref.norm())
    res["y_rel_fro_err"] = rel
    res["ok"] = res["acc_err_over_bound"] <= 1.0 and rel < 1e-2
    return res


def _operand(q) -> torch.Tensor:
    """B = e2m1 * s_b (float32, exact) of an NVFP4Tensor [M, K]."""
    m, kh = q.codes.shape
    vals = _e2m1_values().to(q.codes.device)[torch.stack([q.codes & 15, q.codes >> 4], -1).reshape(m, 2 * kh).long()]
    return vals * q.scales.float().repeat_interleave(16, dim=1)


def act_check(m: int, k: int, dtype, *, per_token: bool, rac: float | None, gen, fused: bool | None = None,
              ties: bool = False) -> dict:
    """act_operands vs the reference quantizer / rac_reference: B_X, S_dec_X, mask, B_R, S_dec_R bit for bit."""
    from qpass.backends.cuda import act
    from qpass.quant.nvfp4 import nvfp4_act_spec, nvfp4_quantize
    from qpass.quant.rac import RACConfig, rac_num_channels, rac_reference

    dev = torch.device("cuda")
    scale = torch.exp(torch.randn(k, device=dev, generator=gen))
    x = (torch.randn(m, k, device=dev, generator=gen) * scale).to(dtype)
    x[:, :16] *= 1e-6  # tiny blocks (subnormal scales)
    if ties:  # few distinct values: many equal channel scores (the tie rule decides)
        x = (torch.randint(-3, 4, (m, k), device=dev, generator=gen) * 0.37).to(dtype)
    spec = nvfp4_act_spec(per_token)
    res = {"shape": [m, k], "dtype": str(dtype), "per_token": per_token, "rac": rac, "fused": fused}
    kk = rac_num_channels(k, rac) if rac else 0
    got = act.act_operands(x, per_token=per_token, rac_k=kk or None, check=True, fused=fused)
    qa = nvfp4_quantize(x, spec=spec)
    res["bx_equal"] = bool(torch.equal(got.bx.float(), _operand(qa)))
    res["s_dec_x_equal"] = bool(torch.equal(got.s_dec_x.view(torch.int32).reshape(-1), qa.s_dec.float().reshape(-1).view(torch.int32)))
    ok = res["bx_equal"] and res["s_dec_x_equal"]
    if rac:
        rr = rac_reference(x, RACConfig(rac, "masked", "batch"), spec)
        bits = torch.zeros(k, dtype=torch.bool, device=dev)
        w = got.mask.to(torch.int64) & 0xFFFFFFFF
        for j in range(32):
            idx = torch.arange(j, k, 32, device=dev)
            bits[idx] = ((w[: idx.numel()] >> j) & 1).bool()
        ref_bits = torch.zeros(k, dtype=torch.bool, device=dev)
        ref_bits[rr.channels] = True
        res["mask_equal"] = bool(torch.equal(bits, ref_bits))
        br_ref = _operand(rr.qr) * ref_bits.float()
        res["br_equal"] = bool(torch.equal(got.br.float(), br_ref))
        res["s_dec_r_equal"] = bool(torch.equal(got.s_dec_r.view(torch.int32).reshape(-1), rr.qr.s_dec.float().reshape(-1).view(torch.int32)))
        ok = ok and res["mask_equal"] and res["br_equal"] and res["s_dec_r_equal"]
    res["ok"] = ok
    return res


def qx_check(m: int, n: int, k: int, dtype, *, per_token: bool, bias: bool, gen) -> dict:
    """The one-launch W4A4 kernel (``act_quant``: the GEMM quantizes x itself) against act_operands +
    the same GEMM on B_X: Y and the amax bits bit for bit (same operands, same accumulation order; the
    multi-CTA act kernels hand per-CTA partial maxima, so per tensor their maximum is compared)."""
    from qpass.backends.cuda import act as ca

    dev = torch.device("cuda")
    scale = torch.exp(torch.randn(k, device=dev, generator=gen))
    x = (torch.randn(m, k, device=dev, generator=gen) * scale).to(dtype)
    x[:, :16] *= 1e-6
    q, _ = _random_weight(n, k, dev, gen)
    codes, scales, s_dec = q.codes, q.scales, q.s_dec
    b = (torch.randn(n, device=dev, generator=gen)).to(dtype) if bias else None
    amax = torch.empty(m if per_token else 1, dtype=torch.int32, device=dev)
    y1 = cl.nvfp4_mma_linear(x, codes, scales, s_dec, per_token=per_token, bias=b, act_quant=True, amax_out=amax)
    o = ca.act_operands(x, per_token=per_token)
    y2 = cl.nvfp4_mma_linear(o.bx, codes, scales, s_dec, s_dec_x=o.s_dec_x, per_token=per_token, bias=b, out_dtype=dtype)
    res = {"qx": [m, n, k], "dtype": str(dtype), "per_token": per_token, "bias": bias,
           "y_equal": bool(torch.equal(y1, y2)), "amax_equal": bool(torch.equal(amax, o.amax_bits.reshape(-1) if per_token else o.amax_bits.max().reshape(1)))}
    res["ok"] = res["y_equal"] and res["amax_equal"]
    return res


def timings(shapes, ms, budget_s: float) -> list[dict]:
    from qpass.apps.bench import peers
    from qpass.apps.bench.triton_bench import time_fn

    dev = torch.device("cuda")
    t_end = time.monotonic() + budget_s
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for (n, k) in shapes:
        for m in ms:
            if time.monotonic() > t_end:
                rows.append({"shape": [m, n, k], "skipped": "budget"})
                continue
            from qpass.quant.fp8 import fp8_quantize
            from qpass.quant.nvfp4 import nvfp4_quantize

            w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
            x = (torch.randn(m, k, device=dev, generator=gen)).to(torch.bfloat16)
            q = nvfp4_quantize(w)
            wbytes = n * k * 2
            row = {"shape": [m, n, k]}

            modes = row.setdefault("modes", {})

            def t(make, fn, nbytes, _key=[0]):
                us, mode = time_fn(make, fn, nbytes)
                _key[0] += 1
                modes[str(_key[0])] = mode
                return us

            row["bf16"] = t(lambda i: (x.clone(), w.clone()), torch.nn.functional.linear, wbytes)
            w8 = fp8_quantize(w, "per_tensor")
            x8 = fp8_quantize(x, "per_tensor")
            row["fp8_scaled_mm"] = t(lambda i: (x8.data.clone(), w8.data.clone(), x8.scale, w8.scale),
                                     lambda a, b_, sa, sb: torch._scaled_mm(a, b_.t(), scale_a=sa.reshape(1, 1).float(), scale_b=sb.reshape(1, 1).float(), out_dtype=torch.bfloat16, use_fast_accum=True),
                                     n * k)
            if k % 128 == 0:
                try:
                    fn, st = peers.tinygemm(peers.int4_g128_quantize(w))
                    row["tinygemm_int4"] = t(lambda i: (x.clone(), *[s.clone() for s in st]), fn, n * k // 2)
                except Exception as exc:  # noqa: BLE001
                    row["tinygemm_int4"] = f"error: {type(exc).__name__}: {exc}"[:200]
                if peers.gemlite_available():
                    try:
                        fn, st = peers.gemlite_a16w4(peers.int4_g128_quantize(w))
                        row["gemlite_a16w4"] = t(lambda i: (x.clone(), *st), fn, n * k // 2)
                    except Exception as exc:  # noqa: BLE001
                        row["gemlite_a16w4"] = f"error: {type(exc).__name__}: {exc}"[:200]
            try:
                from qpass.backends.triton.linear import w4a16_linear_triton

                row["triton_w4a16"] = t(lambda i: (x.clone(), q.codes.clone(), q.scales.clone(), q.s_dec),
                                        lambda a, c, s, d: w4a16_linear_triton(a, c, s, d), n * k // 2)
            except Exception as exc:  # noqa: BLE001
                row["triton_w4a16"] = f"error: {type(exc).__name__}: {exc}"[:200]
            cfg = cl.choose_config(m, n, k)
            row["mma_config"] = [cfg.nt, cfg.nw]
            row["mma_w4a16"] = t(lambda i: (x.clone(), q.codes.clone(), q.scales.clone(), q.s_dec),
                                 lambda a, c, s, d: cl.nvfp4_mma_linear(a, c, s, d), n * k // 2)
            for nw in ((2, 4, 8, 16) if m == 1 and n * k >= 2**24 else ()):
                if nw == cfg.nw or nw * 128 > k:
                    continue
                c2 = cl.MMAConfig(cfg.nt, nw)
                row[f"mma_w4a16_nw{nw}"] = t(lambda i: (x.clone(), q.codes.clone(), q.scales.clone(), q.s_dec),
                                             lambda a, c, s, d, c2=c2: cl.nvfp4_mma_linear(a, c, s, d, config=c2), n * k // 2)
            from qpass.backends.cuda import act as ca

            def w4a4(a, c, s_, d, rac_k=None):
                o = ca.act_operands(a, rac_k=rac_k)
                return cl.nvfp4_mma_linear(o.bx, c, s_, d, s_dec_x=o.s_dec_x, x2=o.br, s_dec_x2=o.s_dec_r)
            row["mma_w4a4"] = t(lambda i: (x.clone(), q.codes.clone(), q.scales.clone(), q.s_dec), w4a4, n * k // 2)
            row["mma_w4a4_rac50"] = t(lambda i: (x.clone(), q.codes.clone(), q.scales.clone(), q.s_dec),
                                      lambda a, c, s_, d: w4a4(a, c, s_, d, k // 2), n * k // 2)
            if cl.quantizes_in_kernel(m, k):
                row["mma_w4a4_qx"] = t(lambda i: (x.clone(), q.codes.clone(), q.scales.clone(), q.s_dec),
                                       lambda a, c, s_, d: cl.nvfp4_mma_linear(a, c, s_, d, act_quant=True), n * k // 2)
            row["act_quant_only"] = t(lambda i: (x.clone(),), lambda a: ca.act_operands(a), m * k * 2)
            row["act_quant_rac50_only"] = t(lambda i: (x.clone(),), lambda a: ca.act_operands(a, rac_k=k // 2), m * k * 2)
            try:
                from qpass.backends.triton.linear import w4a4_linear_triton
                from qpass.quant.nvfp4 import nvfp4_act_spec

                row["triton_w4a4"] = t(lambda i: (x.clone(), q.codes.clone(), q.scales.clone(), q.s_dec),
                                       lambda a, c, s_, d: w4a4_linear_triton(a, c, s_, d, act_spec=nvfp4_act_spec(False)), n * k // 2)
            except Exception as exc:  # noqa: BLE001
                row["triton_w4a4"] = f"error: {type(exc).__name__}: {exc}"[:200]
            xr = x.clone()
            row["mma_w4a16_plus_x2"] = t(lambda i: (x.clone(), xr.clone(), q.codes.clone(), q.scales.clone(), q.s_dec),
                                         lambda a, a2, c, s, d: cl.nvfp4_mma_linear(a, c, s, d, s_dec_x=d, x2=a2, s_dec_x2=d), n * k // 2)
            for key in list(row):
                if isinstance(row[key], float) and key != "bf16" and not key.startswith("act_"):
                    row[f"{key}_vs_bf16"] = row["bf16"] / row[key]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def prefill_timings(shapes, m: int, budget_s: float) -> list[dict]:
    from qpass.backends.cuda import act as ca
    from qpass.backends.cuda import prefill as cp
    from qpass.apps.bench.triton_bench import time_fn
    from qpass.quant.fp8 import fp8_quantize
    from qpass.quant.nvfp4 import nvfp4_quantize

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(2)
    rows = []
    for (n, k) in budgeted(shapes, budget_s, rows, lambda nk: {"shape": [m, *nk]}):
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        q = nvfp4_quantize(w)
        row = {"shape": [m, n, k]}
        modes = row.setdefault("modes", [])

        def t(make, fn, nb):
            us, mode = time_fn(make, fn, nb, rep_ms=30.0)
            modes.append(mode)
            return us
        row["bf16"] = t(lambda i: (x, w.clone()), torch.nn.functional.linear, n * k * 2)
        w8, x8 = fp8_quantize(w, "per_tensor"), fp8_quantize(x, "per_tensor")
        row["fp8_scaled_mm"] = t(lambda i: (x8.data, w8.data.clone(), x8.scale, w8.scale),
                                 lambda a, b_, sa, sb: torch._scaled_mm(a, b_.t(), scale_a=sa.reshape(1, 1).float(), scale_b=sb.reshape(1, 1).float(), out_dtype=torch.bfloat16, use_fast_accum=True), n * k)
        row["w4a16_cublas_cached"] = t(lambda i: (x, q.codes.clone(), q.scales.clone(), q.s_dec),
                                       lambda a, c, s_, d: cp.prefill_linear(a, c, s_, d), n * k // 2)

        def w4a4(a, c, s_, d, rac_k=None):
            o = ca.act_operands(a, rac_k=rac_k)
            return cp.prefill_linear(o.bx, c, s_, d, s_dec_x=o.s_dec_x, x2=o.br, s_dec_x2=o.s_dec_r)
        row["w4a4_cublas_cached"] = t(lambda i: (x, q.codes.clone(), q.scales.clone(), q.s_dec), w4a4, n * k // 2)
        row["w4a4_rac50_masked_dense"] = t(lambda i: (x, q.codes.clone(), q.scales.clone(), q.s_dec),
                                           lambda a, c, s_, d: w4a4(a, c, s_, d, k // 2), n * k // 2)
        row["act_quant"] = t(lambda i: (x,), lambda a: ca.act_operands(a), m * k * 2)
        row["act_quant_rac50"] = t(lambda i: (x,), lambda a: ca.act_operands(a, rac_k=k // 2), m * k * 2)
        try:
            from qpass.backends.triton.linear import w4a4_linear_triton
            from qpass.quant.nvfp4 import nvfp4_act_spec

            row["triton_w4a4"] = t(lambda i: (x, q.codes.clone(), q.scales.clone(), q.s_dec),
                                   lambda a, c, s_, d: w4a4_linear_triton(a, c, s_, d, act_spec=nvfp4_act_spec(False)), n * k // 2)
        except Exception as exc:  # noqa: BLE001
            row["triton_w4a4"] = f"error: {type(exc).__name__}: {exc}"[:200]
        row["bw_cache_bytes"] = cp.cache_bytes()
        for key in list(row):
            if isinstance(row[key], float) and key not in ("bf16",) and not key.startswith("act_"):
                row[f"{key}_vs_bf16"] = row["bf16"] / row[key]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def e2e(budget_s: float, models: str, batches: tuple[int, ...], quick: bool = False) -> list[dict]:
    """Decode step under CUDA graphs (qpass.backends.triton.bench_e2e) for every recipe, with the CUDA
    route on and off (Triton kernels) in the same run; ratios against the bf16 recipe of the same model and B."""
    from qpass.backends.cuda import route
    from qpass.apps.bench import e2e as be
    from qpass.ops import use_kernels

    route.install()
    dev = torch.device("cuda")
    t_end = time.monotonic() + budget_s
    rows = []
    specs = [m for m in be.E2E_MODELS if (models == "all" or models in m.label)]
    pipes: dict = {}
    plan = [(spec, b) for b in batches for spec in specs]
    recipes = (("bf16", False), ("quads_nvfp4", True), ("naive_nvfp4", True), ("w4a16_qat", True), ("fp8_block", False),
               ("quads_nvfp4", False), ("naive_nvfp4", False), ("w4a16_qat", False))
    if quick:
        recipes = (("bf16", False), ("quads_nvfp4", True), ("naive_nvfp4", True), ("quads_nvfp4", False))
    for spec, b in plan:
        if time.monotonic() > t_end - 40:
            rows.append({"model": spec.label, "B": b, "skipped": "budget"})
            continue
        if spec.label not in pipes:
            pipes[spec.label] = be.prepare_pipeline(be.build_model(spec, device=dev), batch_size=b, max_len=128, device=dev)
        pipe = be.with_step_batch(pipes[spec.label], b)
        base = None
        for recipe, on in recipes:
            if time.monotonic() > t_end:
                rows.append({"model": spec.label, "B": b, "recipe": recipe, "cuda_route": on, "skipped": "budget"})
                continue
            route.ENABLED["on"] = on
            h0 = route.hits()
            ro = None
            try:
                with use_kernels("triton"):
                    ro = be.rollout_engine(pipe, recipe, kernels="triton", smoke=False)
                    args = be.decode_inputs(ro, prompt_len=16, vocab_size=spec.config["vocab_size"], device=dev)
                    meas = be.measure_decode(ro, args, smoke=False)
                r = {"model": spec.label, "B": b, "recipe": recipe, "cuda_route": on, "step_us": meas.median_us,
                     "tokens_per_s": b / (meas.median_us * 1e-6), "graph": meas.status,
                     "replay_equals_eager": meas.equals_eager, "cuda_calls": route.hits() - h0}
            except Exception as exc:  # noqa: BLE001
                r = {"model": spec.label, "B": b, "recipe": recipe, "cuda_route": on,
                     "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            if recipe == "bf16" and "step_us" in r:
                base = r["step_us"]
            if base and "step_us" in r:
                r["vs_bf16"] = base / r["step_us"]
            rows.append(r)
            print(json.dumps(r), flush=True)
            del ro
    route.ENABLED["on"] = True
    return rows


def rollout_phase(budget_s: float, batch: int = 64, new_tokens: int = 64, prompt_len: int = 16) -> list[dict]:
    """The GRPO sample phase: ``TorchRollout.generate`` of ``batch`` prompts x ``new_tokens`` sampled
    tokens (temperature 1, the engine's decode step under CUDA graphs) on the SmolLM2-135M architecture
    with random weights, per recipe and route; wall clock of the second generate (the first captures)."""
    from qpass.backends.cuda import route
    from qpass.apps.bench import e2e as be
    from qpass.ops import use_kernels

    route.install()
    dev = torch.device("cuda")
    t_end = time.monotonic() + budget_s
    spec = be.SMOLLM2_135M
    pipe = be.prepare_pipeline(be.build_model(spec, device=dev), batch_size=batch, max_len=prompt_len + new_tokens + 8,
                               device=dev)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, spec.config["vocab_size"], (batch, prompt_len), generator=gen).tolist()
    rows, base = [], None
    for recipe, on in (("bf16", False), ("quads_nvfp4", True), ("fp8_block", False), ("naive_nvfp4", True),
                       ("w4a16_qat", True), ("quads_nvfp4", False)):
        if time.monotonic() > t_end:
            rows.append({"recipe": recipe, "cuda_route": on, "skipped": "budget"})
            continue
        route.ENABLED["on"] = on
        try:
            with use_kernels("triton"):
                ro = be.rollout_engine(pipe, recipe, kernels="triton", smoke=False)
                ro.generate(prompts, max_new_tokens=new_tokens, seed=0)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = ro.generate(prompts, max_new_tokens=new_tokens, seed=1)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            ntok = int(out.response_mask.sum())  # valid sampled tokens (EOS stops a row)
            r = {"recipe": recipe, "cuda_route": on, "generate_s": dt, "tokens": ntok, "tokens_per_s": ntok / dt,
                 "decode_graph": ro.decode.status}
            del ro
        except Exception as exc:  # noqa: BLE001
            r = {"recipe": recipe, "cuda_route": on, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        if recipe == "bf16" and "tokens_per_s" in r:
            base = r["tokens_per_s"]
        if base and "tokens_per_s" in r:
            r["vs_bf16"] = r["tokens_per_s"] / base
        rows.append(r)
        print(json.dumps(r), flush=True)
    route.ENABLED["on"] = True
    return rows


PHASES_RAC = ("amax", "B_X + scores", "select", "B_R")
PHASES_PLAIN = ("amax", "B_X")


def act_profile(points, reps: int = 25) -> list[dict]:
    """Phase clocks of the one-CTA ``act_fused`` kernel (act quant + RAC 50 %, and plain act quant):
    per phase the median over ``reps`` launches of the %globaltimer delta (ns) and of the clock64 delta
    (SM cycles) recorded by thread 0 after each phase's barrier."""
    from qpass.backends.cuda import act as ca

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(2)
    rows = []
    for (m, k) in points:
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        for rac in (True, False):
            names = PHASES_RAC if rac else PHASES_PLAIN
            prof = torch.zeros(12, dtype=torch.int64, device=dev)
            ns, cyc = [], []
            for _ in range(reps):
                ca.act_operands(x, rac_k=k // 2 if rac else None, fused=True, profile=prof)
                t = prof.view(6, 2).cpu()
                cyc.append((t[1:len(names) + 1, 0] - t[:len(names), 0]).tolist())
                ns.append((t[1:len(names) + 1, 1] - t[:len(names), 1]).tolist())
            med = lambda rows_, i: sorted(r[i] for r in rows_)[len(rows_) // 2]  # noqa: E731
            row = {"shape": [m, k], "rac50": rac, "keep_r": ca.fused_smem_bytes(m, k, rac=rac)[1],
                   "phase_ns": {n: med(ns, i) for i, n in enumerate(names)},
                   "phase_cycles": {n: med(cyc, i) for i, n in enumerate(names)}}
            row["total_ns"] = sum(row["phase_ns"].values())
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def select_variants(points, gen, variants=(0, 1, 2)) -> list[dict]:
    """Stage 1 of the radix select in each ``SEL_AGG`` variant (``act.SELECT_AGG``): the exactness checks
    of ``act_check`` (one-CTA and multi-CTA, random and tie-heavy, RAC 50 % and 25 %) and the one-CTA
    phase clocks of ``act_profile``; the default variant is restored afterwards."""
    from qpass.backends.cuda import act as ca

    default, rows = ca.SELECT_AGG, []
    try:
        for v in variants:
            ca.SELECT_AGG = v
            checks = [act_check(m, k, torch.bfloat16, per_token=False, rac=r, gen=gen, fused=f, ties=t)
                      for (m, k, f) in ((1, 4096, True), (1, 14336, True), (16, 576, True), (16, 4096, False))
                      for r in (0.5, 0.25) for t in (False, True)]
            prof = [p for p in act_profile(points, reps=15) if p["rac50"]]
            rows.append({"sel_agg": v, "checks_ok": sum(c["ok"] for c in checks), "checks": len(checks),
                         "select_ns": {f"{p['shape'][0]}x{p['shape'][1]}": p["phase_ns"]["select"] for p in prof},
                         "total_ns": {f"{p['shape'][0]}x{p['shape'][1]}": p["total_ns"] for p in prof}})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        ca.SELECT_AGG = default
    return rows


def _variants_ok(rep: dict) -> bool:
    """Every exactness check of every select variant passed (True when none ran)."""
    return all(v["checks_ok"] == v["checks"] for v in rep.get("select_variants", []))


def act_sweep(points, budget_s: float) -> list[dict]:
    """act quant with and without RAC 50 % on the one-CTA kernel and on the multi-CTA chain, graph-replayed
    (µs): the data behind ``act.py``'s size rule (which path takes a batch)."""
    from qpass.apps.bench.triton_bench import time_fn
    from qpass.backends.cuda import act as ca

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(3)
    rows = []
    for (m, k) in budgeted(points, budget_s, rows, lambda mk: {"shape": list(mk)}):
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        row = {"shape": [m, k]}
        row["default_fused"] = ca.one_cta(m, k)
        for fused in ((True, False) if m * k <= 262144 and m <= ca.FUSED_MAX_ROWS else (False,)):
            tag = "fused" if fused else "multi"
            row[f"plain_{tag}"] = time_fn(lambda i: (x.clone(),), lambda a, f=fused: ca.act_operands(a, fused=f), m * k * 2)[0]
            row[f"rac50_{tag}"] = time_fn(lambda i: (x.clone(),), lambda a, f=fused: ca.act_operands(a, rac_k=k // 2, fused=f),
                                          m * k * 2)[0]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--e2e-only", action="store_true")
    ap.add_argument("--prefill-s", type=float, default=60.0)
    ap.add_argument("--shapes", default="all", choices=("all", "8b"))
    ap.add_argument("--e2e-recipes", default="all", help="'all' or 'quick' (bf16, quads cuda/triton, naive cuda)")
    ap.add_argument("--with-e2e", type=float, default=0.0, help="seconds for the end-to-end section after the kernels")
    ap.add_argument("--with-rollout", type=float, default=0.0, help="seconds for the GRPO sample-phase section")
    ap.add_argument("--with-e2e-large", type=float, default=60.0, help="seconds for the end-to-end batches > 16 (run last)")
    ap.add_argument("--e2e-models", default="all")
    ap.add_argument("--e2e-batches", default="1,16,64")
    ap.add_argument("--act-sweep-s", type=float, default=45.0,
                    help="seconds for the activation-kernel sweep (one-CTA vs multi-CTA) and the phase profile; 0: skip")
    ap.add_argument("--only-act", action="store_true", help="the activation checks, sweep and profile only, then exit")
    return ap


def _e2e_only(args, out: Path) -> int:
    rows = e2e(args.budget_s, args.e2e_models, tuple(int(b) for b in args.e2e_batches.split(",")))
    (out / "e2e.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    for r in rows:
        print(r.get("model", "")[:12], r.get("B"), r.get("recipe"), r.get("cuda_route"),
              f"{r['step_us']:.0f}us {r.get('vs_bf16', 0):.2f}x calls={r.get('cuda_calls')}" if "step_us" in r else r.get("error", r.get("skipped")))
    return 0


def _env() -> dict:
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version()}
    try:
        import cuda.bindings
        import triton

        env["cuda_bindings"] = cuda.bindings.__version__
        env["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        env["import_error"] = repr(exc)
    tc = time.time()
    runtime.get_kernel("nvfp4_mma", "nvfp4_mma_gemm", dict(NT=1, NW=4), 0)
    env["first_compile_s"] = time.time() - tc
    return env


def _bound_checks(gen) -> list[dict]:
    checks = []
    for (m, n, k) in [(1, 4096, 4096), (16, 4096, 14336), (3, 576, 576), (7, 192, 576), (16, 1536, 576), (5, 576, 1536),
                      (1, 100, 4128), (32, 256, 1024)]:
        for dtype in (torch.bfloat16, torch.float16):
            checks.append(bound_check(m, n, k, dtype, gen=gen))
    checks.append(bound_check(8, 4096, 4096, torch.bfloat16, x2=True, bias=True, gen=gen))
    checks.append(bound_check(4, 1536, 576, torch.bfloat16, x2=True, per_token=True, gen=gen))
    checks.append(bound_check(16, 576, 1536, torch.float16, per_token=True, bias=True, gen=gen))
    return checks


def _act_checks(gen) -> list[dict]:
    acts = []
    for (m, k) in [(1, 4096), (16, 14336), (3, 576), (64, 1536), (1, 576)]:
        for dtype in (torch.bfloat16, torch.float16):
            for per_token in (False, True):
                for rac in (None, 0.5):
                    for fused in ((False, True) if m * k <= 65536 else (False,)):
                        acts.append(act_check(m, k, dtype, per_token=per_token, rac=rac, gen=gen, fused=fused))
    acts.append(act_check(8, 4096, torch.float32, per_token=False, rac=0.25, gen=gen))
    # the one-CTA kernel's shared-memory scores: batch sizes that split a warp's lanes unevenly or span
    # several warps, with the residual kept in shared memory or (64 x 1024: too large) recomputed
    for (m, k) in [(33, 576), (5, 1536), (64, 1024), (128, 128), (2, 16384)]:
        for per_token in (False, True):
            acts.append(act_check(m, k, torch.bfloat16, per_token=per_token, rac=0.5, gen=gen, fused=True))
    for fused in (False, True):
        acts.append(act_check(4, 1024, torch.bfloat16, per_token=False, rac=0.5, gen=gen, fused=fused, ties=True))
        acts.append(act_check(1, 576, torch.bfloat16, per_token=True, rac=0.3, gen=gen, fused=fused, ties=True))
    for (m, n, k) in [(1, 4096, 4096), (1, 4096, 14336), (3, 576, 576), (8, 1536, 576), (16, 576, 1536), (2, 100, 4128)]:
        for dtype in (torch.bfloat16, torch.float16):
            for per_token in (False, True):
                acts.append(qx_check(m, n, k, dtype, per_token=per_token, bias=m == 3, gen=gen))
    return acts


def _timing_lines(rep: dict) -> list[str]:
    lines = ["| M x N x K | bf16 us | mma us (cfg) | mma vs bf16 | tinygemm vs bf16 | fp8 vs bf16 | triton w4a16 vs bf16 | +x2 vs bf16 | w4a4 | w4a4+rac | triton w4a4 | actq us | actq+rac us | other nw |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["timings"]:
        if "skipped" in r:
            continue
        f = lambda key: f"{r[key]:.2f}" if isinstance(r.get(key), float) else "-"  # noqa: E731
        others = " ".join(f"{kk[9:-8]}:{r[kk]:.2f}" for kk in r if kk.startswith("mma_w4a16_nw") and kk.endswith("_vs_bf16"))
        lines.append(f"| {r['shape']} | {r['bf16']:.1f} | {r['mma_w4a16']:.1f} {r['mma_config']} | {f('mma_w4a16_vs_bf16')} | "
                     f"{f('tinygemm_int4_vs_bf16')} | {f('fp8_scaled_mm_vs_bf16')} | {f('triton_w4a16_vs_bf16')} | "
                     f"{f('mma_w4a16_plus_x2_vs_bf16')} | {f('mma_w4a4_vs_bf16')} | {f('mma_w4a4_rac50_vs_bf16')} | {f('triton_w4a4_vs_bf16')} | "
                     f"{f('act_quant_only')} | {f('act_quant_rac50_only')} | {others} |")
    return lines


def _print_runs(rep: dict) -> None:
    for r in rep.get("rollout_phase", []):
        print("rollout", r.get("recipe"), "cuda" if r.get("cuda_route") else "triton",
              f"{r['tokens_per_s']:.0f} tok/s {r.get('vs_bf16', 0):.2f}x {r.get('decode_graph')}" if "tokens_per_s" in r
              else r.get("error", r.get("skipped")))
    for r in rep.get("e2e", []):
        print(r.get("model", "")[:12], "B", r.get("B"), r.get("recipe"), "cuda" if r.get("cuda_route") else "triton",
              f"{r['step_us']:.0f}us {r.get('vs_bf16', 0):.2f}x calls={r.get('cuda_calls')} {r.get('graph')} eq={r.get('replay_equals_eager')}"
              if "step_us" in r else r.get("error", r.get("skipped")))


def _timed_sections(args, rep: dict, save) -> None:
    shapes = [(4096, 4096), (14336, 4096), (4096, 14336)]
    if args.shapes == "all":
        shapes += [(576, 576), (192, 576), (1536, 576), (576, 1536)]
    rep["timings"] = timings(shapes, [1, 16], args.budget_s)
    save()
    batches = tuple(int(b) for b in args.e2e_batches.split(","))
    if args.with_e2e:
        rep["e2e"] = e2e(args.with_e2e, args.e2e_models, tuple(b for b in batches if b <= 16), quick=args.e2e_recipes == "quick")
        save()
    if args.with_rollout:
        rep["rollout_phase"] = rollout_phase(args.with_rollout)
        save()
    rep["prefill"] = prefill_timings([(4096, 4096), (14336, 4096), (4096, 14336)], 4096, args.prefill_s)
    save()
    if args.with_e2e and any(b > 16 for b in batches):
        rep["e2e"] += e2e(args.with_e2e_large, args.e2e_models, tuple(b for b in batches if b > 16))
        save()


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.e2e_only:
        return _e2e_only(args, out)
    t0 = time.time()
    rep: dict = {"env": _env()}
    rep["exhaustive"] = [exhaustive(torch.bfloat16), exhaustive(torch.float16)]
    print(json.dumps(rep["exhaustive"]), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    checks = _bound_checks(gen)
    acts = _act_checks(gen)
    rep["act_checks"] = acts
    for c in acts:
        print(json.dumps(c), flush=True)
    if args.act_sweep_s:
        pts = [(m, k) for m in (1, 4, 16, 64) for k in (576, 1536, 4096, 14336)]
        rep["act_profile"] = act_profile([(1, 576), (1, 4096), (1, 14336), (16, 576), (16, 1536), (4, 4096)])
        rep["select_variants"] = select_variants([(1, 576), (1, 4096), (1, 14336), (16, 576), (4, 4096)], gen)
        rep["act_sweep"] = act_sweep(pts, args.act_sweep_s)
    if args.only_act:
        rep["ok"] = all(c["ok"] for c in acts) and _variants_ok(rep)
        (out / "devcheck.json").write_text(json.dumps(rep, indent=1))
        print("OK" if rep["ok"] else "FAILED", f"{time.time() - t0:.0f}s")
        return 0 if rep["ok"] else 1
    rep["bound_checks"] = checks
    for c in checks:
        print(json.dumps(c), flush=True)

    def save():  # after every section: a timed-out call still brings back what was measured
        (out / "devcheck.json").write_text(json.dumps(rep, indent=1))
    save()
    _timed_sections(args, rep, save)
    rep["ok"] = all(e["mismatches"] == 0 for e in rep["exhaustive"]) and all(c["ok"] for c in checks) \
        and all(c["ok"] for c in acts) and _variants_ok(rep)
    rep["wall_s"] = time.time() - t0
    (out / "devcheck.json").write_text(json.dumps(rep, indent=1))
    lines = _timing_lines(rep)
    (out / "devcheck.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _print_runs(rep)
    print("OK" if rep["ok"] else "FAILED", f"{rep['wall_s']:.0f}s")
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
