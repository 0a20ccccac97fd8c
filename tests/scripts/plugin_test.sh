#!/usr/bin/env bash
# Out-of-tree plugins end to end: installs this build into a temporary prefix, builds
# examples/plugin (exact top-k attention) and the broken plugins of tests/plugin as separate
# CMake projects against it, and drives the installed binary with them. Top-k outputs, errors
# and patterns are checked against an independent numpy computation. The test suite
# (BUILD_DIR/tests/attnbench_tests) runs its per-variant checks on the plugin's variant, and
# fails them on a deliberately wrong copy of it (renamed with the example's one edit); the
# installed scripts (share/attnbench/scripts) run a sweep with the plugin and plot it.
#
# usage: plugin_test.sh BUILD_DIR SOURCE_DIR [CMAKE]
set -euo pipefail
build=$1
src=$2
cmake=${3:-cmake}
py=/usr/bin/python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# the machine figures every sweep starts with: measured once per ctest run (the test
# machine_figures, ATTNBENCH_TEST_MACHINE_DIR), else by this script's first sweep
machine=${ATTNBENCH_TEST_MACHINE_DIR:-$tmp}

fail() {
  echo "plugin_test: FAILED: $*" >&2
  exit 1
}

# refused NEEDLE... -- COMMAND...: COMMAND must exit with status 2 and say every NEEDLE on
# stderr.
refused() {
  local needles=()
  while [ "$1" != "--" ]; do needles+=("$1"); shift; done
  shift
  local status=0
  "$@" >"$tmp/out" 2>"$tmp/err" || status=$?
  [ "$status" -eq 2 ] || fail "exit status $status, expected 2: $* (stderr: $(cat "$tmp/err"))"
  for n in "${needles[@]}"; do
    grep -qF -- "$n" "$tmp/err" || fail "stderr of '$*' lacks '$n': $(cat "$tmp/err")"
  done
  echo "refused as expected: $(cat "$tmp/err")"
}

# --- install, then build the plugins as an outside user would ---
"$cmake" --install "$build" --prefix "$tmp/prefix" >/dev/null
bin=$tmp/prefix/bin/attnbench
prefix_lib=$(cd "$tmp/prefix/lib" && pwd -P)
# the installed binary finds its own libattnbench (RPATH $ORIGIN/../lib) and OpenBLAS's
# OpenMP build
lib_used=$(ldd "$bin" | awk '$1 ~ /^libattnbench\.so/ { print $3 }')
[ -n "$lib_used" ] && [ "$(realpath "$lib_used")" = "$(realpath "$prefix_lib/libattnbench.so")" ] ||
  fail "the installed binary does not load the installed libattnbench: $(ldd "$bin")"
# (ldd's output goes to a file first: grep -q stops reading at the match, and ldd, still
# writing the longer list of a sanitizer build, then dies of SIGPIPE and fails the pipeline)
ldd "$bin" >"$tmp/ldd"
grep -q "openblas-openmp/libopenblas" "$tmp/ldd" || fail "the installed binary misses OpenBLAS"
# only the plugin API is installed: no kernel or SIMD header (tests/plugin also compiles each
# installed header alone, which fails if one of them includes a header left out)
inc=$tmp/prefix/include/attnbench/common
for h in attention_kernels.h simd.h softmax.h tile_attention.h key_split.h plugin.h npy.h; do
  [ ! -e "$inc/$h" ] || fail "the internal header common/$h is installed"
done
! grep -l "immintrin\|__AVX512" "$inc"/*.h || fail "an installed header uses AVX-512 intrinsics"
for project in examples/plugin tests/plugin; do
  dir=$tmp/build-${project//\//-}
  if ! { "$cmake" -S "$src/$project" -B "$dir" -DCMAKE_PREFIX_PATH="$tmp/prefix" &&
         "$cmake" --build "$dir" -j2; } >"$tmp/log" 2>&1; then
    cat "$tmp/log" >&2
    fail "building $project against the installed attnbench"
  fi
done
topk=$tmp/build-examples-plugin/topk_attention.so
broken=$tmp/build-tests-plugin
[ -f "$topk" ] || fail "attnbench_add_plugin did not make $topk"
topk_real=$(realpath "$topk")

# --- loading: --plugin before or after the subcommand, ATTNBENCH_PLUGINS ---
"$bin" --plugin "$topk" list >"$tmp/list"
grep -q "^topk " "$tmp/list" || fail "list does not show topk"
grep -qF "from plugin $topk_real" "$tmp/list" || fail "list does not say where topk comes from"
# (output goes to a file first: grep -q would close the pipe early)
lists() { "$@" >"$tmp/list" && grep -q "^topk " "$tmp/list"; }
lists "$bin" list --plugin "$topk" || fail "--plugin after the subcommand"
lists env ATTNBENCH_PLUGINS="$topk" "$bin" list || fail "ATTNBENCH_PLUGINS"
# the same file twice (variable and option) is loaded once
lists env ATTNBENCH_PLUGINS="$topk::" "$bin" --plugin "$topk" list || fail "the same plugin twice"
"$bin" list >"$tmp/list"
grep -q "^topk " "$tmp/list" && fail "topk is listed without the plugin"
"$bin" --plugin "$topk" list --json >"$tmp/list.json"
"$py" - "$tmp/list.json" "$topk_real" <<'PY'
import json, sys
by_name = {v["name"]: v for v in json.load(open(sys.argv[1]))}
assert by_name["topk"]["plugin"] == sys.argv[2], by_name["topk"]
assert by_name["full"]["plugin"] is None, by_name["full"]
assert [p["name"] for p in by_name["topk"]["params"]] == ["k"], by_name["topk"]
PY

# --- run: with k >= every row's visible keys, top-k is exact attention ---
for causal in "" "--causal"; do
  "$bin" --plugin "$topk" run --variant topk:k=64 --seq 37 --seq-k 53 --heads 2 --dim 16 \
    $causal --reps 1 --min-time 0.01 --json >"$tmp/row.json"
  "$py" - "$tmp/row.json" <<'PY'
import json, os, sys
r = json.load(open(sys.argv[1]))
assert r["status"] == "ok", r
assert r["rel_fro_error"] < 1e-5, f"k >= m but rel. error {r['rel_fro_error']}"
assert abs(r["mass_mean"] - 1) < 1e-9 and abs(r["mass_min"] - 1) < 1e-9, r
# allocations inside the plugin are counted: one scratch row pair per thread (not in the
# sanitizer build, whose allocation hook steps aside for AddressSanitizer's allocator)
if os.environ.get("ATTNBENCH_SANITIZE") != "1":
    assert r["peak_bytes"] >= r["estimated_bytes"] > 0, r
PY
done

# --- run and pattern on given inputs against numpy's top-k attention ---
"$py" - "$tmp/in.npz" <<'PY'
import numpy as np, sys
rng = np.random.default_rng(7)
B, H, n, m, d = 1, 3, 45, 61, 16
q = (2.0 * rng.standard_normal((B, H, n, d))).astype(np.float32)  # sharper attention
k = rng.standard_normal((B, H, m, d)).astype(np.float32)
v = rng.standard_normal((B, H, m, d)).astype(np.float32)
np.savez(sys.argv[1], q=q, k=k, v=v)
PY
cat >"$tmp/check.py" <<'PY'
# check.py INPUTS.npz K CAUSAL ROW.json OUT.npy PATTERN.npy HEAD: top-k attention in float64
import json, sys
import numpy as np
f = np.load(sys.argv[1])
q, k, v = (f[x].astype(np.float64) for x in "qkv")
top, causal = int(sys.argv[2]), sys.argv[3] == "1"
row, out = json.load(open(sys.argv[4])), np.load(sys.argv[5])
pattern, head = np.load(sys.argv[6]), int(sys.argv[7])
B, H, n, d = q.shape
m = k.shape[2]
exact, topk = np.zeros_like(q), np.zeros_like(q)
mass, chosen = [], np.zeros((B, H, n, m), dtype=np.uint8)
for b in range(B):
    for h in range(H):
        s = q[b, h] @ k[b, h].T / np.sqrt(d)
        for i in range(n):
            vis = min(m, i + m - n + 1) if causal else m
            if vis <= 0:
                mass.append(1.0)
                continue
            logits = s[i, :vis]
            p = np.exp(logits - logits.max()); p /= p.sum()
            exact[b, h, i] = p @ v[b, h, :vis]
            # rank by larger logit, then lower key index
            order = sorted(range(vis), key=lambda j: (-logits[j], j))
            if vis > top:
                gap = logits[order[top - 1]] - logits[order[top]]
                assert gap > 1e-4, f"inputs too close to a tie for a float check (gap {gap})"
            sel = np.array(sorted(order[:top]))
            w = np.exp(logits[sel] - logits[sel].max()); w /= w.sum()
            topk[b, h, i] = w @ v[b, h, sel]
            chosen[b, h, i, sel] = 1
            mass.append(p[sel].sum())
assert row["status"] == "ok", row
diff = np.abs(out - topk).max()
assert diff < 2e-5, f"attnbench's topk output differs from numpy's by {diff}"
rel = np.linalg.norm(topk - exact) / np.linalg.norm(exact)
assert rel > 1e-2, f"top-{top} should be far from exact attention here, rel. error {rel}"
assert abs(row["rel_fro_error"] - rel) <= 1e-4 * rel, (row["rel_fro_error"], rel)
assert abs(row["mass_mean"] - np.mean(mass)) < 1e-6, (row["mass_mean"], np.mean(mass))
assert abs(row["mass_min"] - np.min(mass)) < 1e-6, (row["mass_min"], np.min(mass))
assert pattern.shape == (n, m) and (pattern == chosen[0, head]).all(), "pattern differs"
print(f"top-{top} causal={causal}: max |diff| {diff:.2e}, rel. error {rel:.4f} "
      f"(attnbench {row['rel_fro_error']:.4f}), mass {np.mean(mass):.4f}")
PY
for causal in 0 1; do
  flag=$([ "$causal" = 1 ] && echo --causal || true)
  "$bin" --plugin "$topk" run --variant topk:k=5 --inputs "$tmp/in.npz" $flag --reps 1 \
    --min-time 0.01 --json --output "$tmp/out.npy" >"$tmp/row.json"
  "$bin" --plugin "$topk" pattern --variant topk:k=5 --inputs "$tmp/in.npz" $flag --head 1 \
    --output "$tmp/pattern.npy" 2>/dev/null
  "$py" "$tmp/check.py" "$tmp/in.npz" 5 "$causal" "$tmp/row.json" "$tmp/out.npy" \
    "$tmp/pattern.npy" 1
done

# --- ties: with k = 0 every logit is exactly 0, and the lower key indices win ---
"$py" - "$tmp/ties.npz" <<'PY'
import numpy as np, sys
rng = np.random.default_rng(3)
q = rng.standard_normal((1, 2, 20, 8)).astype(np.float32)
v = rng.standard_normal((1, 2, 30, 8)).astype(np.float32)
np.savez(sys.argv[1], q=q, k=np.zeros_like(v), v=v)
PY
"$bin" --plugin "$topk" run --variant topk:k=4 --inputs "$tmp/ties.npz" --causal --reps 1 \
  --min-time 0.01 --json --output "$tmp/ties_out.npy" >"$tmp/row.json"
"$bin" --plugin "$topk" pattern --variant topk:k=4 --inputs "$tmp/ties.npz" --causal --head 1 \
  --output "$tmp/ties_pattern.npy" 2>/dev/null
"$py" - "$tmp/ties.npz" "$tmp/ties_out.npy" "$tmp/ties_pattern.npy" <<'PY'
import numpy as np, sys
v, out, pattern = np.load(sys.argv[1])["v"], np.load(sys.argv[2]), np.load(sys.argv[3])
n, m = out.shape[2], v.shape[2]
want = np.zeros((n, m), dtype=np.uint8)
want[:, :4] = 1  # the causal mask leaves query i keys 0 .. i + 10: always more than 4
assert (pattern == want).all(), "ties do not go to the lowest key indices"
assert np.abs(out - v[:, :, :4].mean(axis=2, keepdims=True)).max() < 1e-6, "tied output"
PY

# --- a short sweep, with meta.json naming the plugin ---
ATTNBENCH_PLUGINS="$topk" "$bin" sweep --variant topk:k=8 --variant full --seq 64,100 \
  --heads 2 --dim 16 --causal both --reps 1 --min-time 0.01 --out "$tmp/sweep" \
  --machine-file "$machine/threads-all.json" 2>/dev/null
"$py" - "$tmp/sweep" "$topk_real" <<'PY'
import csv, json, sys
rows = list(csv.DictReader(open(sys.argv[1] + "/results.csv")))
assert len(rows) == 8, len(rows)
assert all(r["status"] == "ok" for r in rows), [(r["spec"], r["message"]) for r in rows]
top = [r for r in rows if r["variant"] == "topk"]
assert len(top) == 4 and all(r["spec"] == "topk:k=8" for r in top), top
assert all(0 < float(r["mass_mean"]) < 1 for r in top), top
meta = json.load(open(sys.argv[1] + "/meta.json"))
assert meta["plugins"] == [sys.argv[2]], meta["plugins"]
PY

# --- the plugin from Python (the installed package): load_plugin, ATTNBENCH_PLUGINS on import,
# the NumPy functions, attnbench.torch and the layer ---
# (a build without the package, -DATTNBENCH_PYTHON=OFF or a sanitizer build, skips them)
if compgen -G "$build/python/attnbench/_attnbench*.so" >/dev/null; then
module=$(find "$tmp/prefix" -path '*/attnbench/_attnbench*.so' | head -1)
[ -n "$module" ] || fail "the build has the Python package, but none is installed under $tmp/prefix"
pypath=$(dirname "$(dirname "$module")")
cat >"$tmp/topk_np.py" <<'PY'
import numpy as np
def topk(q, k, v, top, causal):
    """Top-k attention in float64, ranked by larger logit, then lower key index."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    B, H, n, d = q.shape
    m = k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            s = q[b, h] @ k[b, h].T / np.sqrt(d)
            for i in range(n):
                vis = min(m, i + m - n + 1) if causal else m
                order = sorted(range(vis), key=lambda j: (-s[i, j], j))
                sel = np.array(order[:top])
                w = np.exp(s[i, sel] - s[i, sel].max())
                out[b, h, i] = (w / w.sum()) @ v[b, h, sel]
    return out
PY
echo "not a library" >"$tmp/text.so"
PYTHONPATH="$pypath:$tmp" "$py" - "$topk" "$topk_real" "$tmp/text.so" <<'PY' ||
import pathlib, sys
import numpy as np
import torch
import attnbench, attnbench.torch as at
from topk_np import topk
path, real, text = sys.argv[1:]
assert attnbench.loaded_plugins() == [], attnbench.loaded_plugins()
rng = np.random.default_rng(3)
q, k, v = (rng.standard_normal((2, 2, 23, 16)).astype(np.float32) for _ in range(3))
try:
    attnbench.attention("topk:k=5", q, k, v)
    raise AssertionError("topk ran before its plugin was loaded")
except ValueError as e:
    assert "unknown variant 'topk'" in str(e), e
assert attnbench.load_plugin(path) == ["topk"]
assert attnbench.load_plugin(pathlib.Path(path)) == ["topk"]  # loaded once
assert attnbench.loaded_plugins() == [real], attnbench.loaded_plugins()
want = topk(q, k, v, 5, True)
for out, what in ((attnbench.attention("topk:k=5", q, k, v, causal=True), "attention"),
                  (attnbench.Variant("topk:k=5").forward(q, k, v, causal=True), "Variant"),
                  (at.attention("topk:k=5", *map(torch.from_numpy, (q, k, v)),
                                causal=True).numpy(), "attnbench.torch.attention")):
    diff = np.abs(out - want).max()
    assert diff < 2e-5, f"{what}: the plugin's topk differs from numpy's by {diff}"
# the layer: its projections around the plugin's attention, as torch's layer computes them
torch.manual_seed(0)
layer = at.MultiheadAttention(32, 2, variant="topk:k=5")
x = torch.randn(2, 23, 32)
with torch.no_grad():
    out, _ = layer(x, x, x, need_weights=False, is_causal=True)
    w, b = layer.in_proj_weight, layer.in_proj_bias
    heads = lambda t: t.reshape(2, 23, 2, 16).transpose(1, 2).numpy()
    qh, kh, vh = (heads(x @ w[i * 32:(i + 1) * 32].T + b[i * 32:(i + 1) * 32]) for i in range(3))
    o = torch.from_numpy(topk(qh, kh, vh, 5, True)).float().transpose(1, 2).reshape(2, 23, 32)
    want = layer.out_proj(o)
diff = (out - want).abs().max().item()
assert diff < 1e-4, f"the layer with the plugin's topk differs from numpy's by {diff}"
try:
    attnbench.load_plugin(text)
    raise AssertionError("a text file loaded as a plugin")
except ImportError as e:
    assert text in str(e) and "not a shared library" in str(e), e
print("python: load_plugin, attention, Variant, attnbench.torch and the layer run the plugin")
PY
  fail "the plugin from Python"
ATTNBENCH_PLUGINS="$topk" PYTHONPATH="$pypath" "$py" -c '
import numpy as np, attnbench
assert "topk" in [v["name"] for v in attnbench.variants()]
q = np.ones((1, 1, 4, 8), np.float32)
assert attnbench.attention("topk:k=2", q, q, q).shape == (1, 1, 4, 8)' ||
  fail "ATTNBENCH_PLUGINS is not loaded on import"
status=0
ATTNBENCH_PLUGINS="$topk:$tmp/missing.so" PYTHONPATH="$pypath" "$py" -c 'import attnbench' \
  2>"$tmp/err" || status=$?
[ "$status" -ne 0 ] && grep -q "ImportError: $tmp/missing.so: no such file (in ATTNBENCH_PLUGINS)" "$tmp/err" ||
  fail "a missing plugin in ATTNBENCH_PLUGINS on import: status $status, $(cat "$tmp/err")"
else
  echo "python: this build has no Python package (-DATTNBENCH_PYTHON=OFF or a sanitizer build): the Python checks are not run"
fi

# --- refused plugins: a clear message naming the file, exit status 2 ---
refused "$tmp/missing.so" "no such file" -- "$bin" --plugin "$tmp/missing.so" list
refused "$tmp/missing.so" "ATTNBENCH_PLUGINS" -- env ATTNBENCH_PLUGINS="$topk:$tmp/missing.so" "$bin" list
echo "not a library" >"$tmp/text.so"
refused "$tmp/text.so" "not a shared library" -- "$bin" --plugin "$tmp/text.so" list
refused "$tmp" "a directory" -- "$bin" --plugin "$tmp" list
refused "$prefix_lib/libattnbench.so" "not an attnbench plugin" -- "$bin" --plugin "$prefix_lib/libattnbench.so" list
mkdir "$tmp/copy" && cp "$topk" "$tmp/copy/"
refused "$tmp/copy/topk_attention.so" "'topk' is already registered" "from plugin $topk_real" -- \
  "$bin" --plugin "$topk" --plugin "$tmp/copy/topk_attention.so" list
refused "$broken/clash_full.so" "'full' is already registered (built in)" -- \
  "$bin" --plugin "$broken/clash_full.so" run --variant full --seq 16 --heads 1 --dim 8
abi=$(sed -n 's/^#define ATTNBENCH_ABI_VERSION \([0-9]*\)$/\1/p' "$src/common/core/abi.h")
refused "$broken/other_abi.so" "built against attnbench ABI $((abi + 1)), this attnbench is ABI $abi" -- \
  "$bin" --plugin "$broken/other_abi.so" list
refused "$broken/wrong_entry.so" "cannot load" "undefined symbol" "register_variant_abi$((abi + 1))" -- \
  "$bin" --plugin "$broken/wrong_entry.so" list
refused "$broken/no_variants.so" "registers no variant" -- "$bin" --plugin "$broken/no_variants.so" list

# --- the test suite's per-variant checks on the plugin's variant ---
tests=$build/tests/attnbench_tests
[ -x "$tests" ] || fail "no test suite at $tests"
# suite PLUGIN OUT: runs the checks of every test that ranges over the variants on topk
suite() {
  local status=0
  ATTNBENCH_PLUGINS=$1 "$tests" --gtest_filter='*/topk' >"$2" 2>&1 || status=$?
  return "$status"
}
ATTNBENCH_PLUGINS="$topk" "$tests" --gtest_filter='*/topk' --gtest_list_tests >"$tmp/cases"
for suite_name in AllVariants/VariantTest. Exact/ExactNumerics. AllVariants/VariantParamBounds.; do
  grep -qF "$suite_name" "$tmp/cases" || fail "the suite has no $suite_name case for topk: $(cat "$tmp/cases")"
done
"$tests" --gtest_filter='*/topk' --gtest_list_tests >"$tmp/cases"
! grep -q "^  " "$tmp/cases" || fail "topk cases without the plugin loaded: $(cat "$tmp/cases")"
suite "$topk" "$tmp/suite.log" || { cat "$tmp/suite.log" >&2; fail "the suite's checks fail on topk"; }
ran=$(sed -n 's/^\[==========\] \([0-9]*\) tests\{0,1\} from .* ran\..*/\1/p' "$tmp/suite.log")
[ "${ran:-0}" -ge 14 ] || fail "the suite ran ${ran:-no} tests on topk, expected every per-variant check"
echo "test suite: $ran checks passed on the plugin's topk"
# A wrong copy: the example renamed by its one edit (PLUGIN_NAME), with outputs off by 1e-3.
cp -r "$src/examples/plugin" "$tmp/wrong"
sed -i 's/^set(PLUGIN_NAME topk_attention)$/set(PLUGIN_NAME topk_wrong)/' "$tmp/wrong/CMakeLists.txt"
grep -q "^set(PLUGIN_NAME topk_wrong)$" "$tmp/wrong/CMakeLists.txt" || fail "no PLUGIN_NAME line"
sed -i 's|^          const float inv = 1.0f / sum;$|          const float inv = 1.001f / sum;|' \
  "$tmp/wrong/topk.cpp"
! cmp -s "$src/examples/plugin/topk.cpp" "$tmp/wrong/topk.cpp" || fail "topk.cpp was not altered"
if ! { "$cmake" -S "$tmp/wrong" -B "$tmp/build-wrong" -DCMAKE_PREFIX_PATH="$tmp/prefix" &&
       "$cmake" --build "$tmp/build-wrong" -j2; } >"$tmp/log" 2>&1; then
  cat "$tmp/log" >&2
  fail "building the renamed copy of examples/plugin"
fi
[ -f "$tmp/build-wrong/topk_wrong.so" ] || fail "PLUGIN_NAME did not name the plugin file"
! suite "$tmp/build-wrong/topk_wrong.so" "$tmp/suite.log" || fail "the suite passes a wrong topk"
grep -q "FAILED.*AllVariants/VariantTest.MatchesReferenceOnRaggedShapes/topk" "$tmp/suite.log" ||
  fail "the wrong topk did not fail the reference check: $(tail -20 "$tmp/suite.log")"

# --- the installed scripts: help, a sweep with the plugin by sweep.sh, plots ---
scripts=$tmp/prefix/share/attnbench/scripts
for f in plot.py compare.py sweep.sh attnbench_results.py attnbench_variants.py \
  attnbench_plots/__init__.py attnbench_plots/report.py installed_binary.txt; do
  [ -f "$scripts/$f" ] || fail "$f is not installed in share/attnbench/scripts"
done
mkdir "$tmp/work"
cd "$tmp/work"
"$scripts/plot.py" --help >"$tmp/help" || fail "the installed plot.py --help"
grep -q "results directory" "$tmp/help" || fail "plot.py --help: $(cat "$tmp/help")"
"$scripts/compare.py" --help >/dev/null || fail "the installed compare.py --help"
ATTNBENCH_PLUGINS="$topk" bash "$scripts/sweep.sh" isweep --variant topk:k=8 --variant full \
  --seq 64 --heads 2 --dim 16 --reps 1 --min-time 0.01 --machine-file "$machine/threads-all.json" \
  >"$tmp/sweep.out" 2>&1 ||
  { cat "$tmp/sweep.out" >&2; fail "the installed sweep.sh"; }
[ ! -e "$tmp/work/build" ] || fail "the installed sweep.sh built something"
for f in results.csv meta.json report.md plots/time_vs_n.png; do
  [ -s "$tmp/work/isweep/$f" ] || fail "the installed sweep.sh wrote no isweep/$f"
done
"$py" - "$tmp/work/isweep" "$(realpath "$bin")" "$topk_real" "$scripts" "$tmp/missing.so" <<'PY'
import csv, json, os, shlex, sys
out, binary, plugin, scripts, missing = sys.argv[1:]
rows = list(csv.DictReader(open(out + "/results.csv")))
assert sorted(r["spec"] for r in rows) == ["full", "topk:k=8"], [r["spec"] for r in rows]
assert all(r["status"] == "ok" for r in rows), rows
meta = json.load(open(out + "/meta.json"))
assert os.path.realpath(shlex.split(meta["command_line"])[0]) == binary, meta["command_line"]
assert meta["plugins"] == [plugin], meta["plugins"]
# an older directory, whose meta.json does not describe its variants: the installed binary is
# asked with the plugin meta.json records
sys.path.insert(0, scripts)
import attnbench_variants as av
assert av.installed() and os.path.realpath(av.default_binary()) == binary, av.default_binary()
warnings = []
old = {k: v for k, v in meta.items() if k != "variants"}
assert av.complete_variants(old, ["topk", "full"], av.default_binary(), warnings.append) == []
assert not warnings, warnings
described = {v["name"]: v for v in old["variants"]}
assert described["topk"]["plugin"] == plugin, described["topk"]
assert [(p["name"], p["default"]) for p in described["topk"]["params"]] == [("k", "32")], described
# the recorded plugin is gone: named, and only its variant stays undescribed
old = {k: v for k, v in meta.items() if k != "variants"}
old["plugins"] = [missing]
left = av.complete_variants(old, ["topk", "full"], av.default_binary(), warnings.append)
assert left == ["topk"], left
assert any(missing in w and "does not exist" in w for w in warnings), warnings
assert [v["name"] for v in old["variants"]] == ["full"], old["variants"]
# written back for plot.py below
json.dump({k: v for k, v in old.items() if k != "variants"}, open(out + "/meta.json", "w"))
PY
rm -r "$tmp/work/isweep/plots"
"$scripts/plot.py" isweep >"$tmp/plot.out" 2>"$tmp/plot.err" ||
  { cat "$tmp/plot.err" >&2; fail "the installed plot.py on an older directory"; }
grep -qF "$tmp/missing.so" "$tmp/plot.err" && grep -q "does not exist" "$tmp/plot.err" ||
  fail "plot.py does not name the missing plugin: $(cat "$tmp/plot.err")"
[ -s "$tmp/work/isweep/plots/time_vs_n.png" ] || fail "no figures without the plugin"
cd - >/dev/null
echo "plugin_test: all checks passed"
