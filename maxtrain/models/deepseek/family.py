"""Registers the deepseek family (`maxtrain.models.register`): its model, config class, Hugging
Face conversion and decoder. Imported on first use (`maxtrain.models.catalog`)."""

from maxtrain.models.deepseek import NAME, decode, hf, model
from maxtrain.models.deepseek.config import DeepSeekConfig
from maxtrain.models.registry import Decoder, register

FAMILY = register(NAME, param_specs=model.param_specs, embed=model.embed, layer=model.layer, final=model.final,
                  head=model.head, flops_per_token=model.flops_per_token, balance=model.balance,
                  config=DeepSeekConfig, hf=hf.CONVERSION, decoder=Decoder(decode.init_cache, decode.forward_cached))
