"""Hugging Face interchange (`maxtrain convert`): `config.json` + safetensors <-> a maxtrain
checkpoint, for every family that registers an `HFConversion` (`maxtrain.models.registry`): config.json's
`model_type` picks the family on import, `model.name` on export. The family says what its names and
layouts are; this module does the files: reading config.json and safetensors (through
`maxtrain.models.hf_common`), writing them, the tokenizer and the checkpoint.

Inputs are untrusted: config.json values, the shard index and every safetensors header are checked
(shapes against config.json) before any tensor is read. Outputs are written to a temporary sibling
and renamed into place, and never replace anything the user has.

What the weights need to be used comes along both ways: a converted checkpoint keeps its source's
special-token ids, `max_position_embeddings` and `generation_config.json` (in its meta) and tokenizer
files (in `hf_source/` beside the step directories); an export writes them back, with the tokenizer
the model was trained with (`export_tokenizer`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil

import numpy as np

from maxtrain import storage
from maxtrain.config import Config, ConfigError, ModelConfig, default_family
from maxtrain.models import registry
from maxtrain.models.hf_common import (hf_tensors, positive_int, read_json,  # noqa: F401
                                        safetensors_header)  # (safetensors_header: public here too)
from maxtrain.outputs import building

SHARD_BYTES = 5 * 2**30  # safetensors file size, as HF's save_pretrained

log = logging.getLogger("maxtrain")


# ---------------------------------------------------------------- the family's conversion


def family_of_hf(hf: dict) -> registry.Model:
    """The family that converts a `config.json` (its `model_type`; none: the default family's first)."""
    if not isinstance(hf, dict):
        raise ConfigError(f"config.json is not a JSON object (found {type(hf).__name__})")
    kind = hf.get("model_type") or registry.get(default_family()).hf.model_types[0]
    return registry.for_hf_model_type(kind)


def conversion(m: ModelConfig) -> registry.HFConversion:
    """The Hugging Face conversion of `m`'s family (a one-line error for a family without one)."""
    hf = registry.get(m.name).hf
    if hf is None:
        raise ConfigError(f"model.name={m.name!r} has no Hugging Face conversion; the families that convert: "
                          f"{', '.join(registry.families_with('hf'))}")
    return hf


def model_config_from_hf(hf: dict) -> ModelConfig:
    """The model config of an HF `config.json` dict, by its family."""
    return family_of_hf(hf).hf.config_from_hf(hf)


def hf_config_from_model(m: ModelConfig, *, rope_format: str = "legacy", dtype: str = "float32",
                         max_position: int = 8192) -> dict:
    """An HF `config.json` dict; `rope_format` "legacy" (rope_theta/rope_scaling) or "parameters"."""
    return conversion(m).config_to_hf(m, rope_format=rope_format, dtype=dtype, max_position=max_position)


def params_to_hf(params: dict, m: ModelConfig) -> dict[str, np.ndarray]:
    """maxtrain params (numpy) -> HF state dict names and `[out, in]` layouts."""
    return conversion(m).params_to_hf(params, m)


def params_from_hf(get, m: ModelConfig) -> dict:
    """HF tensors (`get(name) -> numpy array`) -> maxtrain params (numpy)."""
    return conversion(m).params_from_hf(get, m)


def hf_shapes(m: ModelConfig):
    """(name, shape) of every tensor an HF checkpoint of `m` holds, as `config.json` implies."""
    return conversion(m).hf_shapes(m)


# ---------------------------------------------------------------- files


def read_hf_config(hf_dir: str) -> ModelConfig:
    """The ModelConfig of an HF model directory's `config.json`."""
    path = os.path.join(hf_dir, "config.json")
    hf = read_json(path, "give a Hugging Face model directory")
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} is not a JSON object (found {type(hf).__name__}); give a model's config.json")
    try:
        return model_config_from_hf(hf)
    except ConfigError as e:
        raise ConfigError(f"{hf_dir}: {e}") from None


def read_hf_params(hf_dir: str, m: ModelConfig, param_dtype: str = "float32") -> dict:
    """numpy params of `m` from an HF directory's safetensors, every tensor checked against `m` first."""
    from safetensors import safe_open

    family = conversion(m)
    if family.read_params is not None:  # a layout that also depends on config.json (DeepSeek's rope_interleave)
        return family.read_params(hf_dir, m, param_dtype)
    found = hf_tensors(hf_dir)
    family.check_tensors(found, m, hf_dir)
    handles = {path: safe_open(path, framework="flax") for path in sorted({f for f, _ in found.values()})}
    return params_from_hf(lambda name: np.asarray(handles[found[name][0]].get_tensor(name).astype(param_dtype)), m)


def read_hf(hf_dir: str, param_dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """(ModelConfig, numpy params) from an HF model directory (safetensors, bf16/f16/f32)."""
    m = read_hf_config(hf_dir)
    return m, read_hf_params(hf_dir, m, param_dtype)


# ---------------------------------------------------------------- output


def check_output_dir(out_dir: str) -> None:
    """Refuses an output that exists as anything but an empty directory (nothing of the user's is replaced)."""
    if not out_dir:
        raise ConfigError("the output path is empty; give a new directory")
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"output {out_dir} exists and is not a directory; choose a new directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ConfigError(f"output {out_dir} is not empty; choose a new directory")


def output_dir(out_dir: str):
    """`maxtrain.outputs.building` a new or empty `out_dir` (checked first)."""
    check_output_dir(out_dir)
    return building(out_dir)


def write_hf(out_dir: str, params: dict, m: ModelConfig, *, dtype: str = "float32",
             rope_format: str = "legacy", fields: dict | None = None) -> list[str]:
    """Writes `config.json` and safetensors (sharded past 5 GiB, with an index) as a new directory `out_dir`."""
    with output_dir(out_dir) as tmp:
        return _write_hf_files(tmp, params, m, dtype=dtype, rope_format=rope_format, fields=fields)


def _write_hf_files(out_dir: str, params: dict, m: ModelConfig, *, dtype: str, rope_format: str,
                    fields: dict | None = None) -> list[str]:
    """The safetensors and `config.json`: the model's keys, then `fields` (special-token ids,
    `max_position_embeddings`) over them."""
    import jax.numpy as jnp
    from safetensors.flax import save_file

    kept = conversion(m).tensor_dtype or (lambda name, dtype: dtype)
    tensors = {k: jnp.asarray(v, dtype=kept(k, dtype)) for k, v in params_to_hf(params, m).items()}
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        if current and size + t.nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += t.nbytes
    shards.append(current)
    files = []
    if len(shards) == 1:
        files.append("model.safetensors")
        save_file(shards[0], os.path.join(out_dir, files[0]), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            files.append(name)
        total = sum(t.nbytes for t in tensors.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**hf_config_from_model(m, rope_format=rope_format, dtype=dtype), **(fields or {})}, f, indent=2)
    return files


def config_with_model(base: Config, m: ModelConfig) -> Config:
    """`base` with its model section replaced by the converted one (keeping attention and remat)."""
    return dataclasses.replace(base, model=dataclasses.replace(
        m, attention=base.model.attention, remat=base.model.remat, init_std=base.model.init_std))


# ---------------------------------------------------------------- what comes with the weights
# A model is usable in transformers with its tokenizer, its end-of-text id (generation stops there)
# and its context length. hf-to-maxtrain keeps the source's; maxtrain-to-hf writes them back, with
# the tokenizer the model was trained with when that is another.

HF_META = "hf"  # a converted step's meta key: what config.json says beyond the model (`source_settings`)
SOURCE_DIR = "hf_source"  # beside a converted checkpoint's step directories: the source's tokenizer files
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt")
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
BYTE_EOS_TOKEN = "<|endoftext|>"  # the byte tokenizer's EOS (id 256) in the exported tokenizer.json
DEFAULT_MAX_POSITION = 8192  # config.json's max_position_embeddings when nothing says otherwise
NO_TOKENIZER_NOTE = "README.md"  # written into an export that has no tokenizer, saying why


def _token_ids(v) -> bool:
    """An id (int >= 0) or a non-empty list of ids, as config.json's special-token keys hold."""
    ids = v if isinstance(v, list) and v else [v]
    return all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)


EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # what maxtrain-to-hf writes weights in


def export_dtype(requested: str | None, source: "Source | None") -> str:
    """The weights' dtype of an export: `--dtype`, else the dtype of the HF model the checkpoint was
    converted from (its config.json's `torch_dtype`), else float32 (what training keeps)."""
    if requested is not None:
        return requested
    return ((source.settings.get("config") or {}).get("torch_dtype") if source else None) or "float32"


def source_settings(hf_dir: str) -> dict:
    """What a conversion keeps of its source beyond the model: config.json's special-token ids and
    `max_position_embeddings`, and `generation_config.json` (None when absent)."""
    hf = read_json(os.path.join(hf_dir, "config.json"), "give a Hugging Face model directory")
    kept = {k: hf[k] for k in SPECIAL_IDS if hf.get(k) is not None and _token_ids(hf[k])}
    try:
        n = positive_int(hf, "max_position_embeddings", None)
    except ConfigError as e:
        raise ConfigError(f"{hf_dir}: {e}") from None
    if n is not None:
        kept["max_position_embeddings"] = n
    dtype = hf.get("torch_dtype", hf.get("dtype"))  # transformers 5 writes `dtype`
    if dtype in EXPORT_DTYPES:
        kept["torch_dtype"] = dtype
    path = os.path.join(hf_dir, "generation_config.json")
    generation = read_json(path, "give the model's generation_config.json") if os.path.isfile(path) else None
    if generation is not None and not isinstance(generation, dict):
        raise ConfigError(f"{path} is not a JSON object; give the model's generation_config.json or remove it")
    return {"config": kept, "generation_config": generation}


def copy_tokenizer_files(src_dir: str, dst_dir: str) -> list[str]:
    """Copies the HF tokenizer files (`TOKENIZER_FILES`) `src_dir` holds into `dst_dir`; their names."""
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(src_dir, n))]
    if names:
        os.makedirs(dst_dir, exist_ok=True)
    for name in names:  # copyfile follows links (the HF hub cache links files to blobs)
        shutil.copyfile(os.path.join(src_dir, name), os.path.join(dst_dir, name))
    return names


@dataclasses.dataclass(frozen=True)
class Source:
    """The Hugging Face model a checkpoint was converted from, as the conversion kept it."""
    settings: dict  # `source_settings`
    files_dir: str | None  # its tokenizer files, when it had any and they are still here
    converted: bool  # the checkpoint is the conversion itself (not trained since)


def _newest_meta(path: str) -> tuple[str, dict]:
    """(the checkpoint directory, the meta of its newest step that reads) of a checkpoint or step path."""
    from maxtrain.checkpoint import CorruptCheckpoint, open_path

    ckpt, steps = open_path(path, "checkpoint")
    for step in reversed(steps):
        try:
            return ckpt.directory, ckpt.read_meta(step)
        except CorruptCheckpoint:
            continue
    return ckpt.directory, {}


def conversion_source(path: str, max_hops: int = 16) -> Source | None:
    """The HF source of the checkpoint at `path`: its own conversion, or the one it was trained from
    through `checkpoint.init_from` (followed back run by run); None when there is none or it is gone."""
    for hop in range(max_hops):
        root, meta = _newest_meta(path)
        if HF_META in meta or "source" in meta:  # "source" alone: converted before conversions kept settings
            return _kept_source(root, meta, converted=hop == 0)
        init = ((meta.get("config") or {}).get("checkpoint") or {}).get("init_from")
        if not init:
            return None
        if storage.is_url(init):  # its meta from the bucket (one object), its own files copied, not its arrays
            return _remote_source(init)
        if not os.path.isabs(init) and isinstance(meta.get("cwd"), str):  # relative to where training ran
            init = os.path.join(meta["cwd"], init)
        if not os.path.isdir(init):
            log.warning("%s was trained from checkpoint.init_from=%s, which is not here: its tokenizer, special "
                        "tokens and max_position_embeddings are unknown to the export (give --tokenizer)", path, init)
            return None
        path = init
    return None


def _remote_source(url: str) -> Source | None:
    """`conversion_source` of a checkpoint in a bucket that a run was initialised from: the meta of
    its newest step read alone, the directory's own files (a conversion's source) copied under the
    default object cache; its arrays are not fetched. Further init_from hops are not followed."""
    from maxtrain.checkpoint.manager import split_step_url, stage_checkpoint_files
    from maxtrain.checkpoint.meta import saved_metas

    meta = next(iter(saved_metas(url)), {})
    if not (HF_META in meta or "source" in meta):
        return None
    root, _ = split_step_url(url)
    return _kept_source(stage_checkpoint_files(root, storage.DEFAULT_CACHE, None), meta, converted=False)


def _kept_source(root: str, meta: dict, converted: bool) -> Source | None:
    files = os.path.join(root, SOURCE_DIR)
    files = files if os.path.isdir(files) else None
    settings = meta.get(HF_META)
    if settings is None:  # an older conversion: its source directory, if still where it was
        src = meta.get("source")
        if not (isinstance(src, str) and os.path.isfile(os.path.join(src, "config.json"))):
            return None
        settings = source_settings(src)
        files = src if any(os.path.isfile(os.path.join(src, n)) for n in TOKENIZER_FILES) else None
    return Source(settings, files, converted)


@dataclasses.dataclass(frozen=True)
class ExportTokenizer:
    """The tokenizer an export carries: the source's files, an HF model directory's files, one
    tokenizer.json or SentencePiece `.model`, or maxtrain's bytes (`kind`: source | dir | hf |
    sentencepiece | byte)."""
    kind: str
    path: str | None  # the directory or file it is copied from (None: byte)
    eos_id: int | None  # None for the source's (its config.json and generation_config.json say)


def export_tokenizer(cfg: Config, spec: str | None, source: Source | None, checkpoint: str) -> ExportTokenizer | None:
    """`spec` (`--tokenizer`; "none" for none), else the training data's tokenizer (of a trained
    `checkpoint`: the copy kept with it, else the data's manifest), else the source's. The training
    data's is the source's when its file is the same."""
    from maxtrain.generate import tokenizer_for

    if spec == "none":
        return None
    trained = source is None or not source.converted
    tok = tokenizer_for(cfg, spec, checkpoint) if spec or trained else None  # None: synthetic data
    if tok is None or _same_file(tok.spec, source):
        return ExportTokenizer("source", source.files_dir, None) if source and source.files_dir else None
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer {tok.spec} has {tok.vocab_size} tokens, more than the model's "
                          f"model.vocab_size={cfg.model.vocab_size}; give the model's own with --tokenizer")
    if tok.kind == "byte":
        return ExportTokenizer("byte", None, tok.eos_id)
    folder = os.path.dirname(tok.spec)
    if os.path.basename(tok.spec) in TOKENIZER_FILES and os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        return ExportTokenizer("dir", folder, tok.eos_id)  # an HF model's: all its files
    return ExportTokenizer(tok.kind, tok.spec, tok.eos_id)


def _same_file(path: str, source: Source | None) -> bool:
    """Whether tokenizer file `path` has the bytes of the source's file of its kind."""
    if source is None or source.files_dir is None or path == "byte":
        return False
    theirs = os.path.join(source.files_dir, "tokenizer.model" if path.endswith(".model") else "tokenizer.json")
    if not os.path.isfile(theirs) or os.path.getsize(theirs) != os.path.getsize(path):
        return False
    with open(path, "rb") as a, open(theirs, "rb") as b:
        return a.read() == b.read()


def export_fields(source: Source | None, tok: ExportTokenizer | None, seq_len: int | None) -> tuple[dict, dict]:
    """(config.json keys, generation_config.json) beyond the model: the special-token ids (the
    source's with its tokenizer, else the exported tokenizer's EOS) and `max_position_embeddings`:
    the source's, or the trained `seq_len` when longer (`seq_len` None: not trained)."""
    kept = dict(source.settings["config"]) if source else {}
    lengths = [n for n in (kept.pop("max_position_embeddings", None), seq_len) if n]
    fields = {"max_position_embeddings": max(lengths) if lengths else DEFAULT_MAX_POSITION}
    if tok is not None and tok.kind != "source":
        ids = {"bos_token_id": None, "eos_token_id": tok.eos_id, "pad_token_id": None}
        generation = None
    else:
        ids = {k: kept.get(k) for k in SPECIAL_IDS}
        generation = source.settings.get("generation_config") if source else None
    generation = {**{k: v for k, v in ids.items() if v is not None}, **(generation or {})}
    return {**ids, **fields}, generation


def _no_tokenizer(spec: str | None, cfg: Config, source: Source | None) -> str:
    """Why an export has no tokenizer (when `export_tokenizer` found none)."""
    if spec == "none":
        return "--tokenizer none"
    if source is not None and source.converted:
        return "the Hugging Face model it was converted from had no tokenizer files"
    return (f"its training data names none (data.kind={cfg.data.kind})" +
            ("" if source is None else ", and the Hugging Face model it started from left no tokenizer files"))


def _write_byte_tokenizer(out_dir: str) -> None:
    """maxtrain's byte tokenizer as a `tokenizer.json`: each byte's id its value, EOS 256."""
    from maxtrain.config import require_module

    tk = require_module("tokenizers", "tokenizers", "exporting the byte tokenizer as tokenizer.json", "data")
    from maxtrain.data.tokenizers import byte_of_char

    tok = tk.Tokenizer(tk.models.BPE(vocab=dict(byte_of_char()), merges=[]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.add_special_tokens([tk.AddedToken(BYTE_EOS_TOKEN, special=True)])
    tok.save(os.path.join(out_dir, "tokenizer.json"))


def _token_name(tok: ExportTokenizer, i: int) -> str:
    if tok.kind == "sentencepiece":
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=tok.path).id_to_piece(i)
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tok.path).id_to_token(i)


def write_tokenizer(out_dir: str, tok: ExportTokenizer | None, max_position: int, why: str) -> str | None:
    """Writes `tok`'s files into `out_dir` (a note instead when there is none; `why` says why); the
    problem, when no tokenizer was written."""
    if tok is not None and tok.kind in ("source", "dir"):
        copy_tokenizer_files(tok.path, out_dir)
        return None
    problem = why
    if tok is not None:
        try:
            if tok.kind == "byte":
                _write_byte_tokenizer(out_dir)
                eos = BYTE_EOS_TOKEN
            else:
                name = "tokenizer.model" if tok.kind == "sentencepiece" else "tokenizer.json"
                shutil.copyfile(tok.path, os.path.join(out_dir, name))
                eos = _token_name(tok, tok.eos_id)
            settings = {"tokenizer_class": "LlamaTokenizer" if tok.kind == "sentencepiece" else
                        "PreTrainedTokenizerFast", "eos_token": eos, "model_max_length": max_position,
                        "clean_up_tokenization_spaces": False}
            if tok.kind == "sentencepiece":  # maxtrain's data has no BOS: neither added here
                settings.update(add_bos_token=False, add_eos_token=False)
            with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
                json.dump(settings, f, indent=2)
            return None
        except ConfigError as e:  # the package that writes it is missing
            problem = str(e)
    with open(os.path.join(out_dir, NO_TOKENIZER_NOTE), "w") as f:
        f.write(f"# No tokenizer\n\nThis model was exported by `maxtrain convert maxtrain-to-hf` without a tokenizer: "
                f"{problem}.\n\nCopy the tokenizer files of the tokenizer it was trained with into this directory "
                f"(tokenizer.json and tokenizer_config.json, or tokenizer.model), or export again with "
                f"`--tokenizer PATH`.\n")
    return problem


# ---------------------------------------------------------------- commands


GROW_INITS = ("pieces", "mean", "random")


def grow_vocab(params: dict, m: ModelConfig, pieces: dict[int, list[int]], init: str = "pieces",
               seed: int = 0, pad_to: int = 1, base_size: int | None = None) -> tuple[dict, ModelConfig]:
    """`params` with an embedding row (and, untied, an output-projection column) for every id of
    `pieces` (new id -> the base ids that spell it), and the model config with its `vocab_size`
    grown to hold them. Every other row and column is kept bit for bit, so the logits of the old
    ids are unchanged (rows a model holds past its tokenizer's tokens, unused padding, are taken by
    the first new ids). A new row is `init`: "pieces", the mean of its base pieces' rows (the usual
    choice: the model starts out reading a new token as the pieces it replaces); "mean", the mean of
    every base row (the first `base_size`: the base tokenizer's, not a model's unused padding; a token
    that spells to no base piece gets that mean too); "random", normal around that mean with the
    base rows' spread (seeded). The
    vocabulary is padded with zero rows to a multiple of `pad_to` (the sharding's; an export drops them)."""
    if init not in GROW_INITS:
        raise ConfigError(f"--grow-init {init}: one of {', '.join(GROW_INITS)}")
    if "embed" not in params or "embedding" not in params["embed"]:
        raise ConfigError(f"model.name={m.name!r}: growing the vocabulary needs the embed.embedding parameter")
    size = max([m.vocab_size] + [i + 1 for i in pieces])
    size = -(-size // max(pad_to, 1)) * max(pad_to, 1)
    ids = np.asarray(sorted(pieces), np.int64)
    rng = np.random.default_rng(seed)

    def grown(table_VD: np.ndarray) -> np.ndarray:
        table_VD = np.asarray(table_VD)
        base = table_VD[:min(base_size or m.vocab_size, m.vocab_size)].astype(np.float64)
        if init == "pieces":
            rows = (np.stack([base[pieces[i]].mean(axis=0) if pieces[i] else base.mean(axis=0) for i in ids])
                    if len(ids) else base[:0])
        elif init == "mean":
            rows = np.broadcast_to(base.mean(axis=0), (len(ids), base.shape[1]))
        else:
            rows = base.mean(axis=0) + base.std(axis=0) * rng.standard_normal((len(ids), base.shape[1]))
        out = np.zeros((size, table_VD.shape[1]), table_VD.dtype)
        out[:table_VD.shape[0]] = table_VD
        out[ids] = rows.astype(table_VD.dtype)
        return out

    params = {**params, "embed": {**params["embed"], "embedding": grown(params["embed"]["embedding"])}}
    if not m.tie_embeddings:
        if "lm_head" not in params or "kernel" not in params["lm_head"]:
            raise ConfigError(f"model.name={m.name!r}: growing the vocabulary needs the lm_head.kernel parameter")
        params["lm_head"] = {**params["lm_head"], "kernel": grown(np.asarray(params["lm_head"]["kernel"]).T).T}
    return params, dataclasses.replace(m, vocab_size=size)


MEASURE_BYTES = 64 * 1024  # of each script's lines, at most, in `measure_growth`


def measure_growth(base: tuple, grown: tuple, texts) -> dict[str, dict]:
    """Bits per UTF-8 byte of each script's lines `texts` (a line's script: most of its letters';
    at most MEASURE_BYTES of each) under the base model on its own tokenization and under the grown
    model on the extended one, before any training: {script: {bytes, lines, base_bits_per_byte,
    grown_bits_per_byte}}. `base`, `grown`: (config, params, Tokenizer). Each line is scored whole
    after a newline token (in windows of `train.seq_len`), so both predict the same bytes."""
    from maxtrain import harness
    from maxtrain.data.scripts import script_shares

    lines: dict[str, list[str]] = {}
    size: dict[str, int] = {}
    for line in texts:
        line = line.strip()
        script = next(iter(script_shares([line])), "Common") if line else None
        if script is not None and size.get(script, 0) < MEASURE_BYTES:
            lines.setdefault(script, []).append(line)
            size[script] = size.get(script, 0) + len(line.encode())
    out = {s: {"bytes": size[s], "lines": len(ls)} for s, ls in sorted(lines.items())}
    for name, (cfg, params, tok) in (("base", base), ("grown", grown)):
        newline = tok.encode("\n")  # empty where a SentencePiece model strips whitespace: its end of text then
        score, sep, n = harness.make_scorer(cfg), newline[-1] if newline else tok.eos_id, cfg.train.seq_len
        for script, ls in sorted(lines.items()):
            pairs = [p for line in ls for p in harness.rolling_pairs(tok.encode(line), n, sep)]
            nats = -sum(lp for lp, _ in harness.score_pairs(score, params, pairs, n, 8, sep))
            out[script][f"{name}_bits_per_byte"] = nats / math.log(2) / out[script]["bytes"]
    return out


def growth_lines(measured: dict[str, dict]) -> list[str]:
    """`measure_growth`'s figures as a table."""
    rows = [f"{'script':<12} {'bytes':>9} {'base bits/byte':>15} {'grown bits/byte':>16} {'change':>8}"]
    for script, m in measured.items():
        b, g = m["base_bits_per_byte"], m["grown_bits_per_byte"]
        rows.append(f"{script:<12} {m['bytes']:>9,} {b:>15.3f} {g:>16.3f} {100 * (g - b) / b:>+7.1f}%")
    return rows


def hf_to_maxtrain(hf_dir: str, out_dir: str, base: Config, tokenizer: str | None = None,
                   grow_init: str = "pieces", pad_vocab_to: int | None = None, measure: str | None = None) -> str:
    """Converts an HF model directory into a params-only maxtrain checkpoint; returns its step dir.
    The source's tokenizer files go to `SOURCE_DIR` beside the step, its other settings into the meta.
    `tokenizer`: an extension of the model's tokenizer (`maxtrain tokenizer extend`): the model is
    grown to its vocabulary (`grow_vocab`) and it is the tokenizer kept instead; `measure`: a text
    file on which the grown model is measured against the base (`measure_growth`, logged and kept
    in the meta)."""
    from maxtrain.checkpoint import Checkpointer
    from maxtrain.config import CheckpointConfig, to_dict, validate

    cfg = config_with_model(base, read_hf_config(hf_dir))
    validate(cfg)
    settings = source_settings(hf_dir)
    pieces = None
    if tokenizer is not None:
        from maxtrain.data.tokenizers import new_token_pieces

        if grow_init not in GROW_INITS:
            raise ConfigError(f"--grow-init {grow_init}: one of {', '.join(GROW_INITS)}")
        if pad_vocab_to is not None and pad_vocab_to < 1:
            raise ConfigError(f"--pad-vocab-to {pad_vocab_to}: give a multiple >= 1 (e.g. 128)")
        base_size, pieces = new_token_pieces(hf_dir, tokenizer)
        if base_size > cfg.model.vocab_size:
            raise ConfigError(f"{hf_dir}: its tokenizer has {base_size} tokens, more than the model's vocab_size "
                              f"{cfg.model.vocab_size}; it is not this model's tokenizer")
    elif pad_vocab_to is not None:
        raise ConfigError("--pad-vocab-to pads a vocabulary grown with --tokenizer; give --tokenizer too")
    if measure is not None and (tokenizer is None or not os.path.isfile(measure)):
        raise ConfigError(f"--measure {measure}: " + ("give --tokenizer too (it measures a grown vocabulary)"
                                                       if tokenizer is None else "no such file"))
    check_output_dir(out_dir)  # before reading gigabytes of weights
    params = read_hf_params(hf_dir, cfg.model, cfg.train.param_dtype)
    grown = None
    if pieces is not None:
        before = cfg.model.vocab_size
        tokens = max([before] + [i + 1 for i in pieces])
        base_cfg, base_params = cfg, params
        params, model = grow_vocab(params, cfg.model, pieces, grow_init, cfg.seed, pad_vocab_to or 1, base_size)
        cfg = dataclasses.replace(cfg, model=model)
        validate(cfg)
        grown = {"from_vocab_size": before, "tokens": tokens, "vocab_size": model.vocab_size,
                 "new_tokens": len(pieces), "init": grow_init, "tokenizer": os.path.abspath(tokenizer)}
        if model.vocab_size > tokens:  # the export writes `tokens` rows
            settings = {**settings, "vocab_tokens": tokens}
        log.info("vocabulary grown from %d to %d (%d new tokens, rows initialised by %s%s)", before, tokens,
                 len(pieces), grow_init, f"; padded to {model.vocab_size}" if model.vocab_size > tokens else "")
        if measure is not None:
            from maxtrain.data.tokenizers import load_tokenizer, tokenizer_file

            ext = tokenizer_file(tokenizer)
            was = (base_cfg, base_params, load_tokenizer(tokenizer_file(hf_dir, prefer=os.path.splitext(ext)[1])))
            with open(measure, encoding="utf-8") as f:  # line by line: each script's first MEASURE_BYTES
                grown["measured"] = measure_growth(was, (cfg, params, load_tokenizer(ext)), f)
            log.info("measured on %s before training:\n%s", measure, "\n".join(growth_lines(grown["measured"])))
    with output_dir(out_dir) as tmp:
        kept = os.path.join(tmp, SOURCE_DIR)
        copy_tokenizer_files(hf_dir, kept)
        if tokenizer is not None:  # the extension's files replace the vocabulary (the source's config stays)
            for name in VOCABULARY_FILES:
                if os.path.exists(os.path.join(kept, name)):
                    os.unlink(os.path.join(kept, name))
            if os.path.isdir(tokenizer):
                copy_tokenizer_files(tokenizer, kept)
            else:  # a lone file, whatever its name: kept under the name its kind has
                os.makedirs(kept, exist_ok=True)
                shutil.copyfile(tokenizer, os.path.join(kept, "tokenizer.model" if tokenizer.endswith(".model")
                                                        else "tokenizer.json"))
        meta = {"seed": cfg.seed, "config": to_dict(cfg), "source": os.path.abspath(hf_dir), HF_META: settings}
        if grown is not None:
            meta["grown_vocab"] = grown
        kept = source_tokenizer_record(tmp)
        if kept is not None:  # generate and eval on the converted checkpoint read it without --tokenizer
            meta["tokenizer"] = kept
        ckpt = Checkpointer(tmp, CheckpointConfig(dir=tmp, async_=False, keep=1))
        try:
            ckpt.save(0, params, None, meta, wait=True)
            saved = ckpt.steps() == [0]  # a failed save is logged, not raised
        finally:
            ckpt.close()
        if not saved:
            raise ConfigError(f"writing the checkpoint {out_dir} failed (the error is logged above); nothing written")
    return os.path.join(os.path.abspath(out_dir), "0")


def without_vocab_padding(params: dict, m: ModelConfig, source: "Source | None") -> tuple[dict, ModelConfig]:
    """The params and model without the zero rows `--pad-vocab-to` added (the conversion recorded how
    many tokens there are: `vocab_tokens`), as an export writes them; unchanged otherwise."""
    tokens = (source.settings.get("vocab_tokens") if source else None) or m.vocab_size
    if tokens >= m.vocab_size:
        return params, m
    log.info("export: the vocabulary's %d padding rows dropped (%d tokens)", m.vocab_size - tokens, tokens)
    params = {**params, "embed": {**params["embed"], "embedding": params["embed"]["embedding"][:tokens]}}
    if not m.tie_embeddings:
        params["lm_head"] = {**params["lm_head"], "kernel": params["lm_head"]["kernel"][:, :tokens]}
    return params, dataclasses.replace(m, vocab_size=tokens)


def source_tokenizer_record(ckpt_dir: str) -> dict | None:
    """The checkpoint meta's `tokenizer` record (as `checkpoint.keep_tokenizer` writes it) for the
    source tokenizer copied into `ckpt_dir/SOURCE_DIR`: its tokenizer.json, else its SentencePiece
    tokenizer.model; None when the source had neither."""
    from maxtrain.data.manifest import sha256_file

    for name, kind in (("tokenizer.json", "hf"), ("tokenizer.model", "sentencepiece")):
        path = os.path.join(ckpt_dir, SOURCE_DIR, name)
        if os.path.isfile(path):
            return {"kind": kind, "file": f"{SOURCE_DIR}/{name}", "sha256": sha256_file(path)}
    return None


def maxtrain_to_hf(ckpt_path: str, out_dir: str, *, dtype: str | None = None, rope_format: str = "legacy",
                   tokenizer: str | None = None) -> list[str]:
    """Writes the params of a maxtrain checkpoint (latest good step, or a step dir) as an HF model,
    with its tokenizer (`export_tokenizer`; `tokenizer` is `--tokenizer`), special-token ids and
    context length (`export_fields`), in `dtype` (None: `export_dtype`'s default); returns the names
    of the files written."""
    import jax

    from maxtrain.checkpoint import load_checkpoint, saved_config
    from maxtrain.config import unpipelined

    check_output_dir(out_dir)  # before loading the checkpoint
    # a pipelined run's layer stacks are [repeats, stages, ...]: read them back in the flat layout
    saved = unpipelined(saved_config(ckpt_path))
    conversion(saved.model)  # a family without one: one line, before the weights load
    source = conversion_source(ckpt_path)
    dtype = export_dtype(dtype, source)
    log.info("weights in %s%s", dtype, " (the source model's; --dtype to change)" if source and
             (source.settings.get("config") or {}).get("torch_dtype") == dtype else "")
    tok = export_tokenizer(saved, tokenizer, source, ckpt_path)  # a bad --tokenizer before the weights load
    fields, generation = export_fields(source, tok, None if source and source.converted else saved.train.seq_len)
    cfg, params = load_checkpoint(ckpt_path, saved)
    params, model = without_vocab_padding(jax.device_get(params), cfg.model, source)
    with output_dir(out_dir) as tmp:
        _write_hf_files(tmp, params, model, dtype=dtype, rope_format=rope_format, fields=fields)
        if generation:
            with open(os.path.join(tmp, "generation_config.json"), "w") as f:
                json.dump(generation, f, indent=2)
        problem = write_tokenizer(tmp, tok, fields["max_position_embeddings"], _no_tokenizer(tokenizer, saved, source))
        names = sorted(os.listdir(tmp))
    if tok is not None and problem is None:
        log.info("tokenizer: %s", "maxtrain's bytes, written as tokenizer.json" if tok.kind == "byte" else
                 f"the files of {tok.path}" if tok.kind in ("source", "dir") else tok.path)
    if problem is not None:
        log.warning("the export %s has no tokenizer: %s (see %s there; --tokenizer names one)", out_dir, problem,
                    NO_TOKENIZER_NOTE)
    return names
