"""Peak host memory of a run: the training process and every process it started, sampled while the run lasts.

A save's helper processes (our engine's ``persist="process"`` helper, DCP's checkpoint process) hold memory of
their own, and share the staging buffers with the training process. So each sample reads the resident memory of
this process and of every live descendant (``/proc/<pid>/statm`` through psutil: cheap enough for every 50 ms)
and keeps two sums, whose peaks over the run are reported:

- ``rss``: the resident set sizes added up. Pages mapped by two processes (shared-memory staging buffers that
  the helper reads, libraries) count once per process, so this overstates what the run holds;
- ``rss_once``: this process's resident set, plus each descendant's resident pages that are not shared (anonymous
  memory: ``rss - shared``). Shared pages count once, as this process's, which holds the staging buffers of ours
  and of DCP's stager; a descendant's shared pages that this process does not map are left out, and the
  copy-on-write pages a helper forked from our fork server shares with it count in both. The kernel's
  proportional set size (PSS) splits every shared page exactly, but reading it walks every page table (25 ms per
  GB resident), which would load the machine it measures; at 0.15 GB of state, mid-save, the two sums agreed
  within 1% for ours and 3% for DCP's recipe.

A benchmark runs many fits in one process, and some helpers outlive a fit, as they outlive nothing in a training
run: our engine's fork server, DCP's checkpoint process (``persistent_helpers``), each started in the warm-up. A
run counts those of its own variant (``keep``) and leaves out every other process that was already running when
it began, so that one variant's idle helper is not counted in another's runs.

Many fits run in one benchmark process, and a fit's peak carries the memory earlier fits left in it (the no-save
fit's peak moved by gigabytes from round to round at 1.6 GB), so these sums say little when ways of saving are
compared; ``bench_fit_memory.py`` runs each fit in a fresh process and sums the kernel's PSS instead.

Sampled, not the kernel's high-water marks (``ru_maxrss``): those cannot be added up across processes that peak
at different times, nor reset between runs.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping, Sequence

from benchmarks.common import Report, Sample, Stats

GIB = 2**30


def persistent_helpers(owner: str) -> set[int]:
    """The pids of the helpers that outlive a fit, of ``owner``: "ours" (our engine's fork server, whose helpers
    are its children) or "dcp" (DCP's checkpoint process); none for any other."""
    pids = set()
    if owner == "ours":
        from resilience.persist.fork_server import ForkServer

        server = ForkServer._instance
        if isinstance(server, ForkServer) and server.alive():  # not a server inherited from a parent process
            pids.add(server.process.pid)
    elif owner == "dcp":
        from torch.distributed.checkpoint import _async_process_executor as executor

        process = executor._CHECKPOINT_PROCESS
        if process is not None and process._save_process.is_alive() and process._save_process.pid is not None:
            pids.add(process._save_process.pid)
    return pids


class TreeMemory:
    """While entered, samples this process's and its descendants' resident memory every ``interval_s``;
    ``sample()`` then holds the peaks, in GiB (``rss``, ``rss_once``: see the module's docstring). Of the
    processes already running as it is entered, only those in ``keep`` are counted."""

    def __init__(self, keep: Collection[int] = (), interval_s: float = 0.05) -> None:
        import psutil

        self._psutil = psutil
        self._process = psutil.Process()
        self._left_out = {child.pid for child in self._process.children(recursive=True)} - set(keep)
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-tree-memory", daemon=True)
        self.rss = self.rss_once = 0

    def _read(self) -> None:
        total = once = self._process.memory_info().rss
        for child in self._process.children(recursive=True):
            if child.pid in self._left_out:
                continue
            try:
                info = child.memory_info()
            except self._psutil.Error:  # ended between the listing and the read
                continue
            total += info.rss
            once += max(0, info.rss - info.shared)
        self.rss, self.rss_once = max(self.rss, total), max(self.rss_once, once)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._read()

    def __enter__(self) -> TreeMemory:
        self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read()

    def sample(self) -> Sample:
        return {"rss": self.rss / GIB, "rss_once": self.rss_once / GIB}


def memory_table(report: Report, runs: Mapping[str, Sequence[Sample]], no_saves: str | None = None) -> None:
    """A table of each variant's peak host memory per run (median [IQR] over its runs), and, given the no-save
    variant, what saving added to it (the difference of the medians)."""
    base = {key: Stats.of(s[key] for s in runs[no_saves]).median for key in ("rss", "rss_once")} if no_saves else {}
    headers = ["variant", "peak RSS, all processes (GiB)", "peak, shared pages once (GiB)"]
    if base:
        headers += ["added by saving (all processes)", "added by saving (shared once)"]
    rows = []
    for variant, samples in runs.items():
        stats = {key: Stats.of(s[key] for s in samples if key in s) for key in ("rss", "rss_once")}
        row = [variant, stats["rss"].fmt(2), stats["rss_once"].fmt(2)]
        if base:
            row += [f"{stats[key].median - base[key]:+.2f}" if variant != no_saves else "-" for key in base]
        rows.append(row)
    report.table(headers, rows)


def report_memory(report: Report, fits: Mapping[int, Mapping[str, Sequence[Sample]]], no_saves: str) -> None:
    """``common.paired_rounds``' fits: a memory table per save interval, and what it measures."""
    report.heading("Peak host memory per run")
    for every, by_variant in fits.items():
        report.add(f"A save every {every} steps:")
        memory_table(report, by_variant, no_saves)
    report.add(f"- {MEMORY_NOTE}")


MEMORY_NOTE = (
    "Peak host memory: the highest sum, sampled every 50 ms during the run, of the resident memory of the "
    "training process and every process it started (our helper and its fork server, DCP's checkpoint process, "
    "loader workers; of the helpers that outlive a fit, only the variant's own); 'shared pages once' counts a "
    "helper's pages shared with the training process (the staging buffers it reads, libraries) once, not twice "
    "(`benchmarks/host_memory.py`). Fits share one process here, so a fit's peak carries what earlier fits left: "
    "to compare ways of saving, use `benchmarks/bench_fit_memory.py` (a fresh process per fit, PSS)."
)
