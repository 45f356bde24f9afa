"""d9d.trainer.hf: the Hugging Face backend, any causal LM transformers ships, trained by d9d.

    providers:
      model: d9d.trainer.hf:HFCausalLMProvider
    model:
      folder: path/to/hf-model            # config.json + *.safetensors, relative to the config file

Needs transformers, an optional extra: `pip install 'd9d-trainer[hf]'` (in the d9d workspace:
`uv sync --all-packages --extra hf`). Nothing else in d9d imports it. See packages/d9d-trainer/README.md.
"""

from typing import TYPE_CHECKING

from d9d.mesh.lazy import lazy_face

_INSTALL = "pip install 'd9d-trainer[hf]' (in the d9d workspace: uv sync --all-packages --extra hf)"

try:
    import transformers as _transformers
except ModuleNotFoundError as _missing:
    if _missing.name != "transformers":
        raise
    raise ModuleNotFoundError(
        f"the Hugging Face backend (d9d.trainer.hf) needs transformers: {_INSTALL}", name="transformers"
    ) from None
if int(_transformers.__version__.split(".")[0]) < 5:  # 4.x leaves rotary buffers of a meta build unset
    raise ImportError(
        f"the Hugging Face backend (d9d.trainer.hf) needs transformers >= 5, found "
        f"{_transformers.__version__}: {_INSTALL.replace('pip install', 'pip install -U', 1)}",
        name="transformers",
    )
del _transformers

if TYPE_CHECKING:  # the public names, listed once: `lazy_face` reads this block
    from d9d.trainer.hf.config import HFCausalLMConfig
    from d9d.trainer.hf.errors import HFModelError
    from d9d.trainer.hf.model import HFCausalLM
    from d9d.trainer.hf.provider import HFCausalLMProvider

__all__, __getattr__, __dir__ = lazy_face(__name__, globals())
