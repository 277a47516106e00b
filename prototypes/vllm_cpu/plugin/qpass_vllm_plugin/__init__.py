"""vLLM general plugin: registers the `qpass_nvfp4` quantization method.

vLLM calls `register()` in every process (front end and engine-core worker) via the
`vllm.general_plugins` entry point (vllm/plugins/__init__.py load_general_plugins).
"""


def register() -> None:
    # Importing the module runs @register_quantization_config("qpass_nvfp4").
    from . import nvfp4  # noqa: F401
