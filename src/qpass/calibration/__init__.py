"""Calibration a user can run: static RAC channels and static activation scales (``qpass calibrate``).

* :mod:`qpass.calibration.source` — what the calibrating passes ask (``RACRequest``, ``AmaxRequest``)
  and the sources that answer (``ActivationSource``; the file record below);
* :mod:`qpass.calibration.measure` — site inputs of an unquantized model on calibration tokens
  (forward pre-hooks, one prompt per forward), the model weights' fingerprint;
* :mod:`qpass.calibration.record` — the verified calibration file (``calibration.json`` +
  ``calibration.safetensors``, sha256 of both) and :class:`~qpass.calibration.record.Calibration`;
* :mod:`qpass.calibration.run` — ``calibrate(pipeline, recipe, ...)`` (the command's core), reading a
  calibrated rollout graph's requests, re-calibrating it in place, and staleness of observed amax.

Modules are imported on use (the passes import only ``source``).
"""
