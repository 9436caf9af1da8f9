#!/usr/bin/env bash
# The lowest stated versions (requirements/floors.txt) in a virtual environment of their own, and a smoke set of
# the tests on them: for each floor, tests that fail if the code (or the tests) used an API newer than it; the
# list below says which test stands for which floor. CI runs this (.ci/run). FULL=1 also runs the larger set of
# whole test files this run used before it became the smoke (a few minutes longer).
# torch stays at the CPU wheel the dev environment has (2.13.0), so its floor is not tested here. The
# environment is reused while floors.txt and pyproject.toml are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE_VENV:-.venv}
VENV=${FLOORS_VENV:-.venv-floors}
case $VENV in /*) ;; *) VENV=$PWD/$VENV ;; esac  # the typed check below runs elsewhere
FULL=${FULL:-}
[ -x "$BASE/bin/python" ] || { echo "no $BASE: run make setup first" >&2; exit 2; }
pip() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v 'is ignored: it is neither a file' >&2); }
install() { pip install -q --retries 10 --timeout 60 "$@"; }
# Explicit node ids, so: a renamed test is an error (not found), `-m 'slow or not slow'` keeps a test that is
# later marked slow, and any skip fails the run below (a skipped test exercises no floor). --timeout fails at
# once if pytest-timeout did not load.
report=$(mktemp)
trap 'rm -f "$report"' EXIT
pytest() {
  local rc=0
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m 'slow or not slow' --timeout 300 -rs --disable-warnings \
    --junitxml "$report" "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "test-floors: pytest collected no tests: that is a failure here, not a pass" >&2
    exit 1
  fi
  [ "$rc" -eq 0 ] || exit "$rc"
  if grep -q '<skipped' "$report"; then
    echo "test-floors: a test was skipped (see above), so its floor went untested" >&2
    exit 1
  fi
}

if [ ! -f "$VENV/.installed" ] || [ requirements/floors.txt -nt "$VENV/.installed" ] \
    || [ pyproject.toml -nt "$VENV/.installed" ]; then
  rm -rf "$VENV"
  # The dev environment (torch 2.13.0 and every dependency at the versions the suite runs), copied as hard links
  # (2 s, against 15 s for a copy of its 1.4 GB), then every stated dependency moved down to its floor. The
  # links are safe: pip and Python replace a file (unlink, or write aside and rename), never write into one,
  # so the dev environment's files are never changed. Across file systems it falls back to a copy.
  cp -al "$BASE" "$VENV" 2>/dev/null || { rm -rf "$VENV"; cp -a "$BASE" "$VENV"; }
  rm -f "$VENV/.installed"  # the dev environment's own stamp came along
  # The editable install goes (the distribution is installed below), and so does S3's stack: s3fs pins fsspec
  # to its own, newer, release, so it comes in only for the second part.
  pip uninstall -q -y training-resilience s3fs aiobotocore
  mapfile -t floors < <(sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' requirements/floors.txt | grep -vx -e s3fs -e aiobotocore)
  # One resolution: every floor but S3's, and the distribution itself, not editable (so the build and the
  # py.typed files are checked as a user gets them) and with its own requirements checked against the floors.
  # Built with the environment's own setuptools (84 here; pyproject.toml asks >=64), not a fresh download.
  install --no-build-isolation -c requirements/floors.txt "${floors[@]}" 'jsonargparse[signatures]' 'moto[server]' .
  touch "$VENV/.installed"
else
  if "$VENV/bin/python" -c 'import s3fs' 2>/dev/null; then
    # A reused environment that ran the S3 part last: back to fsspec's floor.
    pip uninstall -q -y s3fs aiobotocore
    install -c requirements/floors.txt fsspec
  fi
  # A reused environment holds the distribution as this checkout was when it was made: the processes the tests
  # start (helpers, fork servers) import that installed copy, so it must be this checkout's.
  install --no-build-isolation --no-deps --force-reinstall .
fi

# The installed copy, not this checkout, is typed; its metadata says so without importing torch.
(cd /tmp && "$VENV/bin/python" -c '
import importlib.metadata as m
dist = m.distribution("training-resilience")
for package in ("resilience", "lightning_resilience", "accelerate_resilience"):
    assert dist.locate_file(f"{package}/py.typed").is_file(), f"{package}/py.typed is not installed"
assert "editable" not in (dist.read_text("direct_url.json") or ""), "an editable install: not what users get"
names = "numpy fsspec xxhash lightning jsonargparse zlib-ng accelerate transformers nvidia-ml-py torchdata matplotlib moto psutil pytest"
print("floors:", ", ".join(f"{n} {m.version(n)}" for n in names.split()))
')

# 1. Every floor but S3's, with fsspec 2024.12. Which test stands for which floor:
smoke=(
  # pytest 8, pytest-xdist 3.5, pytest-timeout 2.2: this run itself (two workers, --timeout). The floor pins
  # match pyproject.toml; the packages are marked typed; jsonargparse 4.39 (with lightning 2.6):
  # LightningCLI instantiates the example config (4.27.7 failed there).
  tests/test_packaging.py
  # numpy 1.24: numpy RNG state and scalars through the state tree.
  tests/test_engine_units.py::test_tree_keeps_key_types_tuples_and_special_values
  # xxhash 3.4.1: xxh3_64 of mapped and streamed files; a flipped byte is caught by its checksum.
  'tests/test_engine_units.py::test_hash_stream_agrees_for_mapped_files_buffered_streams_and_copies[3145728]'
  'tests/test_engine_local.py::test_corrupt_checkpoint_is_skipped_with_a_warning_and_quarantined[flip-full]'
  tests/test_engine_local.py::test_save_commit_load_roundtrip
  # fsspec 2024.12: pipe_file(mode="create"), the durable manifest's exclusive write (memory:// ignored the mode
  # before it: the test fails on 2024.10); an emergency save committed to a memory:// durable tier.
  'tests/test_engine_units.py::test_an_exclusive_write_refuses_a_file_that_exists[memory]'
  tests/test_health_guard.py::test_emergency_save_commits_within_grace_and_reports_timings
  # lightning 2.6 (+ torchdata, numpy): real fits, saved and resumed in process: through ckpt_path and the
  # plugin's load_checkpoint(weights_only=); through AutoResume, with the resumed run's logged losses equal to an
  # uninterrupted run's; a Lightning .ckpt exported from the engine loads as the one Lightning saved.
  tests/test_lightning_names.py::test_a_fit_leaves_no_thread_and_the_plugin_saves_again_in_the_next_fit
  tests/test_lightning_resume_habits.py::test_a_resumed_run_continues_the_logger_version_names_best_k_and_metric_rows
  tests/test_export.py::test_lightning_export_is_the_file_the_names_hold
  # zlib-ng 0.4: a name's CRC-32s computed as its bytes are copied from shards that carry none (zip-checked).
  'tests/test_lightning_names.py::test_top_k_and_last_names_are_lightning_files_that_load_anywhere[True-background]'
  # torchdata 0.11: a Trainer holding a StatefulDataLoader pickles (0.10's holds a generator).
  tests/test_lightning_names.py::test_torch_save_of_a_trainer_with_the_pack
  # accelerate 1.3 (+ torchdata): save_state and a bit-exact resume, mid-epoch with a StatefulDataLoader and at
  # an epoch boundary with a plain DataLoader. Not [mid-epoch-plain]: exact only from accelerate 1.15
  # (accelerate#4071: skip_first_batches kept epoch 0's shuffle); docs/ACCELERATE.md says so.
  'tests/test_accelerate_handle.py::test_stop_and_resume_is_exact[mid-epoch-stateful]'
  'tests/test_accelerate_handle.py::test_stop_and_resume_is_exact[after-the-last-batch-of-epoch-0-plain]'
  # transformers 5.13 (+ accelerate 1.3): the Trainer's save, boundary and load methods the pack stands in for; a
  # resume at an epoch's end is bit-exact, and the best checkpoint outlives rotation and is loaded at the end. Not
  # [resilience/step-9], inside a later epoch: exact from accelerate 1.15 only, as for Accelerate's own loop.
  'tests/test_transformers_trainer.py::test_resume_from_a_named_step_ends_with_the_uninterrupted_weights[checkpoint-12]'
  tests/test_transformers_trainer.py::test_the_best_checkpoint_outlives_rotation_and_is_loaded_at_the_end
  # nvidia-ml-py 12.535.77: the real module with no driver; its ClocksEventReasons names and event constants.
  tests/test_health_guard.py::test_no_nvml_still_handles_signals
  tests/test_health_monitor.py::test_thermal_slowdown_is_degraded_and_reported_again_only_after_clearing
  tests/test_health_injection.py::test_env_injection_stops_at_the_given_step
  # matplotlib 3.7: the goodput report's plot.
  tests/test_goodput_report.py::test_table_and_png
  # psutil 5.9: the harness's kill_job.
  tests/test_harness.py
)
if [ -n "$FULL" ]; then
  smoke+=(
    tests/test_cli.py tests/test_engine_local.py tests/test_health_injection.py tests/test_goodput_report.py
    tests/test_lightning_names.py tests/test_export.py -k 'not four_times_larger and not durable_url'
  )
fi
pytest -n 2 --dist worksteal "${smoke[@]}"

# 2. S3 at its floors: s3fs 2025.10 (with the fsspec it pins), botocore 1.35.21, moto 5.0.15. A fresh, empty
# bucket is accepted (s3fs 2025.10's info()), saves commit there and a fresh node resumes from it; a manifest PUT
# carries If-None-Match (botocore; 1.35.0 drops it) and the server refuses it where the key exists (moto; 5.0.14
# accepts it). One process: a second worker would start a second moto server, which costs more than it saves.
install -c <(grep -v '^fsspec==' requirements/floors.txt) s3fs
s3=(
  tests/test_engine_s3.py::test_upload_commits_remotely_and_a_fresh_node_resumes_from_the_url
  tests/test_engine_s3.py::test_an_exclusive_write_refuses_a_key_that_exists
)
[ -z "$FULL" ] || s3+=(tests/test_engine_s3.py tests/test_reliability_s3.py tests/test_export.py::test_export_from_a_durable_url)
pytest "${s3[@]}"
