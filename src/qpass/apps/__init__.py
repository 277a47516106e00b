"""Applications: the CLI, ``apply`` / ``check``, the QUADS study, the GRPO trainer.

Nothing below this layer (core, passes, runtime, backends) imports from ``qpass.apps``.
"""
