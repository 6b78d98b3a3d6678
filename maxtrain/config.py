"""Config schema, YAML loading with `base:` inheritance, `key=value` overrides, validation."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from maxtrain import storage
from maxtrain.errors import ConfigError, did_you_mean  # noqa: F401  (public here too)
from maxtrain.parallel import schedules

MESH_AXES = ("data", "pipeline", "fsdp", "expert", "sequence", "tensor")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "save_dots")
OPTIMIZERS = ("adamw", "muon")  # optim.name (maxtrain.optim builds them)
FP8_RECIPES = ("none", "tensorwise", "rowwise", "delayed")  # train.fp8.recipe (maxtrain.layers.fp8 runs them)
SCHEDULES = ("cosine", "linear", "constant")
log = logging.getLogger("maxtrain")


# keys that moved: naming the old one is an error that names the new one
MOVED_KEYS = {f"reliability.inject_{k}": f"drills.{k}" for k in (
    "nan_step", "spike_step", "bitflip_step", "hang_step", "crash_step", "sleep_s", "process")}


def _all_problems(messages: list[str]) -> ConfigError:
    """One error for every problem found: the message itself, or `N problems: a; b; c`."""
    if len(messages) == 1:
        return ConfigError(messages[0])
    return ConfigError(f"{len(messages)} problems: " + "; ".join(messages), messages)


# names other trainers (and Hugging Face configs) use for maxtrain's keys: the did-you-mean of an
# unknown key looks its last part up here before comparing spellings
ALIASES = {
    "learning_rate": "optim.lr", "lr_rate": "optim.lr", "max_lr": "optim.lr", "peak_lr": "optim.lr",
    "max_steps": "train.steps", "num_steps": "train.steps", "total_steps": "train.steps",
    "train_steps": "train.steps", "steps": "train.steps",
    "num_layers": "model.n_layers", "num_hidden_layers": "model.n_layers", "n_layer": "model.n_layers",
    "layers": "model.n_layers", "base_num_decoder_layers": "model.n_layers",
    "hidden_size": "model.d_model", "hidden_dim": "model.d_model", "emb_dim": "model.d_model",
    "embed_dim": "model.d_model", "n_embd": "model.d_model", "dim": "model.d_model", "base_emb_dim": "model.d_model",
    "num_attention_heads": "model.n_heads", "num_heads": "model.n_heads", "n_head": "model.n_heads",
    "num_key_value_heads": "model.n_kv_heads", "num_kv_heads": "model.n_kv_heads", "n_kv_head": "model.n_kv_heads",
    "intermediate_size": "model.d_ff", "ffn_dim": "model.d_ff", "mlp_dim": "model.d_ff", "ffn_hidden_size": "model.d_ff",
    "vocab": "model.vocab_size", "n_vocab": "model.vocab_size",
    "rms_norm_eps": "model.norm_eps", "layer_norm_eps": "model.norm_eps", "layernorm_epsilon": "model.norm_eps",
    "tie_word_embeddings": "model.tie_embeddings",
    "seq_length": "train.seq_len", "max_seq_len": "train.seq_len", "sequence_length": "train.seq_len",
    "max_target_length": "train.seq_len", "context_length": "train.seq_len", "block_size": "train.seq_len",
    "max_position_embeddings": "train.seq_len",
    "global_batch_size": "train.batch_size", "batch": "train.batch_size",
    "gradient_accumulation_steps": "train.grad_accum", "grad_accum_steps": "train.grad_accum",
    "warmup": "optim.warmup_steps", "num_warmup_steps": "optim.warmup_steps",
    "beta1": "optim.b1", "adam_beta1": "optim.b1", "adam_b1": "optim.b1",
    "beta2": "optim.b2", "adam_beta2": "optim.b2", "adam_b2": "optim.b2",
    "adam_eps": "optim.eps", "adam_epsilon": "optim.eps", "epsilon": "optim.eps",
    "max_grad_norm": "optim.clip_norm", "grad_clip": "optim.clip_norm", "clip_grad": "optim.clip_norm",
    "gradient_clipping": "optim.clip_norm", "gradient_clipping_threshold": "optim.clip_norm",
    "output_dir": "run_dir", "log_dir": "run_dir", "logdir": "run_dir", "base_output_directory": "run_dir",
    "save_steps": "checkpoint.every", "save_every": "checkpoint.every", "checkpoint_every": "checkpoint.every",
    "checkpoint_period": "checkpoint.every", "save_interval": "checkpoint.every",
    "eval_interval": "train.eval_every", "eval_steps_every": "train.eval_every",
    "log_interval": "train.log_every", "logging_steps": "train.log_every",
    "random_seed": "seed", "rng_seed": "seed",
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (long wavelengths divided by `factor`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLP (Mixtral-style top-k, DeepSeek-style fine-grained + shared experts)."""

    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 0.0  # 0: dropless (tokens sorted by expert, ragged matmuls)
    shared_experts: int = 0  # always-on experts of the same width, added to the routed output
    every: int = 1  # a MoE layer every k layers (the k-th of each block); the others are dense
    d_ff: int | None = None  # expert width; None: model.d_ff
    router: str = "softmax"  # softmax | sigmoid scores; the top-k weights are renormalised
    aux_loss_coef: float = 0.01  # load-balancing loss (Switch: E * sum_e f_e * p_e)
    z_loss_coef: float = 0.001  # router z-loss: mean logsumexp(router logits)^2
    # DeepSeek-style routing (model.name: deepseek reads these; other families need their defaults)
    first_dense: int = 0  # the first k layers have a dense MLP of model.d_ff (DeepSeek's first_k_dense_replace)
    norm_topk: bool | None = None  # renormalise the top-k weights; None: when top_k > 1 (Mixtral, Switch)
    routed_scale: float = 1.0  # the routed experts' weights times this (DeepSeek's routed_scaling_factor)
    groups: int = 1  # experts in this many groups; a token picks topk_groups groups first (node-limited routing)
    topk_groups: int = 1  # groups each token may route into (ranked by the sum of their two best scores)
    # auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores to choose
    # experts (not to weight them), moved by this much per step towards the mean load; 0: no bias
    bias_update_rate: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    """What every model family shares. A family's own keys are its subclass's fields (registered with
    `register_model_config`; `model.name` picks the class when a config is read); its checks are the
    class's `validate` and `validate_for_mesh`."""
    name: str = ""  # "": the default family (`register_model_config(..., default=True)`)
    vocab_size: int = 32000
    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: n_heads (no GQA)
    head_dim: int | None = None  # None: d_model // n_heads
    d_ff: int = 11008
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention: str = "auto"  # auto: the fastest kernel the devices compiled for can run (docs/performance.md)
    ring_layout: str = "zigzag"  # ring attention's token order over mesh.sequence: zigzag | contiguous
    sliding_window: int | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of every query and key head, before RoPE
    moe: MoEConfig | None = None  # null: dense SwiGLU MLPs
    remat: str = "full"
    fused_norm: bool = False  # the attention's residual add and the MLP's RMSNorm as one kernel (kernels/rms_norm.py)
    init_std: float = 0.02
    extra: dict = field(default_factory=dict)  # free-form settings for registered custom models

    def __post_init__(self):
        if not self.name and _DEFAULT_FAMILY:
            object.__setattr__(self, "name", _DEFAULT_FAMILY[0])
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim is None and self.n_heads > 0:
            if self.d_model % self.n_heads:
                raise ConfigError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                                  f"choose sizes that divide, or set model.head_dim explicitly (head_dim x n_heads "
                                  f"need not equal d_model)")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)


    def stack_length(self) -> int:
        """Elements of the layer stack (what pipeline stages split): `moe.every` layers per element
        in a MoE model, one otherwise. A family whose stack differs (layers outside it) overrides."""
        return self.n_layers // self.moe.every if self.moe is not None else self.n_layers

    def attention_head_dims(self) -> tuple[int, int]:
        """(query/key, value) head dims the attention kernels see (`model.attention: auto` picks by
        them). A family whose attention differs (latent attention) overrides."""
        return self.head_dim, self.head_dim

    def validate(self) -> None:
        """The family's own checks (after the shared ones); raise ConfigError."""

    def validate_for_mesh(self, cfg: "Config", sizes: dict[str, int]) -> None:
        """The family's checks that need the mesh's sizes; raise ConfigError."""


# model.name -> the family's config class (a subclass of ModelConfig); filled by the families
# (maxtrain/models/<family>/__init__.py, no jax) and by `maxtrain.models.register(config=...)`.
_FAMILIES: dict[str, type] = {}
_DEFAULT_FAMILY: list[str] = []


def register_model_config(name: str, cls: type = ModelConfig, *, default: bool = False) -> None:
    """Makes `model.name: NAME` read the `model` section into `cls` (ModelConfig or a subclass);
    `default`: the family a config without `model.name` gets."""
    if not (isinstance(cls, type) and issubclass(cls, ModelConfig)):
        raise TypeError(f"register_model_config({name!r}): {cls!r} is not a subclass of maxtrain.config.ModelConfig")
    _FAMILIES[name] = cls
    if default and not _DEFAULT_FAMILY:
        _DEFAULT_FAMILY.append(name)


def default_family() -> str:
    """The family a config without `model.name` gets."""
    return _DEFAULT_FAMILY[0] if _DEFAULT_FAMILY else ""


def model_config_class(name: str) -> type:
    """The config class of family `name` (ModelConfig for a family that registered none)."""
    return _FAMILIES.get(name or (_DEFAULT_FAMILY[0] if _DEFAULT_FAMILY else ""), ModelConfig)


def model_config(**fields) -> ModelConfig:
    """A model config of the family `fields["name"]` names (the default family without one)."""
    return model_config_class(fields.get("name", ""))(**fields)


@dataclass(frozen=True)
class MeshConfig:
    """Sizes of the named mesh axes; their product is the device count, one may be -1 (it takes the
    devices the others leave). By default that is fsdp (`fill_axis_default`)."""

    data: int = 1
    pipeline: int = 1
    fsdp: int = -1
    expert: int = 1
    sequence: int = 1
    tensor: int = 1


@dataclass(frozen=True)
class Fp8Config:
    """FP8 projections (maxtrain.layers.fp8): attention q/k/v/o and the dense MLP in FP8."""
    recipe: str = "none"  # none | tensorwise | rowwise (current scaling) | delayed (amax history)
    amax_history: int = 16  # delayed: steps of amaxes a scale is taken from
    all_gather: bool = False  # quantize weights before the FSDP all-gather (tensorwise, delayed)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    batch_size: int = 8  # global sequences per optimizer step
    seq_len: int = 256
    grad_accum: int = 1
    microbatches: int | None = None  # pipeline microbatches per accumulation step; None: mesh.pipeline
    pipeline_repeats: int = 1  # circular pipeline: layer chunks per stage (R); bubble (S-1)/(M*R+S-1)
    pipeline_remat: bool = False  # recompute each stage visit in the backward: keep only its input per microbatch
    pipeline_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved (R > 1) | zero_bubble (docs/parallelism.md#schedules)
    log_every: int = 10
    dtype: str = "bfloat16"  # compute
    param_dtype: str = "float32"  # master weights and optimizer state
    z_loss: float = 0.0
    cross_entropy: str = "auto"  # auto (onepass where the model hands over features and head, else xla) | xla (float32 logits) | fused (projection chunked over vocab) | pallas (bf16 logits) | onepass (chunked over tokens, gradients in the forward)
    cross_entropy_chunk: int = 4096  # fused/pallas: vocab columns per chunk; onepass: per weight-gradient block
    cross_entropy_tokens: int = 0  # onepass: tokens per chunk of float32 logits; 0: a quarter of a device's tokens, at least 128
    peak_tflops: float | None = None  # per device; None: detected from the device name
    eval_every: int = 0  # steps between evaluations (0: none)
    eval_steps: int = 10  # batches per evaluation
    sample_every: int = 0  # steps between greedy samples from sample_prompt in the metrics record (0: none)
    sample_prompt: str = ""  # text (the data's tokenizer) the samples continue; "": from the end-of-text token
    sample_tokens: int = 32  # tokens per sample
    fp8: Fp8Config = field(default_factory=Fp8Config)
    gpu_overlap: bool = True  # on GPUs, the XLA options that overlap collectives with compute (docs/performance.md#overlap)
    compiler_options: dict = field(default_factory=dict)  # XLA options for the train step's compile, over the defaults


@dataclass(frozen=True)
class MuonConfig:
    """`optim.name: muon` (maxtrain.optim): Newton-Schulz orthogonalised momentum for the layers'
    weight matrices, AdamW (the `optim.b1`, `b2`, `eps`, masked decay) for everything else."""
    beta: float = 0.95  # momentum
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations (quintic, Keller Jordan's coefficients)
    # update RMS: 0.2 x sqrt(max(fan_in, fan_out)) x the orthogonalised matrix, so its RMS is about
    # AdamW's (Moonlight, arXiv:2502.16982) and one optim.lr and weight decay serve both; 0: the
    # original sqrt(max(1, fan_out / fan_in)) scaling
    rms_scale: float = 0.2
    # parameters kept on AdamW besides embeddings, the output head, norms and biases: path
    # substrings, e.g. [router] for MoE routers
    adamw: list = field(default_factory=list)


@dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"  # adamw | muon (optim.muon)
    muon: MuonConfig = field(default_factory=MuonConfig)
    lr: float = 3e-4
    warmup_steps: int = 100
    schedule: str = "cosine"
    decay_steps: int | None = None  # None: train.steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    # parameter groups (maxtrain.optim.group_scales), each {params: REGEX of a parameter path like
    # embed/embedding or layers/attn/wq, lr_scale, weight_decay, frozen_until: STEP, rows_from: ID,
    # rows_until: STEP}; a parameter takes the first group whose regex it matches (re.search)
    groups: list = field(default_factory=list)


@dataclass(frozen=True)
class DataConfig:
    kind: str = "synthetic"  # synthetic | text | tokens
    path: str | list | None = None  # text: file/dir/glob/"stdlib"; tokens: prepared dir(s), weighted list
    eval_path: str | list | None = None  # like path; tokens: None uses the val split of `path` if present
    max_bytes: int = 16_000_000  # text: corpus read into memory at most
    workers: int = 0  # grain worker processes producing batches (0: threads in this process)
    prefetch: int = 4  # batches prepared ahead of the step
    verify: str = "sha256"  # tokens: sha256 of each shard when a process first opens it | count (records only)
    synthetic_doc_len: int = 0  # synthetic: 0 one progression per row; N packs documents of mean length N


def _default_param_rules() -> dict:
    return {
        "vocab": "tensor",
        "embed": "fsdp",
        "heads": "tensor",
        "kv_heads": "tensor",
        "head_dim": None,
        "mlp": "tensor",
        "layers": None,
        "norm": None,
        "experts": "expert",
        "expert_mlp": "tensor",
        "stages": "pipeline",  # pipelined layer stacks [repeats, stages, layers, ...]
        "repeats": None,
        "q_lora": "fsdp",  # multi-head latent attention's latent ranks (the input side of their up-projections)
        "kv_lora": "fsdp",
    }


def _default_activation_rules() -> dict:
    return {
        "batch": ["data", "pipeline", "fsdp", "expert"],
        "length": "sequence",  # the residual stream between blocks
        "block_length": "sequence",  # inside attention, the MLP and the output projection
        "kv_length": None,  # keys/values are gathered along length inside attention
        "embed": None,
        "heads": "tensor",
        "kv_heads": "tensor",
        "head_dim": None,
        "mlp": "tensor",
        "vocab": "tensor",
        "experts": "expert",
        "expert_mlp": "tensor",
    }


@dataclass(frozen=True)
class ShardingConfig:
    """Logical axis name -> mesh axis (or list of axes, or null), for parameters and activations."""

    params: dict = field(default_factory=_default_param_rules)
    activations: dict = field(default_factory=_default_activation_rules)


@dataclass(frozen=True)
class LocalCheckpointConfig:
    """The local tier (maxtrain/checkpoint/local.py): each process's own shards, and a copy of its
    ring predecessor's, on node-local storage every few steps; restore takes the newest complete step
    across this tier and checkpoint.dir."""
    dir: str | None = None  # node-local directory (e.g. /dev/shm/maxtrain, a local NVMe); None: no local tier
    every: int = 10  # steps between local checkpoints
    keep: int = 2  # newest local checkpoints kept per process
    replica_of: str = "ring"  # ring: each process also keeps its ring predecessor's (on another host when there are several) | none


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None  # None: no checkpoints
    every: int = 1000  # steps between saves; 0: only at the end and on preemption
    keep: int = 3  # newest complete checkpoints kept
    keep_every: int | None = None  # steps that are multiples of this are kept forever
    async_: bool = field(default=True, metadata={"key": "async"})  # write in the background
    resume_from: str = "latest"  # latest | none | PATH (a checkpoint dir or one step dir)
    init_from: str | None = None  # PATH: start from these params with a fresh optimizer
    allow_data_change: bool = False  # resume although seed/batch/seq_len/data changed (data skipped or repeated)
    local: LocalCheckpointConfig = field(default_factory=LocalCheckpointConfig)


@dataclass(frozen=True)
class ReliabilityConfig:
    """Guards, watchdog, compilation cache and fault injection (see maxtrain/reliability/)."""

    nan_action: str = "skip"  # non-finite loss/grads: skip (drop the update) | halt (exit 77) | none
    spike_action: str = "skip"  # loss or grad-norm spike: skip | halt | none (not checked)
    spike_sigma: float = 6.0  # spike: above the running mean by this many standard deviations
    spike_warmup: int = 20  # accepted steps before spikes are judged
    max_rollbacks: int = 3  # action rollback: at most this many per run, then halt (exit 77)
    max_consecutive_skips: int = 10  # this many updates skipped in a row: the run is not training, halt (exit 77); 0: off
    max_restarts: int = 0  # `maxtrain launch local`: restarts after a crash, hang or preemption (--max-restarts wins)
    hang_timeout_s: float = 900.0  # no step completing for this long: dump stacks, exit 76; 0: off
    first_step_timeout_s: float = 3600.0  # the same for the first steps (compilation)
    restore_timeout_s: float = 1800.0  # a checkpoint restore (or verify) taking longer: dump stacks, exit 76; 0: off
    compilation_cache: str | None = "~/.cache/maxtrain/jax"  # persistent XLA cache; null: off
    straggler_every: int = 50  # steps between cross-process comparisons of host step work; 0: off
    straggler_factor: float = 2.0  # a process slower than this x the median is named
    # each comparison also times a matmul probe on every device; a process below (1 - preflight_compute_slack) x
    # the others' median in this many comparisons in a row is evicted: last step saved, exit 78; 0: report only
    straggler_evict_after: int = 3
    replay_every: int = 1000  # steps between deterministic-replay checks (one step run twice); 0: off
    fingerprint_every: int = 100  # steps between replica fingerprint checks (silent corruption); 0: off
    # preflight (maxtrain.reliability.preflight, docs/reliability.md#preflight): devices, links and
    # disks measured before training; a condemned node makes the job exit 78 (exit_codes.UNHEALTHY)
    # auto: quick on a multi-process job, off on one process | quick | full | off (YAML reads a bare
    # off as false and on as true: false is off, true is auto)
    preflight: str | bool = "auto"
    preflight_compute_slack: float = 0.10  # matmul/memory/host-copy rate this far below the others' median condemns
    preflight_link_slack: float = 0.40  # a ring link this far below the other links' median is slow
    preflight_storage_slack: float = 0.50  # a storage write/read rate this far below the others' median condemns
    preflight_peak_fraction: float = 0.30  # matmul rate below this fraction of the device table's bf16 peak condemns


@dataclass(frozen=True)
class DrillsConfig:
    """Faults injected on purpose (see maxtrain/reliability/drills.py); steps are 0-based; all off by default."""

    nan_step: int | None = None  # the loss and every gradient NaN at this step
    spike_step: int | None = None  # the loss and every gradient x1000 at this step
    bitflip_step: int | None = None  # one bit of one replica's params flipped after this step
    hang_step: int | None = None  # hang before this step
    crash_step: int | None = None  # crash (exit 1) before this step
    preempt_step: int | None = None  # SIGTERM to this process before this step: it saves and exits 75
    sleep_s: float = 0.0  # sleep before every step (a slow process)
    process: int = 0  # the process the host-side drills happen in
    preflight_slow: str | None = None  # matmul | collective | link | storage: that preflight check of `process` slowed
    preflight_factor: float = 1.5  # ... to this many times its time
    straggler_factor: float = 1.0  # the in-run straggler probe's matmuls of `process` stretched to this many times


@dataclass(frozen=True)
class LoggingConfig:
    """Where process 0's metric records go besides metrics.jsonl and the log."""

    tensorboard: bool = True  # scalars of every numeric record field under run_dir/tb/
    wandb: bool = False  # also Weights & Biases (needs the wandb package; offline with WANDB_MODE=offline)
    wandb_project: str = "maxtrain"
    breakdown_every: int | None = None  # steps between step-time breakdowns in the log; None: every log line


@dataclass(frozen=True)
class ProfileConfig:
    """A profiler window over a few steps, and compiled-program dumps, written to run_dir."""

    start_step: int | None = None  # first traced step (counted from 1 like metrics); None: no trace
    steps: int = 3  # traced steps
    tracer: str = "jax"  # jax: jax.profiler trace in run_dir/profile; nsys: cudaProfilerStart/Stop for Nsight
    memory_profile: bool = True  # device-memory profile (pprof) at the end of the window
    dump_hlo: bool = False  # the optimized HLO of the compiled train step -> run_dir/train_step.hlo.txt


@dataclass(frozen=True)
class Config:
    run_dir: str = "runs/default"
    seed: int = 0
    # node-local copies of what is read from s3:// or gs:// (prepared tokens, init_from/resume_from checkpoints)
    object_cache: str = storage.DEFAULT_CACHE
    model: ModelConfig = field(default_factory=model_config)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    drills: DrillsConfig = field(default_factory=DrillsConfig)


# ---------------------------------------------------------------- loading


def load_config(path: str | os.PathLike | None, overrides: typing.Iterable[str] = ()) -> Config:
    """Loads a YAML config (following `base:`; None: the built-in defaults), applies `key=value`
    overrides, validates it."""
    raw = _apply_overrides(_load_yaml_chain(os.fspath(path), seen=()) if path is not None else {}, overrides)
    fill_axis_default(raw)
    saved = _init_from_model(raw)
    if saved is not None:  # continued pretraining: the converted or trained model is the base
        raw["model"] = _laid_over(saved, raw.get("model") if isinstance(raw.get("model"), dict) else {})
    cfg = from_dict(raw)
    validate(cfg)
    if saved is not None:
        for line in init_from_changes(saved, cfg):
            log.warning(line)
    return cfg


def saved_model_section(path: str) -> dict | None:
    """The `model` section saved with a checkpoint directory's newest step (or one step directory),
    read from the step's meta without Orbax (`maxtrain.checkpoint.meta`), so before jax; None when
    no step has one. The restore verifies the meta against the step's manifest later."""
    from maxtrain.checkpoint.meta import saved_metas

    for meta in saved_metas(path):
        config = meta.get("config")
        model = config.get("model") if isinstance(config, dict) else None
        if isinstance(model, dict):
            return model
    return None


def _init_from_model(raw: dict) -> dict | None:
    """The model section of `checkpoint.init_from`'s checkpoint, when the config names one; a path
    that does not exist is one line here, before anything is claimed or jax is imported."""
    section = raw.get("checkpoint")
    path = section.get("init_from") if isinstance(section, dict) else None
    if isinstance(path, str) and storage.url_scheme(path) in storage.OBJECT_STORES:
        return None if storage.path_problem("checkpoint.init_from", path, urls=True) else saved_model_section(path)
    if not isinstance(path, str) or not path or storage.url_scheme(path):
        return None  # none, or the path check's error (validate)
    if not os.path.exists(path):
        raise ConfigError(f"checkpoint.init_from={path} does not exist; give a checkpoint directory or one of its "
                          f"step directories (`maxtrain convert hf-to-maxtrain` writes one)")
    return saved_model_section(path)


def _laid_over(base: dict, explicit: dict) -> dict:
    """`base` with every key `explicit` sets replacing it (nested sections key by key)."""
    out = dict(base)
    for key, value in explicit.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _laid_over(out[key], value) if both else value
    return out


def init_from_changes(saved: dict, cfg: Config) -> list[str]:
    """One line per model key the config sets to another value than `checkpoint.init_from`'s model."""
    try:
        before = _flat(to_dict(from_dict({"model": saved}).model), "model.")
    except ConfigError:
        return []  # a section an older version wrote: the restore's shape check still applies
    after = _flat(to_dict(cfg.model), "model.")
    return [f"{key}: {before.get(key)!r} in checkpoint.init_from={cfg.checkpoint.init_from}, {after[key]!r} here "
            f"(set by the config or an override)" for key in sorted(after) if before.get(key) != after[key]]


def _flat(tree, prefix: str) -> dict:
    if isinstance(tree, dict) and tree:
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def with_overrides(cfg: Config, overrides: typing.Iterable[str]) -> Config:
    """`cfg` with `key=value` overrides applied, validated (e.g. a checkpoint's saved config)."""
    out = from_dict(_apply_overrides(to_dict(cfg), overrides))
    validate(out)
    return out


def _apply_overrides(raw: dict, overrides: typing.Iterable[str]) -> dict:
    """`raw` (a config mapping) with each `key=value` set in it, in place."""
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    return raw


def fill_axis_default(raw: dict) -> None:
    """Which mesh axis takes the devices the config does not size (in place, on the raw mapping):
    one the config sets to -1; else data, when the config sizes fsdp itself (the rest is data
    parallel); else fsdp, so that out of the box parameters, gradients and optimizer state are
    sharded over every device rather than replicated (`mesh.data=-1` for pure data parallelism)."""
    mesh = raw.get("mesh")
    if not isinstance(mesh, dict):
        return  # no mesh section: the defaults (fsdp fills); anything else is from_dict's error
    if any(v == -1 for v in mesh.values()):
        mesh.setdefault("fsdp", 1)
    elif "fsdp" in mesh:
        mesh.setdefault("data", -1)


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b=VALUE` -> ("a.b", YAML-parsed VALUE)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. train.steps=100)")
    try:
        parsed = yaml.safe_load(value) if value else None
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


def _load_yaml_chain(path: str, seen: tuple) -> dict:
    real = os.path.realpath(path)
    if real in seen:
        raise ConfigError(f"config {path}: `base:` chain loops back to itself")
    data = _read_yaml_file(path)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError(f"config file {path}: `base:` must be one file name (a string), got {base!r}; "
                          "inherit from several files by chaining them, each with its own `base:`")
    base_path = os.path.join(os.path.dirname(path), base)
    return _deep_merge(_load_yaml_chain(base_path, seen + (real,)), data)


def _read_yaml_file(path: str) -> dict:
    """One config file as a mapping; every way it can be unreadable is a ConfigError."""
    if os.path.isdir(path):
        raise ConfigError(f"config {path} is a directory, not a YAML file; pass a file such as configs/tiny.yaml")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}); is it a YAML file?") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {path}{where} is not valid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping of sections, got {type(data).__name__}")
    return data


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def set_dotted(raw: dict, key: str, value: Any) -> None:
    """`raw[a][b][c] = value` for `key` "a.b.c", creating sections; a key through a non-section is one line."""
    node = raw
    parts = key.split(".")
    for i, p in enumerate(parts[:-1]):
        child = node.get(p)
        if child is None:
            child = {}
            node[p] = child
        elif not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"{where} is {child!r} in the config, not a section, so {key}= cannot be set; "
                              f"fix {where} in the YAML file")
        node = child
    node[parts[-1]] = value


def valid_keys(cls=Config, prefix: str = "", families: typing.Iterable[str] | None = None) -> list[str]:
    """Every dotted key of the schema (for suggestions and docs); `model.*` of the `families` named
    (None: every registered family)."""
    keys = []
    for c in _family_classes(families) if cls is ModelConfig else (cls,):
        hints = typing.get_type_hints(c)
        for f in dataclasses.fields(c):
            sub = _dataclass_of(hints[f.name])
            name = prefix + _key(f)
            if name in keys:
                continue
            keys.append(name)
            if sub is not None:
                keys.extend(valid_keys(sub, name + ".", families))
    return keys


def _family_classes(families: typing.Iterable[str] | None = None) -> list[type]:
    """ModelConfig and the classes of `families` (None: every registered family's)."""
    names = _FAMILIES if families is None else [n for n in families if n in _FAMILIES]
    return [ModelConfig, *dict.fromkeys(_FAMILIES[n] for n in names if _FAMILIES[n] is not ModelConfig)]


def _dataclass_of(tp) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def from_dict(raw: dict, cls=Config, prefix: str = "") -> Any:
    """Builds a typed (frozen) config from nested dicts, with a clear error for any bad key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    if cls is ModelConfig:  # the family's class, by model.name
        cls = model_config_class(raw.get("name") if isinstance(raw.get("name"), str) else "")
    hints = typing.get_type_hints(cls)
    names = {_key(f) for f in dataclasses.fields(cls)}
    problems = [_other_family_key(prefix, str(key), raw, cls) or _unknown_key(prefix + str(key), prefix, names)
                for key in raw if key not in names]
    kwargs = {}
    for f in dataclasses.fields(cls):
        if _key(f) not in raw:
            continue
        try:
            kwargs[f.name] = _coerce(raw[_key(f)], hints[f.name], prefix + _key(f), f)
        except ConfigError as e:  # every problem of the file at once, not the first alone
            problems.extend(e.messages)
    if problems:
        raise _all_problems(problems)
    return cls(**kwargs)


def _other_family_key(prefix: str, key: str, raw: dict, cls: type) -> str | None:
    """The message for a `model` key another family has ("model.mla is a key of model.name=...")."""
    if not issubclass(cls, ModelConfig):
        return None
    owners = [n for n, c in _FAMILIES.items() if key in {_key(f) for f in dataclasses.fields(c)}]
    if not owners:
        return None
    name = raw.get("name") or (_DEFAULT_FAMILY[0] if _DEFAULT_FAMILY else "")
    return (f"{prefix}{key} is a key of {' and '.join(f'model.name={o}' for o in owners)}, not of model.name={name}; "
            f"drop it here (or set model.name)")


def _unknown_key(full: str, prefix: str, names: set[str]) -> str:
    """The message for an unknown key: where it moved, the key another trainer's name stands for,
    the closest spelling, or the valid keys of its section."""
    if full in MOVED_KEYS:
        return f"{full} is now {MOVED_KEYS[full]}"
    close = _closest_key(full)
    hint = f"; did you mean {close[0]}?" if close else \
        f"; valid keys under {prefix.rstrip('.') or 'the top level'}: {', '.join(sorted(names))}"
    return f"unknown config key {full}{hint}"


def _closest_key(full: str) -> list[str]:
    """[the valid key `full` most likely means] or []: the closest spelling of a key, or of another
    trainer's name (`ALIASES`, a misspelt `learning_rate` included) when that is at least as close."""
    def ratio(a: str, b: str) -> float:
        return difflib.SequenceMatcher(None, a, b).ratio()

    keys = difflib.get_close_matches(full, valid_keys(), n=1, cutoff=0.6)
    last = full.rsplit(".", 1)[-1]
    names = difflib.get_close_matches(last, ALIASES, n=1, cutoff=0.75)
    if names and (not keys or ratio(last, names[0]) >= ratio(full, keys[0])):
        return [ALIASES[names[0]]]
    return keys


def _coerce(value, tp, key: str, f: dataclasses.Field):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) > 1:  # e.g. str | list: the first type that accepts the value
            for option in options[:-1]:
                try:
                    return _coerce(value, option, key, f)
                except ConfigError:
                    pass
        tp = options[-1]
    sub = _dataclass_of(tp)
    if sub is not None:
        return from_dict(value if value is not None else {}, sub, key + ".")
    if tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else {}
        return {**default, **value}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, str):
            value = _yaml11_number(value)
        if isinstance(value, float) and value.is_integer():
            value = int(value) if abs(value) < 2.0**63 else value
        if isinstance(value, int) and not isinstance(value, bool):
            if not -(2**63) <= value < 2**63:
                raise ConfigError(f"{key}={value!r} is out of range: integers must fit in 64 bits")
            return value
        if isinstance(value, float) and value.is_integer():
            raise ConfigError(f"{key}={value!r} is out of range: integers must fit in 64 bits")
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)  # YAML 1.1 reads `3e-4` as a string
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if not math.isfinite(number):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string, got {value!r}")
    if tp is list:
        if isinstance(value, list):
            return value
        raise ConfigError(f"{key} must be a string or a list, got {value!r}")
    raise TypeError(f"unsupported config field type {tp} for {key}")


def _yaml11_number(text: str):
    """`1e23` (YAML 1.1 reads exponents without a dot as strings) as a float; other text unchanged."""
    try:
        return float(text) if any(c.isdigit() for c in text) else text
    except ValueError:
        return text


def _key(f: dataclasses.Field) -> str:
    """The YAML key of a field (`async_` is spelled `async` in configs)."""
    return f.metadata.get("key", f.name)


def to_dict(cfg) -> dict:
    """The config as plain YAML-able data, with config-file key names."""
    if dataclasses.is_dataclass(cfg):
        return {_key(f): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    return cfg


def save_config(cfg: Config, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)


# ---------------------------------------------------------------- validation


def _choice(key: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid; {did_you_mean(value, choices)}choose one of {', '.join(choices)}")


def validate(cfg: Config) -> None:
    """Checks that need no devices (`validate_for_mesh` has the device-dependent ones). Every group
    of checks runs and each reports its first problem, so a config with several mistakes names them
    all at once; the groups that divide by sizes run only once the sizes are positive."""
    problems: list[str] = []

    def run(check) -> bool:
        try:
            check(cfg)
            return True
        except ConfigError as e:
            problems.extend(e.messages)
            return False

    sizes_ok = run(_validate_sizes)
    model_ok = sizes_ok and run(_validate_model)
    if sizes_ok:
        run(_validate_train)
    if run(_validate_mesh) and model_ok:  # the pipeline divides layers and batches by mesh and MoE sizes
        run(_validate_pipeline)
    for check in (_validate_reliability, _validate_data_and_checkpoints, _validate_observability, _validate_sharding):
        run(check)
    if problems:
        raise _all_problems(problems)


def _validate_sizes(cfg: Config) -> None:
    m, t = cfg.model, cfg.train
    for key, value in [
        ("model.vocab_size", m.vocab_size), ("model.d_model", m.d_model),
        ("model.n_layers", m.n_layers), ("model.n_heads", m.n_heads),
        ("model.n_kv_heads", m.n_kv_heads), ("model.head_dim", m.head_dim), ("model.d_ff", m.d_ff),
        ("train.steps", t.steps), ("train.batch_size", t.batch_size), ("train.seq_len", t.seq_len),
        ("train.grad_accum", t.grad_accum), ("train.log_every", t.log_every), ("train.eval_steps", t.eval_steps),
        ("train.cross_entropy_chunk", t.cross_entropy_chunk),
    ]:
        if value is None or value <= 0:
            raise ConfigError(f"{key} must be a positive integer, got {value}")


def _validate_model(cfg: Config) -> None:
    m = cfg.model
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}; "
            f"grouped-query attention needs n_heads to be a multiple of n_kv_heads")
    if m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim} must be even for rotary embeddings")
    if m.sliding_window is not None and m.sliding_window <= 0:
        raise ConfigError(f"model.sliding_window must be a positive integer or null, got {m.sliding_window}")
    _choice("model.remat", m.remat, REMAT_POLICIES)
    _choice("model.ring_layout", m.ring_layout, ("zigzag", "contiguous"))
    if m.moe is not None:
        e = m.moe
        if e.num_experts < 1 or not 1 <= e.top_k <= e.num_experts:
            raise ConfigError(f"model.moe.top_k={e.top_k} must be between 1 and model.moe.num_experts={e.num_experts}")
        if e.every < 1 or m.n_layers % e.every:
            raise ConfigError(f"model.n_layers={m.n_layers} is not divisible by model.moe.every={e.every}; "
                              f"choose a divisor of {m.n_layers}")
        if e.capacity_factor < 0 or e.shared_experts < 0 or (e.d_ff is not None and e.d_ff < 1):
            raise ConfigError("model.moe.capacity_factor and model.moe.shared_experts must be >= 0, "
                              "model.moe.d_ff positive or null")
        _choice("model.moe.router", e.router, ("softmax", "sigmoid"))
        if e.groups < 1 or e.num_experts % e.groups or not 1 <= e.topk_groups <= e.groups:
            raise ConfigError(f"model.moe.groups={e.groups} must divide model.moe.num_experts={e.num_experts} and "
                              f"model.moe.topk_groups={e.topk_groups} be between 1 and groups")
        if e.top_k > e.topk_groups * (e.num_experts // e.groups):
            raise ConfigError(f"model.moe.top_k={e.top_k} is more than the {e.topk_groups * (e.num_experts // e.groups)} "
                              f"experts of model.moe.topk_groups={e.topk_groups} groups of "
                              f"{e.num_experts // e.groups}; raise topk_groups or lower top_k")
        if e.groups > 1 and e.num_experts // e.groups < 2:
            raise ConfigError(f"model.moe.groups={e.groups}: a group ranks by its two best experts, so each needs "
                              f"at least 2 of model.moe.num_experts={e.num_experts}")
        if e.routed_scale <= 0 or e.bias_update_rate < 0 or e.first_dense < 0:
            raise ConfigError("model.moe.routed_scale must be > 0, model.moe.bias_update_rate and "
                              "model.moe.first_dense >= 0")
    m.validate()


def _validate_reliability(cfg: Config) -> None:
    r = cfg.reliability
    _choice("reliability.nan_action", r.nan_action, ("skip", "halt", "rollback", "none"))
    _choice("reliability.spike_action", r.spike_action, ("skip", "halt", "rollback", "none"))
    if (r.spike_sigma <= 0 or r.spike_warmup < 1 or r.hang_timeout_s < 0 or r.first_step_timeout_s <= 0
            or r.fingerprint_every < 0 or r.straggler_every < 0 or r.straggler_factor <= 1 or r.replay_every < 0
            or r.max_restarts < 0 or r.max_rollbacks < 0 or r.max_consecutive_skips < 0 or r.restore_timeout_s < 0
            or r.straggler_evict_after < 0):
        raise ConfigError("reliability.spike_sigma and first_step_timeout_s must be > 0, spike_warmup >= 1, "
                          "hang_timeout_s, restore_timeout_s, fingerprint_every, straggler_every, "
                          "straggler_evict_after, replay_every, "
                          "max_restarts, max_rollbacks and max_consecutive_skips >= 0 (0: off), "
                          "straggler_factor > 1")
    if not isinstance(r.preflight, bool):
        _choice("reliability.preflight", r.preflight, ("auto", "quick", "full", "off"))
    for key in ("compute_slack", "link_slack", "storage_slack", "peak_fraction"):
        if not 0 <= getattr(r, f"preflight_{key}") < 1:
            raise ConfigError(f"reliability.preflight_{key}={getattr(r, f'preflight_{key}')} must be in [0, 1)")
    d = cfg.drills
    if d.sleep_s < 0 or d.process < 0:
        raise ConfigError("drills.sleep_s and drills.process must be >= 0")
    if d.preflight_slow is not None:
        _choice("drills.preflight_slow", d.preflight_slow, ("matmul", "collective", "link", "storage"))
    for key in ("preflight_factor", "straggler_factor"):
        if getattr(d, key) < 1:
            raise ConfigError(f"drills.{key}={getattr(d, key)} must be >= 1")


def _validate_train(cfg: Config) -> None:
    t, o = cfg.train, cfg.optim
    _choice("train.cross_entropy", t.cross_entropy, ("auto", "xla", "fused", "pallas", "onepass"))
    if t.cross_entropy_tokens < 0:
        raise ConfigError(f"train.cross_entropy_tokens must be >= 0 (0: automatic), got {t.cross_entropy_tokens}")
    _choice("train.dtype", t.dtype, DTYPES)
    _choice("train.param_dtype", t.param_dtype, DTYPES)
    _choice("optim.schedule", o.schedule, SCHEDULES)
    _choice("optim.name", o.name, OPTIMIZERS)
    if o.muon.ns_steps < 1 or not 0.0 <= o.muon.beta < 1.0 or o.muon.rms_scale < 0:
        raise ConfigError(f"optim.muon needs ns_steps >= 1, 0 <= beta < 1 and rms_scale >= 0; got ns_steps="
                          f"{o.muon.ns_steps}, beta={o.muon.beta}, rms_scale={o.muon.rms_scale}")
    if t.batch_size % t.grad_accum:
        raise ConfigError(
            f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}")
    if o.lr < 0 or o.warmup_steps < 0 or o.weight_decay < 0:
        raise ConfigError("optim.lr, optim.warmup_steps and optim.weight_decay must be >= 0")
    if o.warmup_steps > t.steps:
        log.warning("optim.warmup_steps=%d is more than train.steps=%d: the learning rate never reaches "
                    "optim.lr=%g (the last step's is %.3g)", o.warmup_steps, t.steps, o.lr,
                    o.lr * (t.steps - 1) / o.warmup_steps)
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    _validate_groups(o)
    _choice("train.fp8.recipe", t.fp8.recipe, FP8_RECIPES)
    if t.fp8.amax_history < 1:
        raise ConfigError(f"train.fp8.amax_history must be >= 1 (steps of amaxes kept), got {t.fp8.amax_history}")
    if t.fp8.recipe == "delayed" and cfg.mesh.pipeline > 1:
        raise ConfigError("train.fp8.recipe=delayed with mesh.pipeline > 1: a stage runs its weights once per pipeline "
                          "microbatch, so their amaxes would add up instead of taking the largest; use tensorwise "
                          "or rowwise")
    if t.fp8.all_gather and t.fp8.recipe not in ("tensorwise", "delayed"):
        raise ConfigError(f"train.fp8.all_gather needs train.fp8.recipe tensorwise or delayed (one scale per weight), "
                          f"got {t.fp8.recipe}")
    if t.sample_every < 0 or t.sample_tokens < 1:
        raise ConfigError(f"train.sample_every must be >= 0 and train.sample_tokens >= 1, "
                          f"got {t.sample_every} and {t.sample_tokens}")


GROUP_KEYS = {"params": str, "lr_scale": float, "weight_decay": float, "frozen_until": int, "rows_from": int,
              "rows_until": int}


def _validate_groups(o: OptimConfig) -> None:
    """`optim.groups`: a list of mappings with known keys, a regex that compiles, numbers >= 0."""
    import re

    if not isinstance(o.groups, (list, tuple)):
        raise ConfigError("optim.groups must be a list of {params: REGEX, lr_scale, weight_decay, frozen_until, "
                          "rows_from, rows_until}")
    for i, g in enumerate(o.groups):
        if not isinstance(g, dict) or "params" not in g:
            raise ConfigError(f"optim.groups[{i}] must be a mapping with a params regex, e.g. "
                              "{params: '^embed/', frozen_until: 1000}")
        unknown = sorted(set(g) - set(GROUP_KEYS))
        if unknown:
            raise ConfigError(f"optim.groups[{i}]: unknown key {unknown[0]!r}; the keys are {', '.join(GROUP_KEYS)}")
        try:
            re.compile(str(g["params"]))
        except re.error as e:
            raise ConfigError(f"optim.groups[{i}].params {g['params']!r} is not a regular expression: {e}") from None
        for key, kind in GROUP_KEYS.items():
            if key == "params" or key not in g:
                continue
            v = g[key]
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or float(v).is_integer())
            if not ok or v < 0 or not math.isfinite(v):
                raise ConfigError(f"optim.groups[{i}].{key}={v!r} must be a {'number' if kind is float else 'step'} >= 0")
        if "rows_until" in g and "rows_from" not in g:
            raise ConfigError(f"optim.groups[{i}]: rows_until needs rows_from (the first row that trains before it)")


def _validate_mesh(cfg: Config) -> None:
    for size_key in MESH_AXES:
        size = getattr(cfg.mesh, size_key)
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{size_key}={size} must be a positive integer or -1 (fill)")
    if sum(getattr(cfg.mesh, a) == -1 for a in MESH_AXES) > 1:
        raise ConfigError("at most one mesh axis may be -1; set the others to explicit sizes")


def _validate_data_and_checkpoints(cfg: Config) -> None:
    t = cfg.train
    if t.eval_every < 0 or cfg.data.workers < 0 or cfg.data.prefetch < 1:
        raise ConfigError("train.eval_every and data.workers must be >= 0, data.prefetch >= 1")
    if not 0 <= cfg.data.synthetic_doc_len < t.seq_len:
        raise ConfigError(f"data.synthetic_doc_len={cfg.data.synthetic_doc_len} must be 0 (one document per row) "
                          f"or a mean document length below train.seq_len={t.seq_len}")
    _validate_paths(cfg)
    c = cfg.checkpoint
    if c.every < 0 or c.keep < 1 or (c.keep_every is not None and c.keep_every < 1):
        raise ConfigError("checkpoint.every must be >= 0, checkpoint.keep >= 1 and checkpoint.keep_every >= 1 or null")
    lc = c.local
    if lc.dir is not None:
        if lc.every < 1 or lc.keep < 1:
            raise ConfigError(f"checkpoint.local.every and checkpoint.local.keep must be >= 1, got {lc.every} and "
                              f"{lc.keep}")
        _choice("checkpoint.local.replica_of", lc.replica_of, ("ring", "none"))
        if c.dir and os.path.realpath(lc.dir) == os.path.realpath(c.dir):
            raise ConfigError(f"checkpoint.local.dir={lc.dir} is checkpoint.dir; give the local tier its own "
                              f"node-local directory")


def _validate_paths(cfg: Config) -> None:
    """Every path the config names is a local or shared-filesystem path, or, where the key takes one
    (prepared tokens: `data.path`, `data.eval_path` with data.kind=tokens; `run_dir`,
    `checkpoint.dir`, `checkpoint.init_from`, `checkpoint.resume_from`), an s3:// or gs:// URL
    (`storage.path_problem`)."""
    c = cfg.checkpoint
    named = [("checkpoint.local.dir", c.local.dir), ("reliability.compilation_cache", cfg.reliability.compilation_cache),
             ("object_cache", cfg.object_cache)]
    sources = [("run_dir", cfg.run_dir), ("checkpoint.dir", c.dir), ("checkpoint.init_from", c.init_from),
               ("checkpoint.resume_from", c.resume_from)]
    urls = cfg.data.kind == "tokens"
    data = [("data.path", p) for p in storage.mixture_paths(cfg.data.path)]
    data += [("data.eval_path", p) for p in storage.mixture_paths(cfg.data.eval_path)]
    problems = [line for key, path in named if (line := storage.path_problem(key, path))]
    problems += [line for key, path in sources if (line := storage.path_problem(key, path, urls=True))]
    for key, path in data:
        if storage.is_url(path) and not urls:
            problems.append(f"{key}: s3:// and gs:// data must be prepared tokens (data.kind=tokens); run `maxtrain "
                            f"prepare --input URL --output s3://BUCKET/PREFIX` and train from that prefix")
        elif line := storage.path_problem(key, path, urls=True):
            problems.append(line)
    if problems:
        raise ConfigError(problems[0], problems)


def _validate_sharding(cfg: Config) -> None:
    for section in ("params", "activations"):
        for name, axes in getattr(cfg.sharding, section).items():
            for ax in axes if isinstance(axes, list) else [axes]:
                if ax is not None and ax not in MESH_AXES:
                    raise ConfigError(
                        f"sharding.{section}.{name}={ax!r} is not a mesh axis; use one of "
                        f"{', '.join(MESH_AXES)}, a list of them, or null")


def _validate_observability(cfg: Config) -> None:
    lg, p = cfg.logging, cfg.profile
    if lg.breakdown_every is not None and lg.breakdown_every < 1:
        raise ConfigError(f"logging.breakdown_every must be a positive integer or null (every log line), "
                          f"got {lg.breakdown_every}")
    if lg.wandb and not _importable("wandb"):
        raise ConfigError(f"logging.wandb=true but the wandb package is not installed; "
                          f"{_install_hint('wandb', 'wandb')}, or set logging.wandb=false")
    if p.start_step is not None and p.start_step < 1 or p.steps < 1:
        raise ConfigError(f"profile.start_step must be >= 1 or null and profile.steps >= 1, "
                          f"got {p.start_step} and {p.steps}")
    _choice("profile.tracer", p.tracer, ("jax", "nsys"))


def require_module(module: str, package: str, feature: str, extra: str | None = None):
    """Imports `module` for `feature`, or raises a ConfigError naming the package to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{feature} needs the {package} package, which is not installed; "
                          f"{_install_hint(package, extra)}") from None


def _install_hint(package: str, extra: str | None) -> str:
    return f"pip install 'maxtrain[{extra}]' (or pip install {package})" if extra else f"pip install {package}"


def _importable(name: str) -> bool:
    """Whether `import name` would find a module, without importing it (wandb takes seconds)."""
    import importlib.util
    import sys

    if name in sys.modules:
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


def pipeline_microbatches(cfg: Config) -> int:
    """`train.microbatches`, defaulting to one per stage."""
    return cfg.train.microbatches or cfg.mesh.pipeline


def unpipelined(cfg: Config) -> Config:
    """The same run without pipeline stages: layer stacks in their flat `[layers, ...]` layout."""
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, pipeline=1),
                               train=dataclasses.replace(cfg.train, pipeline_repeats=1, microbatches=None))


def _validate_pipeline(cfg: Config) -> None:
    t, S, R = cfg.train, cfg.mesh.pipeline, cfg.train.pipeline_repeats
    if t.microbatches is not None and t.microbatches < 1 or R < 1:
        raise ConfigError("train.microbatches must be a positive integer or null, train.pipeline_repeats >= 1")
    if t.pipeline_schedule not in schedules.SCHEDULES:
        raise ConfigError(f"train.pipeline_schedule={t.pipeline_schedule!r} is not a schedule; "
                          f"{did_you_mean(t.pipeline_schedule, schedules.SCHEDULES)}choose one of "
                          f"{', '.join(schedules.SCHEDULES)}")
    if S == 1:
        return
    m = cfg.model
    if m.moe is not None and m.moe.bias_update_rate > 0:
        raise ConfigError(f"model.moe.bias_update_rate={m.moe.bias_update_rate} with mesh.pipeline={S}: the "
                          f"balancing bias follows each layer's load, which pipeline stages do not report; use "
                          f"mesh.pipeline=1 or model.moe.bias_update_rate=0 (balance with model.moe.aux_loss_coef)")
    if S == -1:
        raise ConfigError("mesh.pipeline must be an explicit size (-1 is only for the other axes)")
    n = m.stack_length()
    what = f"model.n_layers={m.n_layers}" + (f" ({n} elements in the layer stack)" if n != m.n_layers else "")
    if n % (S * R):
        raise ConfigError(f"{what} is not divisible by mesh.pipeline x train.pipeline_repeats = {S}x{R}; "
                          f"choose them so their product divides {n}")
    M = pipeline_microbatches(cfg)
    if M < S:
        raise ConfigError(f"train.microbatches={M} is fewer than the {S} pipeline stages; use at least {S} "
                          f"(the bubble is (S-1)/(M*R+S-1))")
    problem = schedules.check(t.pipeline_schedule, S, M, R)
    if problem:
        raise ConfigError(f"train.pipeline_schedule={t.pipeline_schedule} with mesh.pipeline={S}, "
                          f"train.microbatches={M}, train.pipeline_repeats={R}: {problem}")
    if (t.batch_size // t.grad_accum) % M:
        raise ConfigError(f"train.batch_size={t.batch_size} / train.grad_accum={t.grad_accum} is not divisible by "
                          f"train.microbatches={M}")


def resolve_mesh_shape(mesh: MeshConfig, n_devices: int) -> dict[str, int]:
    """Axis sizes with `-1` filled so their product is `n_devices`."""
    sizes = {a: getattr(mesh, a) for a in MESH_AXES}
    fixed = 1
    for v in sizes.values():
        if v != -1:
            fixed *= v
    fill = [a for a, v in sizes.items() if v == -1]
    if fill:
        if n_devices % fixed:
            raise ConfigError(
                f"mesh sizes {_mesh_str(sizes)} multiply to {fixed}, which does not divide the "
                f"{n_devices} devices; choose sizes whose product divides {n_devices}")
        sizes[fill[0]] = n_devices // fixed
    elif fixed != n_devices:
        raise ConfigError(
            f"mesh sizes {_mesh_str(sizes)} multiply to {fixed} but there are {n_devices} devices; "
            f"make the product {n_devices} or set one axis to -1"
            + (" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N fakes N devices)"
               if fixed > n_devices else ""))
    return sizes


def _mesh_str(sizes: dict) -> str:
    return ",".join(f"{a}={v}" for a, v in sizes.items() if v != 1) or "all 1"


def axes_size(axes, sizes: dict[str, int]) -> int:
    """Number of shards a rule value (axis, list of axes, or None) splits a dimension into."""
    n = 1
    for ax in axes if isinstance(axes, list) else [axes]:
        if ax is not None:
            n *= sizes[ax]
    return n


def validate_for_mesh(cfg: Config, sizes: dict[str, int]) -> None:
    """Checks that depend on the resolved mesh: batch and length divisibility."""
    t = cfg.train
    dp = axes_size(cfg.sharding.activations.get("batch"), sizes)
    micro = t.batch_size // t.grad_accum
    if micro % dp:
        raise ConfigError(
            f"train.batch_size={t.batch_size} with train.grad_accum={t.grad_accum} gives {micro} "
            f"sequences per microbatch, not divisible by the {dp}-way data parallelism "
            f"(sharding.activations.batch over {_mesh_str(sizes)}); use a multiple of {dp * t.grad_accum}")
    if cfg.mesh.pipeline > 1:
        inner = {**sizes, "pipeline": 1}  # inside a stage the pipeline axis does not split the batch
        M, dpi = pipeline_microbatches(cfg), axes_size(cfg.sharding.activations.get("batch"), inner)
        if (micro // M) % dpi:
            raise ConfigError(
                f"a pipeline microbatch has {micro // M} sequences (train.batch_size={t.batch_size} / grad_accum "
                f"{t.grad_accum} / microbatches {M}), not divisible by the {dpi}-way data parallelism inside a "
                f"stage; use train.batch_size a multiple of {dpi * M * t.grad_accum}")
    stored_embed = axes_size(cfg.sharding.params.get("embed"), sizes)
    if t.fp8.all_gather and stored_embed == 1:
        raise ConfigError(f"train.fp8.all_gather quantizes weights before the FSDP all-gather, and nothing shards "
                          f"them ({_mesh_str(sizes)}, sharding.params.embed={cfg.sharding.params.get('embed')}); "
                          f"set mesh.fsdp > 1 or train.fp8.all_gather=false")
    sp = axes_size(cfg.sharding.activations.get("length"), sizes)
    if t.seq_len % sp:
        raise ConfigError(
            f"train.seq_len={t.seq_len} is not divisible by the {sp}-way sequence sharding; "
            f"use a multiple of {sp}")
    batch_axes = cfg.sharding.activations.get("batch")
    if cfg.model.moe is not None and sizes.get("expert", 1) > 1 and "expert" not in (
            batch_axes if isinstance(batch_axes, list) else [batch_axes]):
        raise ConfigError("mesh.expert > 1 runs the experts expert-parallel over tokens sharded along `expert`; "
                          "add expert to sharding.activations.batch (default: [data, fsdp, expert])")
    split = axes_size(cfg.sharding.activations.get("block_length"), sizes)
    if cfg.model.attention in ("flash", "flash_mosaic") and split > 1:
        raise ConfigError(
            f"model.attention={cfg.model.attention} attends over whole sequences: with queries split {split} ways "
            f"along length (sharding.activations.block_length over {_mesh_str(sizes)}) every device of that split "
            f"would compute all of it; use model.attention=ring for context parallelism")
    n = sizes.get("sequence", 1)
    cfg.model.validate_for_mesh(cfg, sizes)
    if cfg.model.attention == "ring" and cfg.model.ring_layout == "zigzag" and n > 1 and t.seq_len % (2 * n):
        raise ConfigError(
            f"train.seq_len={t.seq_len} is not divisible by 2 x mesh.sequence={2 * n} (zig-zag ring attention "
            f"gives each device two chunks); use a multiple of {2 * n} or set model.ring_layout=contiguous")
