import sys, torch
sys.path.insert(0, ".")
from qpass.graph.model import LoadedModel
from qpass.pipeline import Pipeline
from qpass.recipe import builtin_recipes, load_recipe
from qpass.runtime.engine import make_rollout_engine
from tests.conftest import tiny_llama
pipe = Pipeline.prepare(loaded=LoadedModel(model=tiny_llama().cuda(), tokenizer=None, name="tiny-llama", source="random"), device="cuda", batch_size=4, max_len=32)
prompts = [[3, 11, 12, 2, 13], [3, 14], [3, 15, 16], [3, 17, 18, 19]]
for kern in ("reference", "triton"):
  for name in sorted(n for n in builtin_recipes() if not n.endswith("_moe")):
    try:
        rollout = pipe.build_side(load_recipe(name), "rollout", **({"kernels": kern} if kern != "reference" else {}))
        eager = make_rollout_engine("qpass", qg=rollout, pad_token_id=0, eos_token_id=[1], cuda_graphs="off")
        a = eager.generate(prompts, max_new_tokens=12, seed=5)
        g = make_rollout_engine("qpass", qg=rollout, pad_token_id=0, eos_token_id=[1], cuda_graphs="on")
        b = g.generate(prompts, max_new_tokens=12, seed=5)
        print(kern, name, g.decode.status, g.decode.replays, torch.equal(a.input_ids, b.input_ids) and torch.equal(a.logq, b.logq), flush=True)
    except Exception as e:
        import traceback
        tb = traceback.extract_tb(e.__cause__.__traceback__ if e.__cause__ else e.__traceback__)
        print(kern, name, "FAIL", type(e).__name__, str(e).splitlines()[0][:150], [f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}" for f in tb[-6:]], flush=True)
