"""The attnbench binary beside these scripts, and the variants of a results directory as the
binary describes them, with the plugins the run loaded.

meta.json records what `attnbench list --json` said when the sweep ran (`variants`: each
variant's parameters with their defaults, its capabilities, the plugin it came from) and the
plugins the sweep loaded (`plugins`; those of earlier sweeps of a resumed directory in
`earlier_runs`). A directory written before meta.json recorded `variants`, or holding rows of a
variant the last sweep did not load, lacks some of them: `complete_variants` then asks the
binary, loading the recorded plugins with --plugin, so that a plugin's variants are described
as well as the built-in ones. A recorded plugin that no longer exists is named in a warning and
left out; only the description of its variants is missing then.
"""

import json
import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
# Written by `cmake --install` into the installed scripts directory (CMakeLists.txt): the path
# of the installation's bin/attnbench, relative to that directory (or absolute).
INSTALLED_BINARY = os.path.join(HERE, "installed_binary.txt")


def installed():
    """True when these scripts run from an installation (`cmake --install`), not from the
    source tree."""
    return os.path.isfile(INSTALLED_BINARY)


def default_binary():
    """The attnbench binary that belongs with these scripts: the installation's bin/attnbench,
    or build/attnbench of the source tree they are in."""
    if installed():
        with open(INSTALLED_BINARY, encoding="utf-8") as f:
            return os.path.normpath(os.path.join(HERE, f.read().strip()))
    return os.path.join(os.path.dirname(HERE), "build", "attnbench")


def recorded_plugins(meta):
    """The plugin files the runs of a results directory loaded, in load order, each once: the
    earlier runs' of a resumed directory first."""
    runs = [r for r in meta.get("earlier_runs") or [] if isinstance(r, dict)] + [meta]
    paths = []
    for run in runs:
        for p in run.get("plugins") or []:
            if isinstance(p, str) and p and p not in paths:
                paths.append(p)
    return paths


def complete_variants(meta, names, binary, warn, where="meta.json"):
    """Makes meta["variants"] describe every variant in `names` (the variants of the results),
    asking `binary` (with the recorded plugins loaded) for those meta.json lacks. Problems are
    reported through warn(message) and leave the description incomplete; nothing is raised.
    Returns the names still undescribed."""
    variants = [v for v in meta.get("variants") or [] if isinstance(v, dict) and "name" in v]
    missing = [n for n in names if n not in {v["name"] for v in variants}]
    if not missing:
        return []
    plugins, absent = [], []
    for p in recorded_plugins(meta):
        (plugins if os.path.isfile(p) else absent).append(p)
    for p in absent:
        warn(f"the plugin {p} that {where} records does not exist (moved or deleted?); the "
             f"variants only it registers are drawn with their full spec as label")
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        warn(f"{where} does not describe the variant(s) {', '.join(missing)} and there is no "
             f"attnbench binary at {binary} to ask (give one with --attnbench): their labels "
             f"are their full spec")
        return missing
    cmd = [binary] + [a for p in plugins for a in ("--plugin", p)] + ["list", "--json"]
    listed, reason = None, None
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        reason = str(e)
    else:
        err = run.stderr.strip().splitlines()
        if run.returncode != 0:
            reason = err[-1] if err else f"exit status {run.returncode}"
        else:
            try:
                listed = json.loads(run.stdout)
            except ValueError:
                reason = "its output is not JSON"
    if not isinstance(listed, list):
        warn(f"`{' '.join(cmd)}` failed ({reason or 'its output is not a list'}): the "
             f"variant(s) {', '.join(missing)} are labelled by their full spec")
        return missing
    by_name = {v.get("name"): v for v in listed if isinstance(v, dict)}
    variants += [by_name[n] for n in missing if n in by_name]
    meta["variants"] = variants
    still = [n for n in missing if n not in by_name]
    if still:
        loaded = f" with the plugin(s) {', '.join(plugins)}" if plugins else " without plugins"
        maybe = "; the missing plugin(s) named above may register them" if absent else ""
        warn(f"`attnbench list` ({binary}{loaded}) does not know the variant(s) "
             f"{', '.join(still)}{maybe}: labelled by their full spec")
    return still
