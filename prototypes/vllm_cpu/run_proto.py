"""End-to-end prototype (steps 2-6): qpass NVFP4 W4A16 checkpoint served by vLLM-CPU.

  python run_proto.py [--inproc] [--skip-baseline] [--skip-bf16] [--kv-gib 1]

Prints a JSON summary at the end (also written to out/summary*.json).
"""
from __future__ import annotations

import argparse, gc, hashlib, json, math, os, shutil, sys, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "models")
FP32_DIR = os.path.join(MODELS, "smollm2_fp32")
BF16_DIR = os.path.join(MODELS, "smollm2_bf16")
Q_DIR = os.path.join(MODELS, "smollm2_qpass_nvfp4")
EXT = "qpass_vllm_plugin.worker_ext.QpassWorkerExtension"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Photosynthesis is the process",
           "Once upon a time, a small robot", "The three laws of motion are",
           "To make a cup of tea, first", "In 1969, the first humans", "A prime number is"]


def rss_tree_mb() -> float:
    import psutil
    p = psutil.Process()
    tot = p.memory_info().rss
    for c in p.children(recursive=True):
        try:
            tot += c.memory_info().rss
        except psutil.Error:
            pass
    return tot / 2**20


def nprocs() -> int:
    import psutil
    return 1 + len(psutil.Process().children(recursive=True))


def make_llm(model, dtype, args):
    from vllm import LLM
    t = time.time()
    llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=512,
              kv_cache_memory_bytes=int(args.kv_gib * 2**30), worker_extension_cls=EXT,
              seed=0)
    return llm, time.time() - t


def shutdown(llm):
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa
        print("shutdown:", e)
    del llm
    gc.collect()


def gen(llm, n_tokens=32, temperature=1.0, seed=0, prompts=PROMPTS):
    from vllm import SamplingParams
    sp = SamplingParams(temperature=temperature, max_tokens=n_tokens, logprobs=0, seed=seed,
                        ignore_eos=True)
    t = time.time()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.time() - t
    res = []
    for o in outs:
        c = o.outputs[0]
        # logprobs=0 -> each step's dict holds exactly the sampled token
        lps = [lp[tid].logprob for tid, lp in zip(c.token_ids, c.logprobs)]
        res.append({"prompt_ids": list(o.prompt_token_ids), "ids": list(c.token_ids),
                    "lps": lps, "text": c.text})
    ntok = sum(len(r["ids"]) for r in res)
    return res, dt, ntok / dt


def score_vllm(llm, seqs):
    """Teacher-forced log p(tok_t | tok_<t) for t>=1 via prompt_logprobs=0 on a TokensPrompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    sp = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=1.0)
    t = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], sp, use_tqdm=False)
    dt = time.time() - t
    res = []
    for s, o in zip(seqs, outs):
        pl = o.prompt_logprobs  # [None, {tok: Logprob, ...}, ...]; the given token is always in it
        res.append([pl[i][s[i]].logprob for i in range(1, len(s))])
    return res, dt


def hf_model(src_dir, qckpt=None):
    """transformers fp32 reference; with qckpt, linears get the SPEC §3 dequant (bf16 -> fp32)."""
    import torch
    from transformers import AutoModelForCausalLM
    from safetensors.torch import load_file
    from nvfp4_ckpt import dequant_nvfp4
    m = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32).eval()
    if qckpt is not None:
        sd = load_file(os.path.join(qckpt, "model.safetensors"))
        with torch.no_grad():
            for name, mod in m.named_modules():
                if name + ".weight_scale" in sd:
                    w = dequant_nvfp4(sd[name + ".weight"], sd[name + ".weight_scale"],
                                      sd[name + ".weight_scale_2"])
                    mod.weight.copy_(w.to(torch.float32))
            # non-linear tensors (embeddings, norms) straight from the checkpoint
            for k, v in sd.items():
                if k.endswith(("norm.weight", "embed_tokens.weight")):
                    m.get_parameter(k).copy_(v.to(torch.float32))
    return m


def score_hf(m, seqs):
    import torch
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            lp = torch.log_softmax(m(ids).logits[0].float(), -1)
            out.append(lp[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist())
    return out


def cmp(a, b, b_from=None):
    """|a - b| over aligned lists; b_from[i] = offset into b[i] where a[i] starts."""
    d = []
    for x, y, k in zip(a, b, b_from or [0] * len(a)):
        y = y[k:]
        assert len(x) == len(y), (len(x), len(y))
        d += [abs(p - q) for p, q in zip(x, y)]
    return {"n": len(d), "mean_abs": sum(d) / len(d), "max_abs": max(d)}


def ckpt_expected(qdir):
    """Checkpoint bytes grouped the way vLLM fuses them (qkv_proj, gate_up_proj)."""
    import torch
    from safetensors.torch import load_file
    sd = load_file(os.path.join(qdir, "model.safetensors"))
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
             "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
    exp = {}
    for k in sd:
        if not k.endswith(".q_proj.weight") and not k.endswith(".o_proj.weight") \
                and not k.endswith(".gate_proj.weight") and not k.endswith(".down_proj.weight"):
            continue
        base = k.rsplit(".", 2)[0]  # model.layers.i.self_attn / mlp
        for fname, parts in fused.items():
            if not k.endswith(f".{parts[0]}.weight"):
                continue
            rec = {}
            for p in ("weight", "weight_scale", "weight_scale_2", "weight_global_scale"):
                ts = [sd.get(f"{base}.{s}.{p}") for s in parts]
                if ts[0] is None:
                    continue
                t = torch.cat(ts, 0) if ts[0].dim() else torch.stack(ts)
                b = t.contiguous().view(torch.uint8).numpy().tobytes()
                rec[p] = hashlib.sha256(b).hexdigest()
            exp[f"{base}.{fname}"] = rec
    return exp


def compare_readback(rb, exp):
    bad, n = [], 0
    for name, rec in exp.items():
        got = rb.get(name)
        if got is None:
            bad.append((name, "missing"))
            continue
        for p, h in rec.items():
            n += 1
            if got.get(p, {}).get("sha256") != h:
                bad.append((name, p))
    return {"layers": len(exp), "tensors_compared": n, "mismatches": bad[:10], "n_bad": len(bad),
            "extra_in_engine": sorted(set(rb) - set(exp))[:5]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inproc", action="store_true", help="VLLM_ENABLE_V1_MULTIPROCESSING=0")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--skip-bf16", action="store_true")
    ap.add_argument("--kv-gib", type=float, default=0.25)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.inproc:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    S = {"args": vars(args), "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_"))}}
    T0 = time.time()
    sys.path.insert(0, HERE)
    import torch
    torch.manual_seed(0)
    from nvfp4_ckpt import write_checkpoint, modify_checkpoint

    # ---- step 2/3 artifacts
    t = time.time()
    if not os.path.exists(os.path.join(FP32_DIR, "model.safetensors")):
        import make_hf
        make_hf.make(MODELS)
    if not os.path.exists(os.path.join(Q_DIR, "model.safetensors")):
        S["ckpt"] = write_checkpoint(BF16_DIR, Q_DIR)
    S["artifacts_s"] = round(time.time() - t, 1)

    t = time.time()
    import vllm  # noqa
    S["vllm_import_s"] = round(time.time() - t, 1)
    S["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}

    # ---- step 2: unquantized fp32 baseline
    if not args.skip_baseline:
        llm, st = make_llm(FP32_DIR, "float32", args)
        g, gdt, tps = gen(llm)
        seqs = [r["prompt_ids"] + r["ids"] for r in g]
        sv, sdt = score_vllm(llm, seqs)
        hf = hf_model(FP32_DIR)
        sh = score_hf(hf, seqs)
        plen = [len(r["prompt_ids"]) - 1 for r in g]
        S["baseline_fp32"] = {"start_s": round(st, 1), "gen_s": round(gdt, 2), "tok_per_s": round(tps, 1),
                              "procs": nprocs(), "rss_tree_mb": round(rss_tree_mb()),
                              "sample": g[0]["text"][:80],
                              "sampled_vs_promptlp": cmp([r["lps"] for r in g], sv, plen),
                              "vllm_vs_hf_fp32": cmp(sv, sh), "score_s": round(sdt, 2)}
        del hf
        shutdown(llm)
        print("BASELINE", json.dumps(S["baseline_fp32"]), flush=True)

    # ---- step 3/4: quantized fp32
    llm, st = make_llm(Q_DIR, "float32", args)
    R = {"start_s": round(st, 1), "procs": nprocs(), "rss_tree_mb_after_load": round(rss_tree_mb())}
    g0, gdt, tps = gen(llm, temperature=0.0)
    R["greedy"] = {p: r["text"][:90] for p, r in zip(PROMPTS[:3], g0)}
    g, gdt, tps = gen(llm)
    R.update(gen_s=round(gdt, 2), tok_per_s=round(tps, 1), sample=g[0]["text"][:80])
    t = time.time()
    rb = llm.collective_rpc("qpass_readback")[0]
    R["readback_s"] = round(time.time() - t, 2)
    R["readback_vs_ckpt"] = compare_readback(rb, ckpt_expected(Q_DIR))
    l0 = rb["model.layers.0.self_attn.qkv_proj"]
    R["qkv_layout"] = {k: (v["shape"], v["dtype"]) if isinstance(v, dict) else v for k, v in l0.items()}
    rbb = llm.collective_rpc("qpass_readback", kwargs={"with_bytes": True,
                                                       "only": ["model.layers.0.self_attn.qkv_proj"]})[0]
    import numpy as np
    R["qkv_weight_scale_2_values"] = np.frombuffer(rbb["model.layers.0.self_attn.qkv_proj"]["weight_scale_2"]["bytes"], np.float32).tolist()
    # ---- step 6: teacher-forced scores vs transformers fp32 (same dequantized weights)
    seqs = [r["prompt_ids"] + r["ids"] for r in g]
    plen = [len(r["prompt_ids"]) - 1 for r in g]
    sv, sdt = score_vllm(llm, seqs)
    hfq = hf_model(BF16_DIR, Q_DIR)
    sh = score_hf(hfq, seqs)
    R.update(score_s=round(sdt, 2), sampled_vs_promptlp=cmp([r["lps"] for r in g], sv, plen),
             vllm_vs_hf_fp32=cmp(sv, sh), rss_tree_mb=round(rss_tree_mb()))
    S["quant_fp32"] = R
    print("QUANT_FP32", json.dumps({k: v for k, v in R.items() if k != "qkv_layout"}), flush=True)

    # ---- step 5: live weight update from /dev/shm
    U = {}
    d = tempfile.mkdtemp(prefix="qpass_reload_", dir="/dev/shm")
    t = time.time()
    U["modified"] = modify_checkpoint(Q_DIR, d)
    U["write_s"] = round(time.time() - t, 1)
    U["files"] = os.listdir(d)
    t = time.time()
    U["worker_reload_s"] = round(llm.collective_rpc("qpass_reload", kwargs={"weights_path": d})[0], 3)
    llm.reset_prefix_cache()
    U["reload_total_s"] = round(time.time() - t, 3)
    rb2 = llm.collective_rpc("qpass_readback")[0]
    U["readback_vs_new_ckpt"] = compare_readback(rb2, ckpt_expected(d))
    U["bytes_changed_layers"] = sum(rb2[k]["weight"]["sha256"] != rb[k]["weight"]["sha256"] for k in rb)
    U["decode_cache_changed_layers"] = sum(rb2[k]["qpass_w_dec"]["sha256"] != rb[k]["qpass_w_dec"]["sha256"] for k in rb)
    g1, _, _ = gen(llm, temperature=0.0)
    U["greedy_after"] = {p: r["text"][:90] for p, r in zip(PROMPTS[:3], g1)}
    U["greedy_changed"] = sum(a["ids"] != b["ids"] for a, b in zip(g0, g1))
    sv2, _ = score_vllm(llm, seqs)   # same token sequences, new weights
    hf2 = hf_model(BF16_DIR, d)
    U["vllm_vs_hf_fp32_new_weights"] = cmp(sv2, score_hf(hf2, seqs))
    U["old_vs_new_scores"] = cmp(sv, sv2)
    # revert: reload the original checkpoint, bytes must equal the first read-back
    t = time.time()
    llm.collective_rpc("qpass_reload", kwargs={"weights_path": Q_DIR})
    llm.reset_prefix_cache()
    U["revert_s"] = round(time.time() - t, 3)
    rb3 = llm.collective_rpc("qpass_readback")[0]
    U["revert_equal"] = all(rb3[k][p]["sha256"] == rb[k][p]["sha256"] for k in rb for p in rb[k] if isinstance(rb[k][p], dict))
    sv3, _ = score_vllm(llm, seqs)
    U["revert_scores_identical"] = sv3 == sv
    shutil.rmtree(d)
    S["live_update"] = U
    print("LIVE_UPDATE", json.dumps({k: v for k, v in U.items()}), flush=True)
    del hf2
    shutdown(llm)

    # ---- quantized bf16 engine
    if not args.skip_bf16:
        llm, st = make_llm(Q_DIR, "bfloat16", args)
        gb, gdt, tps = gen(llm, temperature=0.0)
        svb, sdt = score_vllm(llm, seqs)
        S["quant_bf16"] = {"start_s": round(st, 1), "gen_s": round(gdt, 2), "tok_per_s": round(tps, 1),
                           "greedy": {p: r["text"][:90] for p, r in zip(PROMPTS[:3], gb)},
                           "vllm_bf16_vs_hf_fp32": cmp(svb, sh), "rss_tree_mb": round(rss_tree_mb())}
        shutdown(llm)
        print("QUANT_BF16", json.dumps(S["quant_bf16"]), flush=True)

    S["total_s"] = round(time.time() - T0, 1)
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", f"summary{args.tag}.json"), "w") as f:
        json.dump(S, f, indent=1, default=str)
    print("SUMMARY", json.dumps(S, default=str, indent=1))


if __name__ == "__main__":
    main()
