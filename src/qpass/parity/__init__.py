"""Learner/rollout parity: canonical parity objects, byte comparison, convention identification."""

from qpass.parity.object import ParityDiff, ParityObject, compare_parity, parity_object, parity_object_from_parts

__all__ = ["ParityDiff", "ParityObject", "compare_parity", "parity_object", "parity_object_from_parts"]


def __getattr__(name: str):  # lazy: identify imports the emulation modes
    if name == "identify":
        from qpass.parity.identify import identify

        return identify
    raise AttributeError(name)
