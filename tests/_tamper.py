"""Ways to alter a ``qpass apply`` output directory, for the integrity tests of ``qpass check`` / ``qpass export``.

Each helper changes one thing the way a stray edit, a bad copy or a careless script would; ``reseal``
then also rewrites the report's checksums and digest (a consistent forgery), so a test can show that
the cross-checks, not only the checksums, catch the change.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

RAC_SITE = "model.layers.0.mlp.gate_proj"  # quads_nvfp4: RAC ratio 0.5 on every gate/up input


def flip_last_byte(d: Path, rel: str) -> None:
    """Flip one bit near the end of ``d/rel`` (the last tensor's data of a safetensors file)."""
    f = d / rel
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x10
    f.write_bytes(bytes(raw))


def flip_rollout_code(d: Path, site: str = "model.layers.1.mlp.up_proj") -> None:
    """Flip one E2M1 code bit of ``site`` in ``rollout/weights.safetensors`` (a valid file, other bytes)."""
    path = d / "rollout" / "weights.safetensors"
    t = load_file(str(path))
    t[f"{site}.weight"][0, 0] ^= 0x01
    save_file(t, str(path), metadata={"format": "qpass-rollout"})


def flip_rollout_scale_bit(d: Path, site: str, pos: tuple[int, int]) -> None:
    """Flip the lowest bit of the E4M3 block-scale byte at ``pos`` of ``site`` in ``rollout/weights.safetensors``."""
    path = d / "rollout" / "weights.safetensors"
    t = load_file(str(path))
    t[f"{site}.weight_scale"].view(torch.uint8)[pos] ^= 0x01
    save_file(t, str(path), metadata={"format": "qpass-rollout"})


def scale_learner_weight(d: Path, site: str = "model.layers.1.mlp.up_proj") -> None:
    """Multiply one master weight element of ``site`` in ``learner/model.safetensors`` by 256 (its
    quantization, hence the rollout bytes a rebuild gives, changes)."""
    path = d / "learner" / "model.safetensors"
    t = load_file(str(path))
    w = t[f"{site}.weight"]
    w[0, 0] = w.abs().max() * 256
    save_file(t, str(path), metadata={"format": "qpass-learner"})


def set_rac_ratio(d: Path, ratio: float = 0.05, site: str = RAC_SITE) -> None:
    """Edit the RAC ratio of ``site`` in ``rollout/hf_quant_config.json`` (as qpass writes it)."""
    from qpass.jsonio import write_json

    path = d / "rollout" / "hf_quant_config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization"]["rac"][site]["ratio"] = ratio
    write_json(path, cfg)


def edit_report(d: Path, fn) -> None:  # noqa: ANN001 - fn(report dict) edits in place
    path = d / "report.json"
    rep = json.loads(path.read_text())
    fn(rep)
    path.write_text(json.dumps(rep, indent=2))


def edit_text(d: Path, rel: str, old: str, new: str) -> None:
    path = d / rel
    text = path.read_text()
    assert old in text, (rel, old)
    path.write_text(text.replace(old, new))


def seal(rep: dict) -> dict:
    """``qpass.apps.integrity.seal_report`` (a no-op on a qpass without report digests: the tests
    then show what the old code did with the same edit)."""
    try:
        from qpass.apps.integrity import seal_report
    except ImportError:
        return rep
    return seal_report(rep)


def reseal(d: Path) -> None:
    """Rewrite the sha256 of every file ``report.json`` lists, then the report's own digest."""

    def fix(rep: dict) -> None:
        sums = rep["artifacts"]["sha256"]
        for rel in sums:
            sums[rel] = hashlib.sha256((d / rel).read_bytes()).hexdigest()
        seal(rep)

    edit_report(d, fix)

