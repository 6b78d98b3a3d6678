#!/usr/bin/env bash
# MaxText 0.2.5 in its own Python 3.12 venv, on the same jax as maxtrain, for bench/vs_maxtext.py.
#
#   bash bench/maxtext_env.sh [VENV_DIR]      # default $MAXTEXT_VENV, else ~/.cache/maxtrain/maxtext-venv
#
# then (vs_maxtext.py finds that venv by itself; MAXTEXT_PYTHON=VENV_DIR/bin/python elsewhere):
#   XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/vs_maxtext.py --cases all
#
# Why it is not `pip install maxtext`: maxtext 0.2.5 (0.2.4 lacks train.make_synthetic_batch) needs
# Python >= 3.12 and declares its dependencies only under extras ([tpu], [cuda12]: ~200 packages with
# Google Cloud clients and jax >= 0.11.1). So it is installed --no-deps, with exactly the packages that
# importing and running its pre-training train_step on CPU needs, each pinned and also installed
# --no-deps (nothing unlisted comes in). The packages maxtrain's venv also has are pinned to the same
# versions there (jax/jaxlib 0.10.2, flax 0.12.8, optax 0.2.8, orbax-checkpoint 0.12.8, numpy, scipy,
# ml_dtypes, tensorstore, grain), so both sides compile with the same XLA. tokamax is 0.0.12, the
# version MaxText's own generated_requirements/decoupled-requirements.txt pins, which runs on jax
# 0.10 (0.0.14 and later require jax >= 0.11).
#
# One shim: maxtext/kernels/attention/jax_flash_attention.py imports
# `jax.experimental.xla_metadata.must_fuse_call`, which jax 0.10 lacks. That module is MaxText's
# pure-JAX flash kernel, reached only through its TPU flash path (attention=flash with
# use_jax_splash or the sparse indexer); `attention=dot_product`, what the comparison runs, never
# calls it, but layers/attention_op.py imports it unconditionally. The script turns that one import
# into a guarded one whose fallback raises NotImplementedError when called, so a run that did reach
# the kernel would fail loudly rather than silently differ. On jax >= 0.11 the import succeeds and
# the shim is inert.
#
# JAX_VERSION=X.Y.Z overrides the jax/jaxlib pin (default: the jax of the `python` on PATH, when it is
# maxtrain's venv, else 0.10.2). Packages come from pip's configured index only.
set -euo pipefail

VENV=${1:-${MAXTEXT_VENV:-$HOME/.cache/maxtrain/maxtext-venv}}
MAXTEXT_VERSION=0.2.5

find_python312() {
  if [ -n "${MAXTEXT_BASE_PYTHON:-}" ]; then echo "$MAXTEXT_BASE_PYTHON"; return; fi
  local root
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for p in "$root"/versions/3.12.*/bin/python; do
    [ -x "$p" ] && { echo "$p"; return; }
  done
  command -v python3.12 || true
}

PY312=$(find_python312)
if [ -z "$PY312" ] || ! "$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  echo "maxtext_env.sh: error: no Python 3.12 found (pyenv install 3.12, or set MAXTEXT_BASE_PYTHON)" >&2
  exit 2
fi

if [ -z "${JAX_VERSION:-}" ]; then
  JAX_VERSION=$(python -c 'import jax, maxtrain; print(jax.__version__)' 2>/dev/null || echo 0.10.2)
fi
if [ "$JAX_VERSION" != 0.10.2 ]; then
  echo "maxtext_env.sh: note: jax $JAX_VERSION; the other pins below were chosen for 0.10.2" >&2
fi

echo "MaxText $MAXTEXT_VERSION venv at $VENV, Python $("$PY312" -c 'import platform; print(platform.python_version())'), jax $JAX_VERSION"
"$PY312" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# Every package the run imports, pinned; the first group are the ones maxtrain's venv has too.
REQUIREMENTS=$(cat <<EOF
maxtext==$MAXTEXT_VERSION
jax==$JAX_VERSION
jaxlib==$JAX_VERSION
numpy==2.4.6
scipy==1.17.1
ml_dtypes==0.7.0
opt_einsum==3.4.0
flax==0.12.8
optax==0.2.8
orbax-checkpoint==0.12.8
tensorstore==0.1.86
grain==0.2.18
absl-py==2.5.1
etils==1.15.0
msgpack==1.2.4
protobuf==7.36.2
PyYAML==6.0.4
rich==15.0.0
markdown-it-py==4.3.0
mdurl==0.1.2
Pygments==2.21.0
treescope==0.1.10
typing_extensions==4.16.0
humanize==4.17.0
simplejson==4.3.0
psutil==7.2.2
aiofiles==25.1.0
zipp==4.1.2
fsspec==2026.9.0
cloudpickle==3.1.3
array_record==0.8.6
pydantic==2.14.4
pydantic_core==2.50.5
annotated-types==0.8.0
typing-inspection==0.4.5
annotated-doc==0.0.7
anyio==4.16.0
click==8.5.1
h11==0.16.0
idna==3.20
packaging==26.4
portpicker==1.6.0
prometheus_client==0.26.0
filelock==4.3.2
Jinja2==3.1.6
MarkupSafe==3.0.4
httpx2==2.16.2
httpcore2==2.16.2
huggingface_hub==2.4.0
transformers==5.25.0
tokenizers==0.23.3
safetensors==0.8.0
regex==2026.11.19
tqdm==4.70.1
typer==0.29.2
kernels==0.19.1
truststore==0.10.5
uvloop==0.23.0
sentencepiece==0.2.3
pillow==13.0.0
sympy==1.14.0
mpmath==1.3.0
aqtp==0.9.0
qwix==0.1.8
tokamax==0.0.12
typeguard==2.13.3
jaxtyping==0.3.11
wadler_lindig==0.1.8
einshape==1.0
drjax==0.2.1
immutabledict==4.3.1
ml_collections==1.1.0
omegaconf==2.4.0
pathwaysutils==0.1.13
fastapi==0.165.0
starlette==1.10.0
opentelemetry-api==1.45.2
uvicorn==0.55.0
requests==2.34.2
urllib3==2.8.0
certifi==2026.10.19.post1
charset-normalizer==3.5.3
fire==0.7.1
termcolor==3.3.0
six==1.17.0
tiktoken==0.14.0
EOF
)
REQ_FILE=$(mktemp)
trap 'rm -f "$REQ_FILE"' EXIT
echo "$REQUIREMENTS" > "$REQ_FILE"
"${PIP[@]}" install --quiet --no-deps -r "$REQ_FILE"

# the one shim (see the header): a guarded import of must_fuse_call, idempotent
"$VENV/bin/python" - <<'EOF'
import importlib.util, pathlib, sys
path = pathlib.Path(importlib.util.find_spec("maxtext").origin).parent / "kernels" / "attention" / "jax_flash_attention.py"
old = "from jax.experimental.xla_metadata import must_fuse_call\n"
new = ("try:  # maxtrain bench/maxtext_env.sh: jax < 0.11 has no must_fuse_call; only the TPU flash path calls it\n"
       "  from jax.experimental.xla_metadata import must_fuse_call\n"
       "except ImportError:\n"
       "  def must_fuse_call(*args, **kwargs):\n"
       "    raise NotImplementedError('must_fuse_call needs jax >= 0.11 (shimmed by maxtrain bench/maxtext_env.sh)')\n")
src = path.read_text()
if new in src:
    print(f"shim already in {path}")
elif src.count(old) == 1:
    path.write_text(src.replace(old, new))
    print(f"shimmed the must_fuse_call import of {path}")
else:
    sys.exit(f"maxtext_env.sh: error: {path} does not import must_fuse_call as expected; check the MaxText version")
EOF

# what the bench imports, imported once here so a missing package shows now, not mid-benchmark
DECOUPLE_GCLOUD=TRUE JAX_PLATFORMS=cpu "$VENV/bin/python" - <<'EOF'
import jax, flax, maxtext
from flax import nnx
from maxtext.trainers.pre_train import train
from maxtext.utils import max_utils, maxtext_utils, sharding, train_utils
from maxtext.input_pipeline import grain_data_processing  # imported by setup_train_loop
assert hasattr(train, "make_synthetic_batch")
from importlib.metadata import version
print(f"ok: maxtext {version('maxtext')}, jax {jax.__version__}, jaxlib {version('jaxlib')}, flax {flax.__version__}")
EOF
"${PIP[@]}" freeze > "$VENV/maxtext-freeze.txt"
echo "installed $(wc -l < "$VENV/maxtext-freeze.txt") packages (list: $VENV/maxtext-freeze.txt)"
echo "MAXTEXT_PYTHON=$VENV/bin/python"
