"""GPU tier of the Triton backend tests: the large-shape self-check at reduced size (needs CUDA)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_selfcheck_quick_on_gpu():
    from qpass.apps.bench.triton_selfcheck import Report, checks

    rep = Report()
    checks(rep, torch.device("cuda"), big=4096, quick=True)
    failed = [i for i in rep.items if not i["ok"]]
    assert not failed, failed
