"""The llama family (`model.name: llama`): Llama 2 and 3, Mistral, Qwen3, and their mixtures of
experts (Mixtral, Qwen3-MoE).

- `family.py`: registers the family (loaded on first use)
- `config.py`: its config class (no jax, registered here when `maxtrain.models` is imported)
- `model.py`: the layered model (`param_specs`, `embed`, `layer`, `final`, `head`)
- `hf.py`: its Hugging Face conversion (config.json and tensor names, both ways)
- `decode.py`: its KV-cached decoder (`maxtrain generate`, `train.sample_every`)
"""

from maxtrain.config import register_model_config
from maxtrain.models import catalog
from maxtrain.models.llama.config import LlamaConfig

NAME = "llama"
catalog.declare(NAME, "maxtrain.models.llama.family")
register_model_config(NAME, LlamaConfig, default=True)
