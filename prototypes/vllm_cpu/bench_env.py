"""Step 7: start-up time / memory / throughput of the qpass_nvfp4 engine under env settings.
Run one config per fresh process:  ENV=... python bench_env.py LABEL [dtype]"""
import json, os, sys, time


def main():
    label = sys.argv[1]; dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
    t0 = time.time()
    import psutil
    from vllm import LLM, SamplingParams
    t_imp = time.time() - t0
    llm = LLM(model=os.path.join(os.path.dirname(os.path.abspath(__file__)), "models/smollm2_qpass_nvfp4"),
              dtype=dtype, enforce_eager=True, max_model_len=512,
              kv_cache_memory_bytes=int(float(os.environ.get("KV_GIB", "0.25")) * 2**30),
              worker_extension_cls="qpass_vllm_plugin.worker_ext.QpassWorkerExtension")
    t_start = time.time() - t0
    me = psutil.Process()
    procs = [me] + me.children(recursive=True)
    rss = sum(p.memory_info().rss for p in procs) / 2**20
    for p in procs:
        p.cpu_percent(None)
    time.sleep(3)
    idle_cpu = sum(p.cpu_percent(None) for p in procs)
    sp = SamplingParams(temperature=1.0, max_tokens=32, seed=0, ignore_eos=True)
    llm.generate(["warm up"], SamplingParams(max_tokens=2), use_tqdm=False)
    t = time.time()
    outs = llm.generate(["Hello, my name is"] * 16, sp, use_tqdm=False)
    dt = time.time() - t
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    t = time.time(); llm.generate(["Hello"], SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False); dt1 = time.time() - t
    rss2 = sum(p.memory_info().rss for p in procs) / 2**20
    res = {"label": label, "dtype": dtype, "import_s": round(t_imp, 1), "start_s_incl_import": round(t_start, 1),
           "procs": len(procs), "rss_tree_mb_after_start": round(rss), "rss_tree_mb_after_gen": round(rss2),
           "idle_cpu_pct_tree": round(idle_cpu), "tok_per_s_16x32": round(ntok / dt, 1),
           "single_seq_32tok_s": round(dt1, 2), "load_avg": os.getloadavg()[0],
           "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_"))}}
    print("BENCH", json.dumps(res), flush=True)
    t = time.time(); llm.llm_engine.engine_core.shutdown(); print("shutdown_s", round(time.time() - t, 1))


if __name__ == "__main__":
    main()
