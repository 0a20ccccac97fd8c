"""Loading and checking an attnbench results directory (results.csv and meta.json).

Shared by plot.py and compare.py. A results directory is what `attnbench sweep --out DIR`
writes: DIR/results.csv holds one row per (variant spec, problem), DIR/meta.json the machine,
commit and command of the run. Everything that is wrong with a directory is raised as
ResultsError with a one-line message that says what was found and what was expected;
`run_main` turns it into that message on stderr and exit code 2.

Also shared by every script that writes into a results directory (plot.py, anatomy.py,
swap_eval.py): `results_lock` holds the directory's lock (DIR/.attnbench.lock, the lock
`attnbench sweep` and `merge` take) while they write, and `atomic_write` and its variants write
each file through a temporary file renamed over it, so that no failure loses an earlier result.
"""

import contextlib
import datetime
import errno
import fcntl
import json
import math
import os
import socket
import sys
import time

import pandas as pd

# The problem columns that, with `spec`, identify a row (harness/results.cpp, kKeyColumns).
PROBLEM_COLUMNS = ["batch", "heads", "kv_heads", "n", "m", "dim", "embed", "causal", "score",
                   "score_hidden", "input", "scale", "seed", "threads", "key_padding", "attn_mask",
                   "pass", "dtype"]
# The mask columns: text, empty when the row has no key padding or no attention mask.
MASK_COLUMNS = ["key_padding", "attn_mask"]
KEY_COLUMNS = ["spec"] + PROBLEM_COLUMNS
# Key columns later versions added, with the value a row of an older file (written before the
# column existed) stands for (harness/results.cpp, kAddedColumns): read_csv fills them in, so old
# and new results join. `embed` is the embedding size of a multi-head layer row, 0 for plain
# attention; the mask columns are empty for no key padding and no attention mask. `pass` is what
# a row timed (FORWARD, or a training pass of TRAIN_PASSES): every row of a file written before
# it timed the forward. The training and decode columns are empty on forward rows. `kv_heads`
# (the key/value heads G of grouped-query attention) is the row's own `heads` in a file written
# before it (read_csv fills it from that column). `host` is the machine that measured the row
# (shards of one sweep may run on several), empty in a file written before it. `dtype` is the
# precision (F32, or bf16): every row of a file written before it ran in float32, and
# `rounded_input_error` (bf16 rows only) is empty there.
ADDED_COLUMNS = {"embed": 0, "score": "scaled_dot", "score_hidden": 0, "key_padding": "",
                 "attn_mask": "", "prepare_s": math.nan, "pass": "fwd",
                 "saved_bytes": math.nan, "saved_estimate_bytes": math.nan,
                 "grad_rel_err_q": math.nan, "grad_rel_err_k": math.nan,
                 "grad_rel_err_v": math.nan, "grad_heads": math.nan,
                 "prefill_s": math.nan, "time_per_token_s": math.nan,
                 "tokens_per_s": math.nan, "state_bytes": math.nan,
                 "bytes_read_per_step": math.nan, "bandwidth_fraction": math.nan,
                 "host": "", "dtype": "f32", "rounded_input_error": math.nan}
# The values of `pass` (`attnbench sweep --pass`): the forward alone, the backward alone (from a
# saved forward, its peak without the saved state), both in one timed pass, and one step of
# generation at context n (causal rows only).
FORWARD = "fwd"
# The float32 precision (`attnbench sweep --dtype`); the figures other than the precision table
# show float32 rows.
F32 = "f32"
BF16 = "bf16"
TRAIN_PASSES = ["bwd", "fwdbwd"]
DECODE = "decode"
# Columns of the training rows (pass bwd or fwdbwd; harness/runner.h, Row): the bytes the
# forward kept for the backward, measured and estimated, and the relative Frobenius error of
# dQ, dK and dV against exact attention's gradients over grad_heads whole heads.
GRAD_ERROR_COLUMNS = ["grad_rel_err_q", "grad_rel_err_k", "grad_rel_err_v"]
TRAIN_COLUMNS = ["saved_bytes", "saved_estimate_bytes"] + GRAD_ERROR_COLUMNS + ["grad_heads"]
# Columns of the decode rows (pass decode; harness/runner.h, Row): the seconds of the prefill
# of n tokens, one step's time (the row's time_median_s) and the tokens per second it gives,
# the state per sequence after the prefill, the bytes of state one step reads, and those bytes
# per step's time over the machine's memory bandwidth.
DECODE_COLUMNS = ["prefill_s", "time_per_token_s", "tokens_per_s", "state_bytes",
                  "bytes_read_per_step", "bandwidth_fraction"]
# Where a row's inputs came from (harness/runner.h, Row): input_source is "generated", "file"
# (an inputs file) or "trained@<first 12 hex of the checkpoint>" (--input trained[:layer=L]),
# and input_layer the layer of trained inputs, NaN for the others. A file written before them
# gets what its rows meant (read_csv, as kAddedColumns in harness/results.cpp does): "file" for
# input "file", "generated" for the rest, and NaN layers. Neither is a key column (the layer is in
# the input's name, trained:layer=L).
INPUT_SOURCE = "input_source"
INPUT_LAYER = "input_layer"
# Columns about the timing's trust (harness/runner.h, noise_reason): NaN in a file written
# before them, which compare.py then never calls noisy.
NOISE_COLUMNS = ["time_spread", "load_avg", "other_load", "noisy"]
# The relative error of the output that averages v over the keys each query may see (the
# "uniform average"), the same for every variant of a problem: absent from older files, whose
# error figures then draw only the zero output's error (1).
UNIFORM_ERROR = "uniform_error"
# Timing columns, in seconds: the median of the repetitions and their spread.
TIME_COLUMNS = ["time_median_s", "time_min_s", "time_max_s", "time_stddev_s"]
# What plot.py and compare.py read; a results.csv without one of these is refused.
REQUIRED_COLUMNS = [c for c in KEY_COLUMNS if c not in ADDED_COLUMNS] + ["status", "message"] + \
    TIME_COLUMNS + ["reps", "peak_bytes", "rel_fro_error"]
NUMERIC_COLUMNS = ["batch", "heads", "kv_heads", "n", "m", "dim", "embed", "causal", "score_hidden", "scale",
                   "seed", "threads", "reps"] + TIME_COLUMNS + ["peak_bytes", "rel_fro_error"]
INTEGER_COLUMNS = ["batch", "heads", "kv_heads", "n", "m", "dim", "embed", "causal", "score_hidden", "seed",
                   "threads", "reps"]


class ResultsError(Exception):
    """A results directory that cannot be used; the message is meant for the user as is."""


def not_a_results_directory(directory):
    """The ResultsError for a results directory that does not exist."""
    return ResultsError(f"'{directory}' is not a directory; expected a results directory "
                        f"written by `attnbench sweep --out DIR`")


# ---------------------------------------------------------------------------------------------
# Writing into a results directory

# The lock of a results directory, shared with `attnbench sweep` and `merge`
# (harness/output_dir.h, DirLock): a writer opens DIR/.attnbench.lock (created with mode 0644,
# never deleted), holds flock(LOCK_EX | LOCK_NB) on it for as long as it writes into DIR (the kernel
# releases it when the process dies), and after taking it truncates the file and writes one
# line of JSON saying who holds it: pid, host, command (argv joined by spaces) and started (UTC,
# ISO 8601). A writer that cannot take it reads that line and refuses.
LOCK_NAME = ".attnbench.lock"
# How long a refused writer waits for the holder's line when the file is still empty (the
# holder has the lock but has not written it yet).
_HOLDER_WAIT_S = 0.5


def lock_path(directory):
    return os.path.join(directory, LOCK_NAME)


def _holder_description(fd):
    """What the lock file open at fd says of its holder: 'pid P on HOST, started T: COMMAND',
    or None when the file holds no readable line (it waits a moment for a holder that has
    just taken the lock to write it)."""
    deadline = time.monotonic() + _HOLDER_WAIT_S
    while True:
        try:
            raw = os.pread(fd, 1 << 16, 0)
            info = json.loads(raw.decode("utf-8").strip() or "null")
        except (OSError, UnicodeDecodeError, ValueError):
            info = None
        if isinstance(info, dict) and "pid" in info:
            return (f"pid {info.get('pid')} on {info.get('host', 'an unknown host')}, started "
                    f"{info.get('started', 'at an unknown time')}: "
                    f"{info.get('command', 'unknown command')}")
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


@contextlib.contextmanager
def results_lock(directory, prog, create=True):
    """Holds the lock of the results directory `directory` (see LOCK_NAME) for the body of the
    `with`; `prog` names this script in the lock's command when sys.argv is empty.

    Creates the directory first (with create; without it, a missing directory is the
    ResultsError load_results raises). Raises ResultsError when another process holds the
    lock, naming it (its pid, host, start time and command from the lock file, or saying it is
    unknown when the file cannot be read), or when the lock file cannot be opened. The lock's
    descriptor is not inherited by child processes, so it is released when this process exits
    or leaves the `with`, whatever its children do.
    """
    if create:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise ResultsError(f"cannot create the results directory '{directory}' "
                               f"({e.strerror or e})") from None
    elif not os.path.isdir(directory):
        raise not_a_results_directory(directory)
    path = lock_path(directory)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise ResultsError(f"cannot open the lock file '{path}' of the results directory "
                           f"({e.strerror or e}); a script writes into a directory it can "
                           f"write") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ResultsError(f"cannot lock '{path}' ({e.strerror or e})") from None
            holder = _holder_description(fd)
            raise ResultsError(f"results directory '{directory}' is being written by another "
                               f"process ({holder or 'an unknown process'}); wait for it to "
                               f"finish or write elsewhere") from None
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        line = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "command": " ".join(sys.argv) if any(sys.argv) else prog,
                           "started": started}) + "\n"
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, line.encode("utf-8"), 0)
        except OSError:
            pass  # a full disk: the lock holds all the same, a refused writer says "unknown"
        yield path
    finally:
        os.close(fd)  # releases the flock


def _remove_quietly(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def _write_failed(path, reason):
    before = ("the previous file is left as it was" if os.path.exists(path)
              else "no file was written")
    return ResultsError(f"cannot write '{path}': {reason}; {before}")


def atomic_write(path, write, binary=True):
    """Writes the file `path` through `write(f)`, given a file object (binary, or text in UTF-8
    with newline="" without `binary`): into a temporary file beside it, flushed, synced and
    checked, then renamed over `path`. When anything fails (a full disk, ENOSPC, or any other
    OSError on the way) the temporary file is removed, `path` keeps what it held before (or
    still does not exist), and a ResultsError names the file and the reason. Other exceptions
    of `write` remove the temporary file and propagate. A path that exists and is not a regular
    file (a device such as /dev/stdout, a pipe) is written in place. Returns path."""
    text = {} if binary else {"encoding": "utf-8", "newline": ""}
    if os.path.exists(path) and not os.path.isfile(path):
        try:
            with open(path, "wb" if binary else "w", **text) as f:
                write(f)
        except OSError as e:
            raise ResultsError(f"cannot write '{path}': {e.strerror or e}") from None
        return path
    target = os.path.realpath(path)  # a symbolic link keeps pointing at the file it names
    directory = os.path.dirname(target) or "."
    tmp = os.path.join(directory, f".{os.path.basename(target)}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise _write_failed(path, e.strerror or str(e)) from None
    try:
        with os.fdopen(fd, "wb" if binary else "w", **text) as f:
            write(f)
            f.flush()
            size = os.lseek(f.fileno(), 0, os.SEEK_CUR)
            os.fsync(f.fileno())
            written = os.fstat(f.fileno()).st_size
        if written != size:
            raise OSError(errno.EIO, f"{written} of {size} bytes reached the file")
        os.replace(tmp, target)
    except OSError as e:
        _remove_quietly(tmp)
        raise _write_failed(path, e.strerror or str(e)) from None
    except BaseException:
        _remove_quietly(tmp)
        raise
    try:  # the rename itself survives a crash once the directory is synced
        dfd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    return path


def atomic_write_bytes(path, data):
    """atomic_write of the bytes `data`."""
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path, text):
    """atomic_write of the string `text` (UTF-8)."""
    return atomic_write(path, lambda f: f.write(text), binary=False)


def atomic_write_json(path, obj, **kwargs):
    """atomic_write of obj as JSON (json.dump's kwargs, e.g. indent)."""
    return atomic_write(path, lambda f: json.dump(obj, f, **kwargs), binary=False)


def load_results(directory, need_ok=True):
    """Reads DIR/results.csv into a DataFrame after checking it.

    Checks: the directory and file exist, the file parses as CSV, every REQUIRED_COLUMNS
    column is present, there is at least one row and (with need_ok) at least one row with
    status "ok", and the key and timing columns of ok rows are numbers. Returns the frame with
    numeric columns converted and `causal` as 0/1; a file written before the `pass` column (or
    the training or decode columns) gets them as ADDED_COLUMNS says: every such row timed the
    forward.
    """
    if not os.path.isdir(directory):
        raise not_a_results_directory(directory)
    path = os.path.join(directory, "results.csv")
    if not os.path.isfile(path):
        raise ResultsError(f"'{path}' does not exist; expected the results.csv that "
                           f"`attnbench sweep --out {directory}` writes")
    df = read_csv(path, ["spec", "score", "input", "status", "message", "pass", "dtype",
                         INPUT_SOURCE, "host"] +
                  MASK_COLUMNS,
                  REQUIRED_COLUMNS,
                  "a header line and one row per (variant, problem)")
    for c in MASK_COLUMNS:
        df[c] = df[c].fillna("").astype(str)
    if len(df) == 0:
        raise ResultsError(f"'{path}' has a header but no rows; expected one row per "
                           f"(variant, problem) from a sweep")
    df["message"] = df["message"].fillna("")
    df["host"] = df["host"].fillna("").astype(str)
    df["status"] = df["status"].fillna("")
    df["pass"] = df["pass"].fillna(FORWARD)
    df["dtype"] = df["dtype"].replace("", F32).fillna(F32)
    optional = [c for c in NOISE_COLUMNS + [UNIFORM_ERROR] if c in df.columns]
    for c in NUMERIC_COLUMNS + TRAIN_COLUMNS + DECODE_COLUMNS + [INPUT_LAYER] + optional:
        df[c] = pd.to_numeric(df[c], errors="coerce")
    ok = df["status"] == "ok"
    if need_ok and not ok.any():
        counts = ", ".join(f"{k}: {v}" for k, v in df["status"].value_counts().items())
        raise ResultsError(f"'{path}' has no row with status ok ({counts}); expected at least "
                           f"one measured row")
    # Every row must say which problem it is; ok rows must also carry a time.
    for c in INTEGER_COLUMNS[:-1] + ["scale"]:
        bad = df[c].isna() | ((df[c] != df[c].round()) if c in INTEGER_COLUMNS else False)
        if bad.any():
            line = int(bad.idxmax()) + 2
            raise ResultsError(f"'{path}' line {line}: column {c} is not a number; expected "
                               f"{'an integer' if c in INTEGER_COLUMNS else 'a number'}")
    bad = ok & ~(df["time_median_s"] > 0)
    if bad.any():
        line = int(bad.idxmax()) + 2
        raise ResultsError(f"'{path}' line {line}: status ok but time_median_s is not a positive "
                           f"number; expected the median time in seconds")
    for c in INTEGER_COLUMNS[:-1]:
        df[c] = df[c].astype(int)
    df["reps"] = df["reps"].fillna(0).astype(int)
    df["input"] = df["input"].fillna("")
    df["spec"] = df["spec"].fillna("")
    return df


def read_csv(path, text_columns, required, contents):
    """Reads a CSV file attnbench wrote (text_columns as strings, empty fields as NaN) and
    checks it has every `required` column; `contents` says what the file should hold. Raises
    ResultsError for an empty or unreadable file or a missing column."""
    try:
        df = pd.read_csv(path, dtype={c: str for c in text_columns}, keep_default_na=False,
                         na_values=[""])
    except pd.errors.EmptyDataError:
        raise ResultsError(f"'{path}' is empty; expected {contents}") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ResultsError(f"'{path}' is not a readable CSV file ({first})") from None
    for c, value in ADDED_COLUMNS.items():
        if c not in df.columns:
            df[c] = value
    if "kv_heads" not in df.columns and "heads" in df.columns:
        df["kv_heads"] = df["heads"]
    if "time_median_s" in df.columns:  # results.csv (not a patterns index)
        for c in NOISE_COLUMNS:
            if c not in df.columns:
                df[c] = math.nan
        if INPUT_LAYER not in df.columns:
            df[INPUT_LAYER] = math.nan
        if INPUT_SOURCE not in df.columns and "input" in df.columns:
            df[INPUT_SOURCE] = ["file" if i == "file" else "generated" for i in df["input"]]
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ResultsError(f"'{path}' lacks the column(s) {', '.join(missing)}; expected the "
                           f"columns attnbench writes, including {', '.join(required)}")
    return df


def load_meta(directory):
    """Reads DIR/meta.json. Returns None when the file does not exist (the caller says so);
    raises ResultsError when it exists but is not a JSON object."""
    path = os.path.join(directory, "meta.json")
    if not os.path.isfile(path):
        return None
    return read_json(path, "the meta.json `attnbench sweep` writes")


def cache_root():
    """The attnbench cache: $ATTNBENCH_CACHE, else $XDG_CACHE_HOME/attnbench, else
    ~/.cache/attnbench (the rule of the binary's `--input trained`, common/io/trained.h)."""
    if os.environ.get("ATTNBENCH_CACHE"):
        return os.environ["ATTNBENCH_CACHE"]
    if os.environ.get("XDG_CACHE_HOME"):
        return os.path.join(os.environ["XDG_CACHE_HOME"], "attnbench")
    return os.path.join(os.path.expanduser("~"), ".cache", "attnbench")


def read_json(path, expected):
    """The JSON object in `path`; raises ResultsError, saying `expected` (what the file should
    be), when it cannot be read or is not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ResultsError(f"'{path}' is not readable JSON ({e}); expected {expected}") from None
    if not isinstance(data, dict):
        raise ResultsError(f"'{path}' holds a JSON {type(data).__name__}; expected an object")
    return data


def time_spread(df):
    """Per row, max/min of the repetitions' times: the `time_spread` column, or for files
    written before it, time_max_s / time_min_s (NaN where either is missing)."""
    computed = df["time_max_s"] / df["time_min_s"].where(df["time_min_s"] > 0)
    return df["time_spread"].where(df["time_spread"].notna(), computed)


def noisy(df):
    """Per row, whether harness/runner.h's rule marked its timing noisy (the `noisy` column
    is 1); False for files written before the column."""
    return df["noisy"].fillna(0).astype(float) == 1.0


def spec_order(df):
    """Variant specs in the order they first appear (the order of the sweep's --variant)."""
    return list(dict.fromkeys(df["spec"]))


def problem_label(row, columns=PROBLEM_COLUMNS):
    """A compact `n=1024,causal=1,...` label of a row's problem columns."""
    parts = []
    for c in columns:
        v = row[c]
        if isinstance(v, float) and math.isfinite(v) and v == int(v):
            v = int(v)
        parts.append(f"{c}={v}")
    return ",".join(parts)


def format_seconds(t):
    """A time in seconds as text with a unit that keeps 3 significant digits readable."""
    if t is None or not math.isfinite(t):
        return "—"
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} µs"


def run_main(main, prog):
    """Runs main() and maps ResultsError (and a file that cannot be written) to
    `prog: error: message` on stderr and exit code 2."""
    try:
        code = main()
    except ResultsError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:
        # the reader of stdout went away (e.g. `| head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except OSError as e:  # e.g. a results directory that cannot be written
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
