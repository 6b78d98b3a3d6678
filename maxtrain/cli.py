"""The `maxtrain` command."""

from __future__ import annotations

import argparse
import logging
import sys

from maxtrain import exit_codes, storage
from maxtrain.config import ConfigError

USER_ERROR = exit_codes.USER_ERROR


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # same one-line contract as config errors
        self.exit(USER_ERROR, f"maxtrain: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="maxtrain", description="JAX/XLA trainer for large language models")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_add_train_parser, _add_preflight_parser, _add_inspect_parser, _add_plan_parser, _add_launch_parser,
                _add_generate_parser, _add_eval_parser, _add_checkpoint_parser, _add_prepare_parser, _add_report_parser,
                _add_tokenizer_parser, _add_convert_parser):
        add(sub)  # in this order in --help
    return p


def _add_train_parser(sub) -> None:
    """`maxtrain train CONFIG [KEY=VALUE ...]`."""
    t = sub.add_parser("train", help="train from a YAML config with KEY=VALUE overrides")
    t.add_argument("config", help="YAML config path, e.g. configs/tiny.yaml")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. mesh.fsdp=4 train.steps=100")
    t.add_argument("--print-config", action="store_true",
                   help="print the resolved config (YAML, as run_dir/config.yaml would hold it) and exit")
    t.add_argument("--dry-run", action="store_true",
                   help="build the mesh, parameter shapes and shardings abstractly on this machine's devices and "
                        "print the parameter count and the train state's memory per device; nothing is compiled, "
                        "allocated or written")


def _add_preflight_parser(sub) -> None:
    """`maxtrain preflight CONFIG [KEY=VALUE ...]`."""
    pf = sub.add_parser("preflight", help="measure every device, link and disk of the job and name a sick node "
                                          "(what train runs first with reliability.preflight)")
    pf.add_argument("config")
    pf.add_argument("overrides", nargs="*")
    pf.add_argument("--mode", choices=("quick", "full"), default=None,
                    help="quick: small sizes, a few seconds; full (default): sizes near the step's")
    pf.add_argument("--out", default="preflight.json", help="the JSON report (default ./preflight.json)")


def _add_inspect_parser(sub) -> None:
    """`maxtrain inspect CONFIG [KEY=VALUE ...]`."""
    i = sub.add_parser("inspect", help="compile the train step and report memory, FLOPs and collectives")
    i.add_argument("config", help="YAML config path, e.g. configs/llama3-8b.yaml")
    i.add_argument("overrides", nargs="*", help="dotted overrides, e.g. mesh.fsdp=8 train.batch_size=64")
    i.add_argument("--devices", type=int, default=None,
                   help="compile for N fake CPU devices (a target cluster's device count) instead of this machine's")
    i.add_argument("--target", default=None, metavar="GPU",
                   help="compile for GPUs of this kind without one (h100, h200, a100; 8 per host): "
                        "XLA's CUDA compiler and the Pallas kernels, via jax's CUDA plugin; --devices "
                        "sets how many (default 8)")
    i.add_argument("--json", action="store_true", help="one JSON object instead of the table")


def _add_plan_parser(sub) -> None:
    """`maxtrain plan CONFIG [KEY=VALUE ...] --target GPU --devices N`."""
    pl = sub.add_parser("plan", help="choose the mesh, remat and microbatching for N devices from compiled programs")
    pl.add_argument("config", help="YAML config path, e.g. configs/llama3-70b.yaml")
    pl.add_argument("overrides", nargs="*", help="dotted overrides kept fixed, e.g. train.batch_size=256")
    pl.add_argument("--devices", type=int, default=8, help="how many devices to plan for (default 8)")
    pl.add_argument("--target", default=None, metavar="GPU",
                    help="plan for GPUs of this kind (h100, h200, a100; compiled without one, as inspect "
                         "--target); without it, for fake CPU devices")
    pl.add_argument("--hosts", type=int, default=None, help="hosts the devices are spread over (default: 8 per host)")
    pl.add_argument("--top", type=int, default=6, help="how many of the most promising layouts to compile (default 6)")
    pl.add_argument("--out", default="plan.yaml", help="where to write the best layout as a config (default plan.yaml)")
    pl.add_argument("--json", action="store_true", help="one JSON object instead of the table")


def _add_launch_parser(sub) -> None:
    """`maxtrain launch local ...`."""
    la = sub.add_parser("launch", help="run training as several processes (multi-host runtime on one machine)")
    lsub = la.add_subparsers(dest="where", required=True, parser_class=_Parser)
    lo = lsub.add_parser("local", help="N processes on this machine, output prefixed by rank, stopped together")
    lo.add_argument("--processes", type=int, required=True, help="number of processes (ranks)")
    lo.add_argument("--cpu-devices", type=int, default=None,
                    help="fake CPU devices per process (default: the GPUs split evenly, or 1 CPU device each)")
    lo.add_argument("--max-restarts", type=int, default=None,
                    help="restart all ranks after a failure up to R times (they resume from checkpoint.dir); "
                         "default: the config's reliability.max_restarts")
    lo.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                    help="after a rank fails, how long the others get after SIGTERM before SIGKILL")
    lo.add_argument("--backoff", type=float, default=1.0, metavar="SECONDS",
                    help="seconds before the first restart, doubling for each later one (at most 60)")
    lo.add_argument("config")
    lo.add_argument("overrides", nargs="*")


def _add_generate_parser(sub) -> None:
    """`maxtrain generate CHECKPOINT ...`."""
    g = sub.add_parser("generate", help="sample text from a checkpoint (prefill + KV-cached decode)")
    g.add_argument("checkpoint", help="a checkpoint directory (its newest good step) or one step directory")
    g.add_argument("overrides", nargs="*", help="dotted overrides of the saved config, e.g. mesh.fsdp=8 "
                                                "train.dtype=float32")
    g.add_argument("--prompt", default=None, help="the text to continue")
    g.add_argument("--prompt-ids", default=None, metavar="I,J,...", help="token ids to continue, instead of --prompt")
    g.add_argument("--tokenizer", default=None,
                   help="byte, a tokenizer.json or a SentencePiece .model (default: the one the training data "
                        "was prepared with, or byte for text data)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set reaching this mass")
    g.add_argument("--num-samples", type=int, default=1, help="continuations of the prompt, drawn together")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", action="store_true", help="one JSON object: prompt ids, new ids and text per sample")


def _add_eval_parser(sub) -> None:
    """`maxtrain eval CHECKPOINT ...`."""
    ev = sub.add_parser("eval", help="score a checkpoint on lm-evaluation-harness tasks (pip install 'maxtrain[eval]')")
    ev.add_argument("checkpoint", help="a checkpoint directory (its newest good step) or one step directory")
    ev.add_argument("overrides", nargs="*", help="dotted overrides of the saved config, e.g. mesh.fsdp=8")
    ev.add_argument("--tasks", required=True, help="comma-separated harness task names, e.g. hellaswag,arc_easy")
    ev.add_argument("--include-path", default=None, metavar="DIR", help="a directory of your own task YAML files")
    ev.add_argument("--limit", type=float, default=None, help="at most this many documents per task (or a fraction)")
    ev.add_argument("--num-fewshot", type=int, default=None)
    ev.add_argument("--batch-size", type=int, default=8, help="sequences per scoring batch")
    ev.add_argument("--tokenizer", default=None, help="as for generate (default: the training data's)")
    ev.add_argument("--output", default=None, metavar="FILE", help="also write the results as JSON")


def _add_checkpoint_parser(sub) -> None:
    """`maxtrain checkpoint verify DIR`."""
    c = sub.add_parser("checkpoint", help="checkpoint tools")
    csub = c.add_subparsers(dest="action", required=True, parser_class=_Parser)
    v = csub.add_parser("verify", help="verify the checksums of one step directory or every checkpoint in DIR")
    v.add_argument("dir")
    v.add_argument("--timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="give up on a read that hangs (a stuck filesystem) after this long: stacks, exit 76; 0: never")


def _add_prepare_parser(sub) -> None:
    """`maxtrain prepare --input ... --output ...`."""
    pr = sub.add_parser("prepare", help="tokenize text/JSONL/Parquet into ArrayRecord shards with a manifest")
    pr.add_argument("--input", help="a file, a directory or a glob of .txt/.jsonl/.parquet files")
    pr.add_argument("--output", help="new directory for the shards and manifest.json")
    pr.add_argument("--tokenizer", default="byte", help="byte, a tokenizer.json, or a SentencePiece .model")
    pr.add_argument("--train-tokenizer", type=int, metavar="VOCAB_SIZE", default=None,
                    help="train a byte-level BPE tokenizer on the input and save it beside the shards")
    pr.add_argument("--shards", type=int, default=None,
                    help="ArrayRecord shards to write (default: one per ~64 MiB of input text, at most 64, "
                         "at least 1; more shards let more data workers read in parallel)")
    pr.add_argument("--val-fraction", type=float, default=0.0,
                    help="fraction of documents (chosen by --seed) held out as the val split that "
                         "train.eval_every evaluates on (default 0: no val split)")
    pr.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    pr.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: CPU cores)")
    pr.add_argument("--seed", type=int, default=0, help="seed of the validation split")
    pr.add_argument("--verify", metavar="DIR", default=None, help="check every shard, checksum and token id of DIR")
    pr.add_argument("--engine", choices=("local", "ray"), default="local",
                    help="local: a process pool on this machine; ray: tasks on a Ray cluster, the same output "
                         "byte for byte, resumed when run again after a kill (docs/data.md)")
    pr.add_argument("--ray-address", default=None,
                    help="--engine ray: the cluster to join (host:port of `ray start --head`; default "
                         "RAY_ADDRESS, else a local cluster of --workers CPUs)")
    pr.add_argument("--piece-mib", type=float, default=None,
                    help="--engine ray: JSONL files are tokenized in byte ranges of this many MiB (default 64)")


def _add_tokenizer_parser(sub) -> None:
    """`maxtrain tokenizer extend | stats` (docs/continued_pretraining.md#a-new-language)."""
    tk = sub.add_parser("tokenizer", help="extend a tokenizer for new scripts; tokens per word by script")
    tsub = tk.add_subparsers(dest="action", required=True, parser_class=_Parser)
    ex = tsub.add_parser("extend", help="learn up to N tokens on a corpus and append them to a byte-level BPE "
                                        "tokenizer.json or a SentencePiece BPE model (every base id and base "
                                        "tokenization kept)")
    ex.add_argument("base", help="a tokenizer.json, a SentencePiece .model, or a Hugging Face model directory")
    ex.add_argument("--corpus", required=True, nargs="+", help="text/JSONL/Parquet files, directories or globs "
                                                               "in the new language(s)")
    ex.add_argument("--add", type=int, required=True, metavar="N", help="new tokens to learn (at most)")
    ex.add_argument("--out", required=True, help="directory for the extended tokenizer.json")
    ex.add_argument("--scripts", default=None,
                    help="comma-separated scripts the new tokens are for (default: the corpus's other than Latin)")
    ex.add_argument("--min-count", type=int, default=2, help="a pair seen fewer times is not merged")
    ex.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    st = tsub.add_parser("stats", help="tokens per word and per character, and byte fallback, per Unicode script")
    st.add_argument("tokenizer", help="byte, a tokenizer.json (or its directory) or a SentencePiece .model")
    st.add_argument("texts", nargs="+", help="text/JSONL/Parquet files, directories or globs")
    st.add_argument("--against", default=None, help="a second tokenizer shown side by side (e.g. the base of an "
                                                     "extension)")
    st.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    st.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _add_report_parser(sub) -> None:
    """`maxtrain report RUN_DIR ...`."""
    rep = sub.add_parser("report", help="plots and a summary of run directories: report.html, or --text")
    rep.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (several: overlaid and compared)")
    rep.add_argument("--out", default=None,
                     help="HTML file (PNGs beside it; default RUN_DIR/report.html, or ./report.html for several "
                          "or for an s3:// or gs:// RUN_DIR)")
    rep.add_argument("--text", action="store_true", help="print a terminal summary instead of writing files")


def _add_convert_parser(sub) -> None:
    """`maxtrain convert hf-to-maxtrain | maxtrain-to-hf`."""
    conv = sub.add_parser("convert", help="Hugging Face interchange (Llama, Mistral, Qwen3, Mixtral, Qwen3-MoE, DeepSeek-V3)")
    csub = conv.add_subparsers(dest="direction", required=True, parser_class=_Parser)
    h2m = csub.add_parser("hf-to-maxtrain", help="HF directory (config.json + safetensors) -> checkpoint")
    h2m.add_argument("hf_dir")
    h2m.add_argument("out_dir")
    h2m.add_argument("--config", default=None, help="config for the non-model sections (default: built-in defaults)")
    h2m.add_argument("--tokenizer", default=None,
                     help="an extension of the model's tokenizer (maxtrain tokenizer extend): the model is grown to "
                          "its vocabulary and keeps it")
    h2m.add_argument("--grow-init", default="pieces", choices=("pieces", "mean", "random"),
                     help="new embedding rows and output columns: the mean of the base pieces each new token "
                          "replaces (default), the mean of all rows, or random around it")
    h2m.add_argument("--pad-vocab-to", type=int, default=None, metavar="N",
                     help="with --tokenizer: pad the grown vocabulary with zero rows to a multiple of N (the "
                          "sharding's, e.g. 128); an export drops them")
    h2m.add_argument("--measure", default=None, metavar="TEXT_FILE",
                     help="with --tokenizer: bits per byte of each script's lines of this file under the base "
                          "model (its tokenization) and the grown one (the extension's), before any training")
    h2m.add_argument("overrides", nargs="*")
    m2h = csub.add_parser("maxtrain-to-hf", help="checkpoint (dir or step dir) -> HF directory")
    m2h.add_argument("checkpoint")
    m2h.add_argument("out_dir")
    m2h.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                     help="weights' dtype (default: the converted source model's, else float32)")
    m2h.add_argument("--rope-format", default="legacy", choices=["legacy", "parameters"],
                     help="config.json RoPE keys: rope_theta + rope_scaling (legacy) or rope_parameters")
    m2h.add_argument("--tokenizer", default=None,
                     help="tokenizer written with the model: a tokenizer.json, an HF model directory, a SentencePiece "
                          ".model, 'byte' or 'none' (default: the training data's, else the converted model's)")


def _train(args) -> int:
    from maxtrain.config import load_config

    cfg = load_config(args.config, args.overrides)  # config errors come before jax is even imported
    if args.print_config:
        import yaml

        from maxtrain.config import to_dict

        sys.stdout.write(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    if args.dry_run:
        return _dry_run(cfg)
    from maxtrain.data import check_inputs

    check_inputs(cfg)  # data paths too, still before jax
    from maxtrain.checkpoint import PREEMPTED_EXIT_CODE
    from maxtrain.reliability import HALT_EXIT_CODE, Halted
    from maxtrain.run import train

    from maxtrain.reliability.preflight import Unhealthy

    _join_job()
    try:
        result = train(cfg)
    except Halted as e:
        print(f"maxtrain: halted: {e}", file=sys.stderr)
        _leave_job_now(HALT_EXIT_CODE)
        return HALT_EXIT_CODE
    except Unhealthy as e:
        return _unhealthy(e)
    if result.evicted is not None:  # the straggler watch: the last step saved, the slow node named
        return _unhealthy(result.evicted)
    if result.preempted:
        step = result.history[-1]["step"] if result.history else result.start_step
        if not result.checkpoint_saved:
            why = ("its save failed, see above; a restart resumes from the newest good checkpoint" if cfg.checkpoint.dir
                   else "set checkpoint.dir to make runs resumable")
            print(f"maxtrain: stopped by a signal at step {step} with no checkpoint of it saved ({why})",
                  file=sys.stderr)
            return 1
        print(f"maxtrain: preempted at step {step}; checkpoint saved, run the same command to resume",
              file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    return 0


def _unhealthy(e) -> int:
    """A condemned node: one line (the table is in the log above), exit 78 (exit_codes.UNHEALTHY)."""
    print(f"maxtrain: {e} (see {e.path}); the launchers requeue without "
          f"{', '.join(e.report.condemned_hosts())}", file=sys.stderr)
    _leave_job_now(exit_codes.UNHEALTHY)
    return exit_codes.UNHEALTHY


def _preflight(args) -> int:
    """`maxtrain preflight CONFIG [KEY=VALUE ...]`: the checks `train` runs first, alone."""
    from maxtrain.config import load_config

    cfg = load_config(args.config, args.overrides)
    _join_job()
    import jax

    from maxtrain.mesh import build_mesh
    from maxtrain.reliability import preflight

    mode = args.mode or ("quick" if cfg.reliability.preflight == "quick" else "full")
    lock, busy = None, None
    if cfg.checkpoint.dir:  # never write into a directory another run holds (every process agrees)
        from maxtrain.checkpoint.lock import lock_directory

        try:
            lock = lock_directory(cfg.checkpoint.dir)
        except ConfigError as e:
            busy = str(e).splitlines()[0][:160]
    try:
        report = preflight.check(cfg, build_mesh(cfg.mesh), mode, args.out, checkpoint_dir_busy=busy)
    except preflight.Unhealthy as e:
        if jax.process_index() == 0:
            print("\n".join(e.report.lines()))
        return _unhealthy(e)
    finally:
        if lock is not None:
            lock.release()
    if jax.process_index() == 0:
        print("\n".join(report.lines()))
        print(f"preflight: {len(report.hosts)} processes healthy in {report.seconds:.1f}s; {args.out}")
    return 0


def _generate_tokenizer(args, cfg):
    """--tokenizer, else the one kept with the checkpoint, else the one the training data was prepared
    with, else bytes for text data."""
    from maxtrain.generate import tokenizer_for

    tok = tokenizer_for(cfg, args.tokenizer, args.checkpoint)
    if tok is None:
        raise ConfigError(f"data.kind={cfg.data.kind} names no tokenizer; pass --tokenizer or --prompt-ids")
    return tok


def _generate(args) -> int:
    import json

    if (args.prompt is None) == (args.prompt_ids is None):
        raise ConfigError("generate needs --prompt TEXT or --prompt-ids I,J,... (one of them)")
    if args.num_samples < 1:
        raise ConfigError("--num-samples must be >= 1")
    import jax
    import numpy as np

    from maxtrain.generate import compute_params, generate_tokens, text_until_eos
    from maxtrain.mesh import use_mesh

    cfg = _sampling_config(args.checkpoint, args.overrides)
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--prompt-ids {args.prompt_ids!r} is not a comma-separated list of integers") from None
        tok = _generate_tokenizer(args, cfg) if args.tokenizer else None  # to decode what follows
    else:
        tok = _generate_tokenizer(args, cfg)
        ids = tok.encode(args.prompt)
    if not ids or min(ids) < 0 or max(ids) >= cfg.model.vocab_size:
        raise ConfigError(f"the prompt's token ids must be 1 or more, each in [0, {cfg.model.vocab_size})")
    cfg, params, mesh = _sampling_params(args.checkpoint, cfg)
    with use_mesh(mesh):
        prompt = np.tile(np.asarray(ids, np.int32)[None], (args.num_samples, 1))
        out = generate_tokens(compute_params(params, cfg.train.dtype), prompt, jax.random.key(args.seed),
                              m=cfg.model, new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p)
    new = np.asarray(jax.device_get(out))[:, len(ids):]
    decodes = tok is not None and tok.decode is not None
    samples = [{"ids": row, "text": text_until_eos(tok, row) if decodes else None} for row in new.tolist()]
    if args.json:
        print(json.dumps({"prompt_ids": ids, "samples": samples}))
    else:
        for i, smp in enumerate(samples):
            head = f"--- sample {i + 1}\n" if len(samples) > 1 else ""
            body = (args.prompt or "") + smp["text"] if smp["text"] is not None else " ".join(map(str, smp["ids"]))
            print(head + body)
    return 0


def _sampling_config(path: str, overrides: list[str]):
    """The config generate/eval run a checkpoint with: its saved one unpipelined, its mesh fitted to
    this machine's devices (`mesh.fit_mesh`, said in one log line), with overrides."""
    import dataclasses
    import os

    if not os.path.exists(path):
        raise ConfigError(f"{path} does not exist")
    import jax

    from maxtrain.checkpoint import saved_config
    from maxtrain.config import unpipelined, with_overrides
    from maxtrain.generate import check_supported
    from maxtrain.mesh import fit_mesh

    saved = unpipelined(saved_config(path))
    explicit = _mesh_overrides(overrides)
    mesh, note = fit_mesh(dataclasses.replace(saved.mesh, **explicit), len(jax.devices()), set(explicit))
    cfg = with_overrides(dataclasses.replace(saved, mesh=mesh), overrides)  # an explicit mesh.* still wins
    check_supported(cfg.model)
    if note:
        logging.getLogger("maxtrain").info(note)
    return cfg


def _mesh_overrides(overrides: list[str]) -> dict[str, int]:
    """The mesh axis sizes set on the command line (`mesh.fsdp=1`, or `mesh={fsdp: 1}`)."""
    from maxtrain.config import MESH_AXES, parse_override

    out = {}
    for item in overrides:
        key, value = parse_override(item)
        pairs = value.items() if key == "mesh" and isinstance(value, dict) else [(key.removeprefix("mesh."), value)]
        out.update({a: v for a, v in pairs if (key == "mesh" or key.startswith("mesh.")) and a in MESH_AXES
                    and isinstance(v, int) and not isinstance(v, bool)})
    return out


def _sampling_params(path: str, cfg):
    """(cfg, params, mesh): the parameters placed by the config's rules on the mesh it names."""
    import jax

    from maxtrain.checkpoint import load_checkpoint
    from maxtrain.mesh import build_mesh

    mesh = build_mesh(cfg.mesh, jax.devices())
    cfg, params = load_checkpoint(path, cfg, mesh)
    return cfg, params, mesh


def _eval(args) -> int:
    import json

    from maxtrain.config import require_module

    lm_eval = require_module("lm_eval", "lm_eval", "maxtrain eval", "eval")  # before the checkpoint loads
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks or args.batch_size < 1:
        raise ConfigError("--tasks needs at least one task name and --batch-size must be >= 1")
    from lm_eval.tasks import TaskManager

    from maxtrain.harness import evaluate, make_lm
    from maxtrain.mesh import use_mesh

    manager = TaskManager(include_path=args.include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"unknown harness task(s) {', '.join(unknown)}; `lm_eval ls tasks` lists them, or "
                          f"--include-path DIR adds your own YAML")
    cfg = _sampling_config(args.checkpoint, args.overrides)
    tokenizer = _generate_tokenizer(args, cfg)
    cfg, params, mesh = _sampling_params(args.checkpoint, cfg)
    with use_mesh(mesh):
        lm = make_lm(cfg, params, tokenizer, batch_size=args.batch_size)
        results = evaluate(lm_eval, lm, tasks, num_fewshot=args.num_fewshot, limit=args.limit, task_manager=manager,
                           log_samples=False, bootstrap_iters=0)
    from lm_eval.utils import make_table

    print(make_table(results))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"results": results["results"], "config": {"checkpoint": args.checkpoint, "tasks": tasks,
                                                                 "limit": args.limit}}, f, indent=1, default=str)
    return 0


def _dry_run(cfg) -> int:
    """`train --dry-run`: what would run, from shapes alone (`make_setup`: no array, no compile)."""
    import jax

    from maxtrain.step import make_setup, memory_per_device, state_bytes_by_phase

    setup = make_setup(cfg)
    phases = state_bytes_by_phase(setup)
    _, params, opt = max(phases, key=lambda p: p[1] + p[2])
    limit, where = memory_per_device(setup.mesh.devices.flat[0])
    n_params = sum(x.size for x in jax.tree.leaves(setup.abstract_state.params))
    mesh = {k: v for k, v in setup.mesh.shape.items() if v > 1} or {"data": 1}
    t = cfg.train
    size = f"{n_params / 1e9:,.2f}B" if n_params >= 1e9 else f"{n_params / 1e6:,.1f}M"
    print(f"model        {cfg.model.name}: {n_params:,} parameters ({size})")
    print(f"mesh         {', '.join(f'{k}={v}' for k, v in mesh.items())} ({setup.mesh.size} x "
          f"{setup.mesh.devices.flat[0].device_kind})")
    print(f"batch        {t.batch_size} x {t.seq_len} tokens = {setup.tokens_per_step:,} per step "
          f"(grad_accum {t.grad_accum}), {t.steps:,} steps")
    print(f"FLOPs/step   {setup.flops_per_step:.3g} (model)")
    fits = "" if not limit else (f" of the {_size(limit)} a device has ({where}): "
                                 + ("fits" if params + opt <= limit else "DOES NOT FIT"))
    print(f"state/device {_size(params + opt)} = params {_size(params)} + optimizer {_size(opt)}{fits}")
    if len(phases) > 1:  # optim.groups that freeze parameters: no moments until they learn
        print("by phase     " + "; ".join(f"from step {k}: params {_size(p)} + optimizer {_size(o)}"
                                           for k, p, o in phases))
    print("activations and temporaries are not included: `maxtrain inspect` compiles the step and reports them")
    return 0


def _size(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:,.2f} GiB"
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def _inspect(args) -> int:
    import json

    from maxtrain.config import load_config

    cfg = load_config(args.config, args.overrides)  # config errors before jax is imported
    devices = None
    if args.target or args.devices is not None:
        devices = _compile_devices(args.target, 8 if args.devices is None else args.devices)
    else:  # --devices compiles for fake devices in this one process; without it, for the job's devices
        _join_job()
    from maxtrain.analysis.inspect import inspect_step

    r = inspect_step(cfg, devices)
    if args.json:
        print(json.dumps(r))
        return 0
    mib = 2**20
    mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v != 1) or "one device"
    print(f"params            {r['params']:,}")
    print(f"mesh              {mesh} ({r['devices']} device{'s' if r['devices'] != 1 else ''}, {r['device_kind']})")
    if r["memory_per_device"]:
        m = r["memory_per_device"]
        print(f"memory/device     {m['total'] / mib:,.1f} MiB = arguments {m['arguments'] / mib:,.1f} + outputs "
              f"{m['outputs'] / mib:,.1f} + temporaries {m['temporaries'] / mib:,.1f} - aliased {m['aliased'] / mib:,.1f}")
        if r.get("device_memory"):
            fits = "fits" if m["total"] <= r["device_memory"] else "DOES NOT FIT"
            print(f"                  {100 * m['total'] / r['device_memory']:.1f}% of the "
                  f"{r['device_memory'] / mib:,.0f} MiB jax's allocator gets: {fits}")
    xla = r["xla_flops_per_device"]
    print(f"FLOPs/step        model {r['model_flops_per_step']:.4g}"
          + (f" | XLA {xla * r['devices']:.4g} (a scanned layer counted once)" if xla else ""))
    if r.get("pipeline") is not None:
        p = r["pipeline"]
        print(f"pipeline          {p['schedule']}: bubble {100 * p['bubble']:.1f}% of stage time, at most "
              f"{max(p['peak_activations'])} (microbatch, chunk) activations alive per stage "
              f"{p['peak_activations']}")
    print("collectives/step  kind                count      MiB")
    for kind, st in r["collectives"].items():
        if st["count"]:
            print(f"                  {kind:<18} {st['count']:>6} {st['bytes'] / mib:>8.2f}")
    print("activation specs  (times traced: forward and backward, a scanned layer once)")
    for key, n in r["activation_shardings"].items():
        print(f"                  {n:>4} x {key}")
    if r["custom_calls"]:  # the hand-written kernels (Pallas, cuDNN) and library calls XLA does not fuse
        print("custom calls/step " + ", ".join(f"{t} {n}" for t, n in r["custom_calls"].items()))
    if r.get("roofline"):
        _print_roofline(r["roofline"])
    if r.get("schedule"):
        _print_schedule(r["schedule"], r["roofline"])
    print(f"attention         {r['attention']}")
    return 0


def _compile_devices(target: str | None, n: int, per_host: int = 8) -> list:
    """The devices `inspect` and `plan` compile for, set up before jax creates its backends: `n`
    GPUs of kind `target` described to XLA's CUDA compiler, else `n` fake CPU devices (jax itself
    stays on the CPU either way)."""
    import os

    if n < 1:
        raise ConfigError("--devices must be >= 1")
    if not target:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    import jax

    jax.config.update("jax_platforms", "cpu")
    if target:
        from maxtrain.targets import target_devices

        return target_devices(target, n, per_host=per_host)
    return jax.devices()[:n]


def _plan(args) -> int:
    import json

    from maxtrain.config import load_config

    load_config(args.config, args.overrides)  # config errors before jax is imported
    if args.devices < 1:
        raise ConfigError("--devices must be >= 1")
    per_host = 8 if args.hosts is None else args.devices // max(args.hosts, 1)
    if args.hosts is not None and (args.hosts < 1 or args.devices % args.hosts):
        raise ConfigError(f"--hosts {args.hosts} does not divide --devices {args.devices}; give a host count "
                          f"that splits the devices evenly")
    devices = _compile_devices(args.target, args.devices, per_host)
    from maxtrain.analysis.plan import plan, plan_yaml, print_table

    result = plan(args.config, args.overrides, devices, top=args.top, per_host=per_host,
                  progress=lambda line: print(f"plan: {line}", file=sys.stderr, flush=True))
    if result["best"] is None:
        raise ConfigError(f"no layout of {args.devices} devices fits this config's model, batch and length "
                          f"({result['considered']} considered, {result['kept']} passed the memory estimate); "
                          "use more devices, a smaller train.batch_size or train.seq_len")
    with open(args.out, "w") as f:
        f.write(plan_yaml(args.config, result["best"], args.out, args.overrides))
    if args.json:
        print(json.dumps({**result, "out": args.out}))
        return 0
    print_table(result)
    print(f"best: {result['best']['layout']} -> {args.out} (maxtrain train {args.out}); "
          f"{result['considered']} layouts considered, {result['kept']} fit the memory estimate, "
          f"{result['compiled']} compiled, in {result['seconds']:.0f} s")
    print("overrides: " + " ".join(result["best"]["overrides"]))
    return 0


def _print_schedule(sched: dict, roof: dict) -> None:
    """`maxtrain.analysis.schedule.predict`'s summary: the step replayed in the compiled order."""
    step, exposed = sched["predicted_step_s"], sched["exposed_collective_s"]
    print(f"schedule model    step ~ {1e3 * step:,.1f} ms predicted (bound {1e3 * roof['step_s']:,.1f} ms): "
          f"compute {1e3 * sched['compute_s']:,.1f} ms + exposed communication {1e3 * exposed:,.1f} ms "
          f"({100 * sched['exposed_share']:.1f}% of the step; {1e3 * sched['collective_s']:,.1f} ms of collectives "
          f"in all): MFU ~ {100 * (sched['predicted_mfu'] or 0):.1f}% predicted")
    if sched["exposed"]:
        print("                  exposed: " + ", ".join(f"{k} {1e3 * v:,.2f} ms"
                                                        for k, v in sched["exposed_by_kind_s"].items()))
        for e in sched["exposed"][:5]:
            print(f"                  {1e3 * e['seconds']:8.2f} of {1e3 * e['of_s']:,.2f} ms  x{e['runs']:<4g} "
                  f"{e['kind']:18s} {e['op'][-70:] or e['name']}")


def _print_roofline(roof: dict) -> None:
    """`maxtrain.analysis.hlo.roofline`'s summary: the step's lower bound on its GPU, by kind of kernel."""
    ms = {k: 1e3 * v for k, v in roof["by_category_s"].items()}
    print(f"roofline          step >= {1e3 * roof['step_s']:,.1f} ms at {roof['peak_flops'] / 1e12:,.0f} TFLOP/s and "
          f"{roof['bandwidth'] / 1e12:.2f} TB/s: MFU <= {100 * roof['mfu_ceiling']:.1f}%")
    print("                  " + ", ".join(f"{k} {v:,.1f} ms" for k, v in ms.items())
          + f" ({roof['kernels_per_step']:,} kernels)")
    gemms = roof.get("gemms") or {}
    if gemms:
        print("                  GEMMs by operand precision: " + ", ".join(
            f"{p} {g['kernels']} kernels x{g['runs']} runs {1e3 * g['seconds']:,.1f} ms" for p, g in gemms.items())
            + (" (FP8 at the FP8 peak)" if "fp8" in gemms else ""))
    print("                  memory-bound kernels taking the most (ms/step, runs/step, op):")
    for k in roof["top_memory_bound"][:5]:
        print(f"                  {1e3 * k['seconds'] * k['runs']:8.1f}  x{k['runs']:<4} {k['op'][-80:] or k['name']}")


def _join_job() -> None:
    """Joins the multi-process job this process belongs to, if any (before jax looks at devices)."""
    from maxtrain import distributed

    spec = distributed.initialize_from_env()
    distributed.quiet_other_processes(spec)


def _launch(args) -> int:
    from maxtrain.config import load_config
    from maxtrain.launcher import launch_local

    restarts = args.max_restarts
    if restarts is None:  # also checks the config once here, before any process starts
        restarts = load_config(args.config, args.overrides).reliability.max_restarts
    return launch_local(["train", args.config, *args.overrides], args.processes, cpu_devices=args.cpu_devices,
                        max_restarts=restarts, grace_s=args.grace, backoff_s=args.backoff)


def _documents(specs: list[str], text_field: str) -> list[str]:
    """Every document of the files that `specs` (files, directories, globs) name."""
    from maxtrain.data.prepare import input_files, iter_documents

    return [doc for spec in specs for path in input_files(spec) for doc in iter_documents(path, text_field)]


def _tokenizer(args) -> int:
    """`maxtrain tokenizer extend` and `maxtrain tokenizer stats`."""
    import json

    from maxtrain.data import tokenizers

    if args.action == "extend":
        if args.add < 1:
            raise ConfigError(f"--add {args.add}: give the number of new tokens to learn (at least 1)")
        scripts = [x.strip() for x in args.scripts.split(",")] if args.scripts else None
        try:
            got = tokenizers.extend(args.base, _documents(args.corpus, args.text_field), args.add, args.out,
                                    scripts, args.min_count)
        except ValueError as e:  # an unknown script name
            raise ConfigError(f"--scripts: {e}") from None
        print(f"tokenizer extend: {got['added']} new tokens (of {got['asked']} asked) for {', '.join(got['scripts'])}, "
              f"ids {got['first_new_id']}-{got['first_new_id'] + got['added'] - 1}; vocabulary {got['base_vocab_size']} "
              f"-> {got['vocab_size']}; {got['out']}")
        if got["examples"]:
            print("first new tokens: " + " ".join(f"'{x}'" for x in got["examples"]))
        return 0
    docs = _documents(args.texts, args.text_field)
    tables = [(args.tokenizer, tokenizers.script_stats(tokenizers.load_tokenizer(args.tokenizer), docs))]
    if args.against:
        tables.insert(0, (args.against, tokenizers.script_stats(tokenizers.load_tokenizer(args.against), docs)))
    if args.json:
        print(json.dumps({name: st for name, st in tables}))
    else:
        print("\n".join(tokenizers.stats_lines(tables)))
    return 0


def _prepare(args) -> int:
    from maxtrain.data import prepare

    if args.verify:
        problems = prepare.verify(args.verify)
        for p in problems[:-1]:
            print(f"maxtrain: error: {p}", file=sys.stderr)
        if problems:
            raise ConfigError(problems[-1])
        print(f"{args.verify}: ok")
        return 0
    if not args.input or not args.output:
        raise ConfigError("prepare needs --input and --output (or --verify DIR)")
    if not storage.is_url(args.input):
        prepare.input_files(args.input)  # no input: say so before the tokenizer loads
    common = dict(shards=args.shards, val_fraction=args.val_fraction, text_field=args.text_field,
                  train_tokenizer=args.train_tokenizer, workers=args.workers, seed=args.seed)
    if args.engine == "ray":
        from maxtrain.data.prepare_ray import PIECE_BYTES, prepare_ray

        if args.piece_mib is not None and args.piece_mib <= 0:
            raise ConfigError("--piece-mib must be > 0")
        m = prepare_ray(args.input, args.output, args.tokenizer, ray_address=args.ray_address,
                        piece_bytes=PIECE_BYTES if args.piece_mib is None else max(1, int(args.piece_mib * 2**20)),
                        **common)
    elif args.ray_address or args.piece_mib is not None:
        raise ConfigError("--ray-address and --piece-mib apply to --engine ray")
    else:
        m = prepare.prepare(args.input, args.output, args.tokenizer, **common)
    docs = sum(s["documents"] for sp in m["splits"].values() for s in sp["shards"])
    toks = sum(s["tokens"] for sp in m["splits"].values() for s in sp["shards"])
    n_shards = len(m["splits"]["train"]["shards"])
    short = args.train_tokenizer and m["vocab_size"] < args.train_tokenizer
    print(f"{args.output}: {docs:,} documents, {toks:,} tokens ({m['tokenizer']['kind']}, vocab {m['vocab_size']}) "
          f"in {n_shards} shard{'s' * (n_shards > 1)}, from {_size(m['text_bytes'])} in {m['seconds']:.1f}s "
          f"({_size(m['text_bytes'] / max(m['seconds'], 1e-9))}/s)"
          + (f"; --train-tokenizer asked for {args.train_tokenizer}: the corpus ran out of pairs to merge at "
             f"{m['vocab_size']} (a larger corpus gives more)" if short else ""))
    if not storage.is_url(args.input) and not storage.is_url(args.output):
        _print_script_stats(args.input, args.output, m, args.text_field)
    return 0


SCRIPT_SAMPLE_BYTES = 4 << 20  # `prepare`'s per-script figures: on the corpus's first documents, up to this much


def _print_script_stats(inputs: str, out_dir: str, manifest: dict, text_field: str) -> None:
    """The corpus's tokens per word, per character and byte fallback by Unicode script
    (`maxtrain tokenizer stats`), on its first documents."""
    from maxtrain.data import prepare, tokenizers
    from maxtrain.data.manifest import manifest_tokenizer

    sample, size = [], 0
    for path in prepare.input_files(inputs):
        for doc in prepare.iter_documents(path, text_field):
            sample.append(doc)
            size += len(doc.encode("utf-8"))
            if size >= SCRIPT_SAMPLE_BYTES:
                break
        if size >= SCRIPT_SAMPLE_BYTES:
            break
    tok = tokenizers.load_tokenizer(manifest_tokenizer(out_dir, manifest))
    lines = tokenizers.stats_lines([(f"{manifest['tokenizer']['kind']} tokenizer", tokenizers.script_stats(tok, sample))])
    print(f"per script, on the first {_size(size)} of the corpus (maxtrain tokenizer stats):")
    print("\n".join(lines))


def _convert(args) -> int:
    import os

    from maxtrain.config import load_config

    import tempfile

    source = args.hf_dir if args.direction == "hf-to-maxtrain" else args.checkpoint
    if not storage.is_url(source) and not os.path.exists(source):  # before jax is imported
        raise ConfigError(f"{source} does not exist")
    base = load_config(args.config, args.overrides) if args.direction == "hf-to-maxtrain" else None
    cache = base.object_cache if base else storage.DEFAULT_CACHE
    remote_out = storage.is_url(args.out_dir)
    if remote_out:  # before any work
        storage.require_empty(args.out_dir)
    from maxtrain import convert

    with tempfile.TemporaryDirectory(prefix="maxtrain-convert-") as work:
        out = os.path.join(work, "out") if remote_out else args.out_dir  # put under the prefix when complete
        if args.direction == "hf-to-maxtrain":
            hf_dir = storage.stage(args.hf_dir, cache) if storage.is_url(args.hf_dir) else args.hf_dir
            step_dir = convert.hf_to_maxtrain(hf_dir, out, base, args.tokenizer, args.grow_init, args.pad_vocab_to,
                                              args.measure)
            if remote_out:
                _publish_checkpoint(out, args.out_dir)
                step_dir = storage.join(args.out_dir, os.path.relpath(step_dir, out))
            print(f"wrote {step_dir} (params only; train from it with checkpoint.init_from={step_dir})")
        else:
            from maxtrain.checkpoint.manager import staged_checkpoint

            ckpt = args.checkpoint
            if storage.is_url(ckpt):
                root, step = staged_checkpoint(ckpt, "checkpoint", cache)
                ckpt = os.path.join(root, str(step))
            files = convert.maxtrain_to_hf(ckpt, out, dtype=args.dtype, rope_format=args.rope_format,
                                            tokenizer=args.tokenizer)
            if remote_out:
                storage.publish(out, args.out_dir, last=("config.json",))
            print(f"wrote {args.out_dir}: {', '.join(files)}")
    return 0


def _publish_checkpoint(local: str, url: str) -> None:
    """A checkpoint directory put under `url`, each step's Orbax metadata last (a reader takes a step
    as complete only once it is there)."""
    import os

    names = [os.path.relpath(os.path.join(d, f), local).replace(os.sep, "/") for d, _, fs in os.walk(local)
             for f in fs if f == "_CHECKPOINT_METADATA"]
    storage.publish(local, url, last=tuple(names))


def _report(args) -> int:
    import os

    from maxtrain.analysis import report

    # a bucket run_dir is read from a copy (not its profiles) under the default object cache
    cache = os.path.join(os.path.expanduser(storage.DEFAULT_CACHE), "reports")
    runs = report.load_runs([storage.stage(r, cache, keep=lambda k: not k.startswith("profile/"))
                             if storage.is_url(r) else r for r in args.runs])
    if args.text:
        print(report.text_report(runs))
        return 0
    out = args.out or ("report.html" if any(storage.is_url(r) for r in args.runs) else report.default_out(runs))
    written = report.html_report(runs, out)
    print(f"wrote {written[0]} ({', '.join(os.path.basename(p) for p in written[1:])} beside it)")
    return 0


def _verify(args) -> int:
    from maxtrain.checkpoint import verify_path
    from maxtrain.config import ReliabilityConfig
    from maxtrain.reliability import Watchdog

    watchdog = Watchdog(ReliabilityConfig(hang_timeout_s=0, restore_timeout_s=max(args.timeout, 0))).start()
    with watchdog.phase(f"checkpoint verify {args.dir}", args.timeout):
        results = verify_path(args.dir)
    watchdog.stop()
    for step, error in results:
        print(f"step {step}: {'ok' if error is None else 'CORRUPT: ' + error}")
    bad = [s for s, e in results if e is not None]
    if bad:
        raise ConfigError(f"{len(bad)} of {len(results)} checkpoints under {args.dir} are corrupt "
                          f"(steps {', '.join(map(str, bad))})")
    return 0


def _not_from_orbax(record: logging.LogRecord) -> bool:
    """Drops Orbax's own error logs, and asyncio's about Orbax tasks whose failure nobody fetched
    ("Task exception was never retrieved"): a failed save or read is reported in one line of ours."""
    if "/orbax/" in record.pathname and record.levelno < logging.CRITICAL:
        return False
    tb = record.exc_info[2] if record.exc_info else None
    while tb is not None:
        if "/orbax/" in tb.tb_frame.f_code.co_filename:
            return False
        tb = tb.tb_next
    return True


def configure_logging(level: int = logging.INFO) -> None:
    """What `maxtrain train` shows, for a script that calls `maxtrain.train()`: maxtrain's progress
    lines on stderr (`HH:MM:SS message`), jax's and Orbax's chatter left out. It configures the root
    logger, so only an application should call it; importing maxtrain configures nothing (its
    loggers are `maxtrain.*`, so `logging.basicConfig(level=logging.INFO)` shows them too)."""
    logging.basicConfig(level=level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr, force=True)  # replaces any handler a library left on the root
    logging.getLogger("jax").setLevel(logging.WARNING)  # e.g. its INFO line about a missing TPU backend
    absl = logging.getLogger("absl")
    absl.setLevel(logging.ERROR)  # Orbax's chatter; our own lines say what matters
    absl.addFilter(_not_from_orbax)  # its errors too: every failed save or read is reported in one line of ours
    logging.getLogger("asyncio").addFilter(_not_from_orbax)


def _quiet_read_error_aftermath() -> None:
    """After a failed checkpoint read (reported in one line), Orbax leaves coroutines that still
    hold the error and TensorStore callbacks that hit its closed event loop; Python prints each as
    an unraisable exception, pages of it. Those are dropped; anything else is printed as usual."""
    previous = sys.unraisablehook
    if getattr(previous, "maxtrain_filter", False):
        return

    def hook(unraisable):
        e, obj = unraisable.exc_value, unraisable.object
        closed_loop = isinstance(e, RuntimeError) and str(e) == "Event loop is closed"
        orbax_coroutine = "/orbax/" in getattr(getattr(obj, "cr_code", None), "co_filename", "")
        if not (closed_loop or orbax_coroutine):
            previous(unraisable)

    hook.maxtrain_filter = True
    sys.unraisablehook = hook


def _leave_job_now(code: int, traceback: bool = False) -> None:
    """After an error in a multi-process job: exit now rather than wait at JAX's shutdown barrier."""
    from maxtrain import distributed

    if distributed.joined():
        if traceback:
            import traceback as tb

            tb.print_exc()
        distributed.leave_now(code)


# the arguments of every subcommand that name a file or directory (`storage.path_problem`)
PATH_ARGUMENTS = ("config", "checkpoint", "dir", "input", "output", "verify", "runs", "out", "hf_dir", "out_dir",
                  "include_path", "tokenizer", "base", "corpus", "texts", "against")


# the path arguments that take s3:// and gs:// URLs, by subcommand
URL_ARGUMENTS = {"prepare": ("input", "output"), "convert": ("hf_dir", "checkpoint", "out_dir"), "checkpoint": ("dir",),
                 "report": ("runs",)}


def _check_path_arguments(args) -> None:
    """A path argument with a URL scheme (s3://, gs://) where the command takes only local paths, or
    a URL it cannot use, is one line before the command starts."""
    urls = URL_ARGUMENTS.get(getattr(args, "command", None), ())
    for name in PATH_ARGUMENTS:
        values = getattr(args, name, None)
        for value in values if isinstance(values, list) else [values]:
            if problem := storage.path_problem(f"--{name.replace('_', '-')}", value, urls=name in urls):
                raise ConfigError(problem)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # argparse stops collecting KEY=VALUE overrides at the first flag (`train CONFIG --dry-run a=b`):
    # what it left over are more overrides, or unknown arguments
    if hasattr(args, "overrides"):
        overrides = [x for x in extra if "=" in x and not x.startswith("-")]
        args.overrides += overrides
        extra = [x for x in extra if x not in overrides]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    configure_logging()
    _quiet_read_error_aftermath()
    try:
        _check_path_arguments(args)
        handlers = {"train": _train, "generate": _generate, "eval": _eval, "checkpoint": _verify, "convert": _convert,
                    "prepare": _prepare, "inspect": _inspect, "plan": _plan, "report": _report, "launch": _launch,
                    "preflight": _preflight, "tokenizer": _tokenizer}
        return handlers[args.command](args)
    except ConfigError as e:
        print(f"maxtrain: error: {e}", file=sys.stderr)
        _leave_job_now(USER_ERROR)
        return USER_ERROR
    except KeyboardInterrupt:
        print("maxtrain: interrupted", file=sys.stderr)
        return 130
    except Exception:
        _leave_job_now(1, traceback=True)  # multi-process: the traceback, then out without waiting for peers
        raise


if __name__ == "__main__":
    sys.exit(main())
