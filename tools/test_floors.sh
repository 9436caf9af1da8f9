#!/usr/bin/env bash
# The lowest stated versions (requirements/floors.txt) in a virtual environment of their own, and a smoke
# subset of the tests on them: one or two tests per dependency, where that dependency's floor comes from.
# torch stays at the CPU wheel the dev environment has (2.13.0), so its floor is not tested here. The
# environment is reused while floors.txt and pyproject.toml are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE_VENV:-.venv}
VENV=${FLOORS_VENV:-.venv-floors}
[ -x "$BASE/bin/python" ] || { echo "no $BASE: run make setup first" >&2; exit 2; }
pip() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v 'is ignored: it is neither a file' >&2); }
install() { pip install -q --retries 10 --timeout 60 "$@"; }
pytest() { "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"; }

if [ ! -f "$VENV/.installed" ] || [ requirements/floors.txt -nt "$VENV/.installed" ] \
    || [ pyproject.toml -nt "$VENV/.installed" ]; then
  rm -rf "$VENV"
  # A copy of the dev environment (torch 2.13.0 and every dependency at the versions the suite runs), then every
  # stated dependency moved down to its floor: installing all of it afresh takes minutes longer on 2 cores.
  cp -a "$BASE" "$VENV"
  rm -f "$VENV/.installed"  # the dev environment's own stamp came along
  pip uninstall -q -y training-resilience
  mapfile -t floors < <(sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' requirements/floors.txt | grep -vx s3fs)
  install -c requirements/floors.txt "${floors[@]}" 'jsonargparse[signatures]' 'moto[server]'
  # Not editable: this also builds and installs the distribution as a user gets it.
  install --no-deps .
  touch "$VENV/.installed"
fi

# The installed copy, not this checkout: typed, and at the floors.
python=$(cd "$VENV" && pwd)/bin/python
(cd /tmp && "$python" -c '
import importlib.resources, importlib.metadata as m
for package in ("resilience", "lightning_resilience", "accelerate_resilience"):
    assert importlib.resources.files(package).joinpath("py.typed").is_file(), package
print("floors:", ", ".join(f"{n} {m.version(n)}" for n in ("numpy", "fsspec", "lightning", "accelerate", "torchdata")))
')

# 1. Every floor but S3's: s3fs pins fsspec to its own (newer) release, so it is not installed yet.
pip uninstall -q -y s3fs aiobotocore 2>/dev/null || true
install -c requirements/floors.txt fsspec
pytest tests/test_packaging.py tests/test_cli.py tests/test_engine_local.py tests/test_health_injection.py \
  tests/test_goodput_report.py tests/test_accelerate_handle.py::test_stop_and_resume_is_exact \
  tests/test_lightning_names.py tests/test_export.py \
  -k 'not streams and not durable_url' \
  --deselect 'tests/test_accelerate_handle.py::test_stop_and_resume_is_exact[mid-epoch-plain]'
# Left out above, with why:
# - [mid-epoch-plain]: a plain DataLoader resumed inside epoch 1+ with skip_first_batches is exact only from
#   accelerate 1.15 (accelerate#4071: skip_first_batches kept epoch 0's shuffle); docs/ACCELERATE.md says so.

# 2. S3 at its floors: s3fs 2025.10 (and the fsspec it pins), botocore 1.35.21, moto 5.0.15.
install -c <(grep -v '^fsspec==' requirements/floors.txt) s3fs
pytest tests/test_engine_s3.py tests/test_export.py::test_export_from_a_durable_url
