"""Step-0 reward of a rollout recipe per task difficulty (issue 13: calibrate the task so the W4A4
rollout's step-0 reward is >= 0.15 on the default model).

For each task (difficulty preset or ``qpass.rl.task.TASK_PRESETS`` name) and each template: the
first ``--prompts`` training problems of the GRPO run (the same ``train_batches`` stream ``qpass
grpo`` draws step 1 from), ``--group-size`` samples each at ``--temperature`` (default 1) from the
recipe's rollout engine, scored with both exact-answer rewards: ``reward_mean`` the default
(last integer, ``qpass grpo --reward exact``) and ``reward_first_mean`` (first integer, ``--reward
first``), averaged over all samples. Writes one JSON document (per task[|template]: mean rewards,
their binomial standard errors, correct count, finished fraction, seconds, 8 example responses)
to ``--out``. ``reward_answer_mean`` scores the integer after the first ``Answer:`` (``--reward
answer``, the worked-step ``chain`` tasks); ``response_tokens_mean`` / ``_max`` the sampled lengths.

    python scripts/calibrate_task.py --recipe naive_nvfp4 --tasks 1,2:+,2 --prompts 8 --group-size 4 \
        --out docs/results/grpo_long/calibration_naive_nvfp4.json
    python scripts/calibrate_task.py --recipe naive_nvfp4 --tasks larger --template larger_fewshot \
        --temperature 0.7 --n-train 500 --n-eval 500 --prompts 32 --group-size 4 --max-new-tokens 16 --out F.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="naive_nvfp4")
    ap.add_argument("--model", default="default")
    ap.add_argument("--tasks", default="1,2", help="comma list of LEVEL or LEVEL:OPS (e.g. 2:+ = level 2 with + only) "
                    "or a qpass.rl.task.TASK_PRESETS name (successor, larger)")
    for flag, default in (("--prompts", 8), ("--group-size", 4), ("--max-new-tokens", 48), ("--seed", 0)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--template", default="auto", help="a key of qpass.rl.task.TEMPLATES, or a comma list of keys "
                    "('auto': the task kind's own, qpass.rl.task.KINDS)")
    ap.add_argument("--temperature", type=float, default=1.0)
    for flag, default in (("--n-train", 2000), ("--n-eval", 500), ("--threads", 1)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from qpass.apps.grpo.grpo import _seed
    from qpass.jsonio import write_json
    from qpass.graph.model import load_model
    from qpass.pipeline import Pipeline
    from qpass.prompts import encode_chat
    from qpass.recipe import load_recipe
    from qpass.rl.experience import assemble, decode_responses
    from qpass.rl.task import TEMPLATES, ArithmeticTask, KINDS, answer_tag_reward, difficulty_preset, exact_answer_reward, first_answer_reward, format_prompt, task_preset
    from qpass.runtime.engine import make_rollout_engine

    lm = load_model(a.model)
    tok = lm.tokenizer
    eos = tok.eos_token_id if isinstance(tok.eos_token_id, list) else [tok.eos_token_id]
    rows = a.prompts * a.group_size
    results = {}
    pipe = None
    for spec, tname in [(s, t) for s in a.tasks.split(",") for t in a.template.split(",")]:
        level_s, _, ops = spec.partition(":")
        over = {"operators": tuple(ops)} if ops else {}
        if level_s.isdigit():
            cfg = difficulty_preset(int(level_s), n_train=a.n_train, n_eval=a.n_eval, seed=a.seed, **over)
        else:
            cfg = task_preset(level_s, n_train=a.n_train, n_eval=a.n_eval, seed=a.seed, **over)
        task = ArithmeticTask(cfg)
        if tname == "auto":
            tname = KINDS[cfg.kind].template
        probs = next(task.train_batches(a.prompts, seed=_seed(a.seed, 1) % (2**31)))
        prompts = encode_chat(tok, [format_prompt(p, TEMPLATES[tname]) for p in probs])
        max_len = int(math.ceil((max(len(p) for p in prompts) + a.max_new_tokens) / 16) * 16) + 16
        if pipe is None or pipe.base_step.captured.max_len < max_len:
            pipe = Pipeline.prepare(a.model, batch_size=rows, max_len=max_len, loaded=lm)
            _, rollout = pipe.build(load_recipe(a.recipe))
            ro = make_rollout_engine("qpass", qg=rollout, pad_token_id=int(tok.pad_token_id), eos_token_id=eos)
        t0 = time.perf_counter()
        batch = ro.generate([p for p in prompts for _ in range(a.group_size)], max_new_tokens=a.max_new_tokens,
                            temperature=a.temperature, top_p=1.0, seed=_seed(a.seed, 1, 0))
        exp = assemble([batch], pad_token_id=ro.pad_token_id, eos_token_ids=ro.eos_token_ids, max_new_tokens=a.max_new_tokens)
        texts = decode_responses(tok, exp)
        metas = [p.meta for p in probs for _ in range(a.group_size)]
        rewards = [exact_answer_reward(m, x) for m, x in zip(metas, texts)]
        first = [first_answer_reward(m, x) for m, x in zip(metas, texts)]
        tagged = [answer_tag_reward(m, x) for m, x in zip(metas, texts)]
        mt = sum(tagged) / len(tagged)
        lens = exp.sampled_mask.sum(-1).float()
        m = sum(rewards) / len(rewards)
        mf = sum(first) / len(first)
        key = spec if "," not in a.template else f"{spec}|{tname}"
        results[key] = {
            "task": {k: v for k, v in vars(task.cfg).items()}, "template": tname, "reward_mean": m,
            "reward_first_mean": mf, "reward_first_stderr": math.sqrt(mf * (1 - mf) / len(first)),
            "reward_answer_mean": mt, "reward_answer_stderr": math.sqrt(mt * (1 - mt) / len(tagged)),
            "response_tokens_mean": float(lens.mean()), "response_tokens_max": int(lens.max()),
            "reward_stderr": math.sqrt(m * (1 - m) / len(rewards)), "n_samples": len(rewards), "n_correct": sum(rewards),
            "finished_frac": float(exp.finished.float().mean()), "seconds": time.perf_counter() - t0,
            "examples": [{"expression": p.meta.get("expression"), "answer": p.meta.get("answer"), "response": x}
                         for p, x in zip([p for p in probs for _ in range(a.group_size)][:8], texts[:8])],
        }
        print(key, results[key]["reward_mean"], results[key]["reward_first_mean"], results[key]["reward_answer_mean"],
              f"{results[key]['response_tokens_mean']:.1f} tokens", f"{results[key]['seconds']:.0f}s", flush=True)
        write_json(a.out, {"argv": sys.argv[1:], "recipe": a.recipe, "model": lm.name, "prompts": a.prompts, "group_size": a.group_size,
                           "max_new_tokens": a.max_new_tokens, "template": {t: TEMPLATES[t] for t in a.template.split(",") if t in TEMPLATES}, "temperature": a.temperature,
                           "seed": a.seed, "results": results})  # after every task: a later failure keeps the earlier ones


if __name__ == "__main__":
    main()
