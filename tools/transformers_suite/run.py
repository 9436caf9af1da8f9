"""Run the Hugging Face Trainer's own checkpointing tests stock and with ``attach_trainer()`` on every Trainer.

The Trainer's tests are not part of this project: they are extracted elsewhere (see README.md) and only pointed to
here. The runner is Accelerate's (``tools/accelerate_suite/run.py``), with this folder's pytest plugin
(``trainer_plugin.py``) in place of its own, so all three peer judges count alike.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("accelerate_suite_run", HERE.parent / "accelerate_suite" / "run.py")
assert _spec is not None and _spec.loader is not None
runner = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)

DEFAULTS = [
    *("--plugin", "trainer_plugin", "--title", "The Trainer's tests", "--attached", "Trainers"),
    *("--label", "transformers tests/trainer", "--files", "tests/trainer/test_trainer_checkpointing.py"),
    "tests/trainer/test_trainer_resume.py",
]

if __name__ == "__main__":
    # the plugin's folder on the tests' path; later options win: the caller's --files or --label replace these
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    sys.exit(runner.main([*DEFAULTS, *sys.argv[1:]]))
