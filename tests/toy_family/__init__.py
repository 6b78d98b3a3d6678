"""A toy model family, whole in this folder (tests/test_toy_family.py takes it through config, train,
checkpoint, generate and Hugging Face conversion): a GPT-style decoder with learned absolute
positions and a GELU or ReLU MLP, its own config keys (`model.activation`, `model.max_positions`),
its own Hugging Face names (`model_type: maxtrain_toy`) and a KV-cached decoder. Importing this
package registers it; nothing in maxtrain names it."""

from maxtrain.models import Decoder, register
from toy_family import decode, hf, model
from toy_family.config import ToyConfig

NAME = "toy"
FAMILY = register(NAME, param_specs=model.param_specs, embed=model.embed, layer=model.layer, final=model.final,
                  head=model.head, config=ToyConfig, hf=hf.CONVERSION,
                  decoder=Decoder(decode.init_cache, decode.forward_cached))
