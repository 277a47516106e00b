"""Measurements behind docs/RESULTS.md "Export a checkpoint" (each prints JSON; see the section for commands).

    listing  OURS_DIR MODELOPT_LISTING.json   names/dtypes/shapes/config of a qpass --format modelopt export vs a
                                              real ModelOpt export's listing (scripts/modelopt_reference.py), and
                                              how many tensors are bit-identical, by kind
    bytes    HF_DIR MODELOPT_LISTING.json     re-quantize HF_DIR's weights with qpass's NVFP4 weight arithmetics
                                              (fused groups share the amax) and count sites whose codes / block
                                              scales / weight_scale_2 differ from the ModelOpt export
    ct       QPASS_DIR CT_DIR                 decode the compressed-tensors export as compressed-tensors does
                                              (bf16(code * fl(s_b / weight_global_scale)), checked against the real
                                              transformers load in tests/test_export.py) vs qpass.nvfp4_dequantize

Provenance (lab file; scripts/README.md): produced
`docs/results/export/default_modelopt_vs_qpass_te_reference.json` (listing),
`docs/results/export/default_requantize_vs_modelopt.json` (bytes) and
`docs/results/export/default_compressed_tensors_decode_vs_qpass.json` (ct), cited in docs/results/export.md.
"""

from __future__ import annotations

import collections
import hashlib
import json
import sys

import torch


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def listing(ours_dir: str, ref_path: str) -> dict:
    from qpass.checkpoint.hfdir import checkpoint_listing

    ours, ref = checkpoint_listing(ours_dir), json.load(open(ref_path))
    by = collections.defaultdict(lambda: [0, 0])
    for k, v in ref["tensors"].items():
        kind = next((s for s in ("weight_scale_2", "weight_scale", "input_scale") if k.endswith("." + s)), None)
        kind = kind or ("weight (codes)" if v["dtype"] == "U8" else "unquantized")
        by[kind][0] += 1
        by[kind][1] += ours["tensors"].get(k, {}).get("sha256") == v["sha256"]
    return {
        "tensors": len(ref["tensors"]),
        "same_names_dtypes_shapes": {k: (v["dtype"], v["shape"]) for k, v in ours["tensors"].items()}
        == {k: (v["dtype"], v["shape"]) for k, v in ref["tensors"].items()},
        "quantization_config_equal": ours["quantization_config"] == ref["quantization_config"],
        "hf_quant_config_equal_except_qpass_block": {k: v for k, v in ours["hf_quant_config"].items() if k != "qpass"} == ref["hf_quant_config"],
        "config_keys_only_ours": sorted(set(ours["config"]) - set(ref["config"])),
        "config_keys_only_modelopt": sorted(set(ref["config"]) - set(ours["config"])),
        "config_values_differ": sorted(k for k in ref["config"] if k in ours["config"] and ours["config"][k] != ref["config"][k]),
        "bit_identical_tensors_by_kind": {k: f"{s}/{n}" for k, (n, s) in sorted(by.items())},
    }


def requantize(hf_dir: str, ref_path: str) -> dict:
    from transformers import AutoModelForCausalLM

    from qpass.formats.spec import nvfp4_weight_spec
    from qpass.graph.sites import _group_of
    from qpass.quant.weights import quantize_site_weights

    ref = json.load(open(ref_path))["tensors"]
    sd = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).state_dict()
    sites = sorted(k[: -len(".weight_scale_2")] for k in ref if k.endswith(".weight_scale_2"))
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for s in sites:
        groups.setdefault(_group_of(s), {})[s] = sd[f"{s}.weight"]
    out = {"sites": len(sites)}
    for arithmetic in ("te_reference", "modelopt"):
        differ = collections.Counter()
        for members in groups.values():
            for s, sw in quantize_site_weights(nvfp4_weight_spec(arithmetic), members).items():
                q = sw.tensor
                for suf, t in (("weight", q.codes), ("weight_scale", q.scales), ("weight_scale_2", q.s_dec.reshape(()).float())):
                    differ[suf] += _sha(t) != ref[f"{s}.{suf}"]["sha256"]
        out[f"{arithmetic}: sites differing from ModelOpt"] = {k: differ[k] for k in ("weight", "weight_scale", "weight_scale_2")}
    return out


def ct_decode(qpass_dir: str, ct_dir: str) -> dict:
    from qpass.checkpoint.hfdir import read_hf_tensors
    from qpass.formats.e2m1 import e2m1_decode, unpack_e2m1
    from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_dequantize

    q, ct = read_hf_tensors(qpass_dir), read_hf_tensors(ct_dir)
    sites = sorted(k[: -len(".weight_scale_2")] for k in q if k.endswith(".weight_scale_2"))
    total = differ = sites_differ = max_ulp = 0
    for s in sites:
        codes, sc, sdec = q[f"{s}.weight"], q[f"{s}.weight_scale"], q[f"{s}.weight_scale_2"].float()
        want = nvfp4_dequantize(NVFP4Tensor.from_parts(codes, sc, sdec), torch.bfloat16)
        vals = e2m1_decode(unpack_e2m1(ct[f"{s}.weight_packed"])).float()
        n, k = vals.shape
        scale = ct[f"{s}.weight_scale"].to(torch.bfloat16).unsqueeze(-1) / ct[f"{s}.weight_global_scale"].float()
        got = (vals.reshape(n, k // 16, 16) * scale).reshape(n, k).to(torch.bfloat16)
        d = got.view(torch.int16) != want.view(torch.int16)
        total, differ = total + d.numel(), differ + int(d.sum())
        if bool(d.any()):
            sites_differ += 1
            max_ulp = max(max_ulp, int((got.view(torch.int16).int() - want.view(torch.int16).int()).abs().max()))
    return {"sites": len(sites), "sites_with_a_difference": sites_differ, "bf16_elements": total, "differing": differ, "max_bf16_ulp": max_ulp}


if __name__ == "__main__":
    cmd, a, b = sys.argv[1:4]
    print(json.dumps({"listing": listing, "bytes": requantize, "ct": ct_decode}[cmd](a, b), indent=1))
