"""The DeepSeek-V3 family (`model.name: deepseek`): multi-head latent attention, fine-grained
experts with shared experts and auxiliary-loss-free balancing, multi-token prediction.

- `family.py`: registers the family (loaded on first use)
- `config.py`: its config class (`model.mla`, `model.mtp`; no jax, registered here when
  `maxtrain.models` is imported)
- `model.py`: the layered model
- `hf.py`: its Hugging Face conversion (`deepseek_v3`)
- `decode.py`: its KV-cached decoder (the latent cache of MLA)
"""

from maxtrain.config import register_model_config
from maxtrain.models import catalog
from maxtrain.models.deepseek.config import DeepSeekConfig

NAME = "deepseek"
catalog.declare(NAME, "maxtrain.models.deepseek.family")
register_model_config(NAME, DeepSeekConfig)
