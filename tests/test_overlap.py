"""GPU defaults decided without a GPU: the train step's XLA options (overlap on GPUs, only options the
installed jaxlib knows, the user's XLA_FLAGS and `train.compiler_options` winning) and what
`model.attention: auto` runs for the devices a program is compiled for."""

import jax
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from maxtrain import step, targets
from maxtrain.config import ConfigError, load_config
from maxtrain.layers.attention import auto_attention

from conftest import TINY


def _cfg(*overrides):
    return load_config(TINY, list(overrides))


def test_gpu_compiles_get_the_overlap_options_and_cpu_compiles_do_not():
    cfg = _cfg()
    gpu = step.step_compiler_options(cfg, "gpu", xla_flags="")
    unknown = step.unknown_compiler_options(tuple(sorted(step.GPU_OVERLAP_OPTIONS.items())))
    if jax.__version_info__[:2] == (0, 10):
        assert not unknown  # jaxlib 0.10 knows them all (0.11's set: bench/gpu_check.sh prints it)
    assert gpu == {**step.STEP_COMPILER_OPTIONS,
                   **{k: v for k, v in step.GPU_OVERLAP_OPTIONS.items() if k not in unknown}}
    assert step.step_compiler_options(cfg, "cpu", xla_flags="") == step.STEP_COMPILER_OPTIONS
    assert step.step_compiler_options(_cfg("train.gpu_overlap=false"), "gpu", xla_flags="") == \
        step.STEP_COMPILER_OPTIONS


def test_the_user_overrides_each_option_by_config_or_xla_flags():
    cfg = _cfg("train.compiler_options.xla_gpu_enable_pipelined_all_gather=false",
               "train.compiler_options.xla_gpu_all_gather_combine_threshold_bytes=1024")
    opts = step.step_compiler_options(cfg, "gpu", xla_flags="--xla_gpu_enable_pipelined_reduce_scatter=false "
                                                            "--xla_force_host_platform_device_count=8")
    assert opts["xla_gpu_enable_pipelined_all_gather"] is False
    assert opts["xla_gpu_all_gather_combine_threshold_bytes"] == 1024
    assert "xla_gpu_enable_pipelined_reduce_scatter" not in opts  # XLA_FLAGS has it: compile options would win
    assert opts["xla_gpu_enable_pipelined_all_reduce"] is True
    # user options apply on CPU too (they are the user's)
    assert step.step_compiler_options(cfg, "cpu", xla_flags="")["xla_gpu_enable_pipelined_all_gather"] is False


def test_options_this_jaxlib_does_not_know_are_left_out_or_refused(monkeypatch):
    """A default the installed XLA rejects (as jax 0.10 and 0.11 differ) is dropped, found by
    compiling; the same name given by the user is a one-line ConfigError naming it."""
    fake = "xla_gpu_enable_an_option_no_xla_has"
    monkeypatch.setitem(step.GPU_OVERLAP_OPTIONS, fake, True)
    assert step.unknown_compiler_options(((fake, True), ("xla_gpu_enable_pipelined_all_gather", True))) == {fake}
    opts = step.step_compiler_options(_cfg(), "gpu", xla_flags="")
    assert fake not in opts and opts["xla_gpu_enable_pipelined_all_gather"] is True
    with pytest.raises(ConfigError, match=f"has no option {fake}"):
        step.step_compiler_options(_cfg(f"train.compiler_options.{fake}=true"), "gpu", xla_flags="")


def test_the_cpu_step_compiles_with_a_user_option():
    """The options reach the compile: a user option with a bad value fails the compile (XLA parses it)."""
    cfg = _cfg("train.compiler_options.xla_gpu_enable_while_loop_unrolling=NOT_A_MODE", "mesh.data=1", "mesh.fsdp=1")
    setup = step.make_setup(cfg, jax.devices()[:1])
    with pytest.raises(Exception, match="NOT_A_MODE|while_loop_unrolling"):
        step.compile_train_step(setup)


def _on(kind: str):
    device = AbstractDevice(device_kind=kind, num_cores=132, platform="gpu")
    return jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device))


def test_auto_attention_picks_by_device_head_dims_and_length_split():
    impl, why = auto_attention(128)
    assert impl == "xla" and "not a GPU" in why
    with _on(targets.TARGETS["h100"].device_kind):  # described Hopper: no cuDNN without the device
        assert auto_attention(128)[0] == "flash_mosaic"
        assert auto_attention(64)[0] == "flash_mosaic"
        impl, why = auto_attention(96)
        assert impl == "xla" and "cuDNN cannot be compiled without the device" in why
        assert auto_attention(192, 128)[0] == "xla"  # DeepSeek's latent attention
        impl, why = auto_attention(128, length_split=2)
        assert impl == "xla" and "ring" in why
    with _on(targets.TARGETS["a100"].device_kind):
        assert auto_attention(128)[0] == "flash"


def test_make_setup_resolves_auto_and_logs_it(caplog):
    cfg = _cfg("model.attention=auto", "mesh.data=1", "mesh.fsdp=1")
    with caplog.at_level("INFO", logger="maxtrain"):
        setup = step.make_setup(cfg, jax.devices()[:1])
    assert setup.cfg.model.attention == "xla"
    assert "model.attention=auto: xla (not a GPU" in caplog.text
    assert step.make_setup(_cfg("model.attention=xla", "mesh.data=1", "mesh.fsdp=1"),
                           jax.devices()[:1]).cfg.model.attention == "xla"
