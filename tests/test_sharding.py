"""Golden sharding: the PartitionSpec of every parameter of a real model, computed abstractly."""

import os

import pytest
from jax.sharding import PartitionSpec as P

from conftest import ROOT
from maxtrain import load_config
from maxtrain.config import ConfigError
from maxtrain.sharding import logical_to_spec
from maxtrain.step import make_setup

RULES = {"batch": ["data", "fsdp"], "embed": "fsdp", "mlp": "tensor", "heads": "tensor", "none": None}


def test_logical_to_spec():
    assert logical_to_spec(("batch", "unknown", "mlp"), RULES) == P(("data", "fsdp"), None, "tensor")
    # a mesh axis shards one dimension only: `embed` after `batch` loses fsdp
    assert logical_to_spec(("batch", "embed"), RULES) == P(("data", "fsdp"), None)
    assert logical_to_spec(("embed", "mlp"), RULES) == P("fsdp", "tensor")
    assert logical_to_spec(("none", None), RULES) == P(None, None)


GOLDEN_8B = {  # llama3-8b on fsdp=4, tensor=2 under the default rules
    "['embed']['embedding']": P("tensor", "fsdp"),
    "['layers']['attn_norm']": P(None, None),
    "['layers']['wq']": P(None, "fsdp", "tensor", None),
    "['layers']['wk']": P(None, "fsdp", "tensor", None),
    "['layers']['wv']": P(None, "fsdp", "tensor", None),
    "['layers']['wo']": P(None, "tensor", None, "fsdp"),
    "['layers']['mlp_norm']": P(None, None),
    "['layers']['w_gate']": P(None, "fsdp", "tensor"),
    "['layers']['w_up']": P(None, "fsdp", "tensor"),
    "['layers']['w_down']": P(None, "tensor", "fsdp"),
    "['final_norm']['scale']": P(None),
    "['lm_head']['kernel']": P("fsdp", "tensor"),
}


def _specs(tree):
    import jax
    return {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_golden_param_and_optimizer_specs_llama3_8b():
    cfg = load_config(os.path.join(ROOT, "configs", "llama3-8b.yaml"),
                      ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2", "train.batch_size=8"])
    setup = make_setup(cfg)  # abstract only: no 8B arrays are created
    assert _specs(setup.state_shardings.params) == GOLDEN_8B
    mu = setup.state_shardings.opt_state[1][0].mu
    nu = setup.state_shardings.opt_state[1][0].nu
    assert _specs(mu) == GOLDEN_8B and _specs(nu) == GOLDEN_8B
    assert setup.state_shardings.opt_state[1][0].count.spec == P()
    assert setup.batch_sharding.spec == P(("data", "pipeline", "fsdp", "expert"), "sequence")


def test_undividable_kv_heads_named():
    cfg = load_config(os.path.join(ROOT, "configs", "llama3-8b.yaml"),
                      ["mesh.data=1", "mesh.tensor=8", "model.n_kv_heads=4", "train.batch_size=8"])
    with pytest.raises(ConfigError, match=r"\['layers'\]\['wk'\] dimension 2 \(kv_heads=4\) does not divide into 8"):
        make_setup(cfg)
