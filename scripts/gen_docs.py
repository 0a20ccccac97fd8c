#!/usr/bin/python3
"""The variant tables of the documentation, generated from the binary's own catalogue.

    scripts/gen_docs.py BINARY [--check]

Runs `BINARY list --json` (built-in variants only: ATTNBENCH_PLUGINS is cleared and plugin
variants are left out) and rewrites two regions:

  README.md          between <!-- generated:variants-table begin --> and
                     <!-- generated:variants-table end -->: one row per variant (variant,
                     family, exact, causal, backward, decode, paper);
  docs/variants.md   between <!-- generated:variants-reference begin --> and
                     <!-- generated:variants-reference end -->: one section per variant (summary,
                     complexity, capability flags, parameters with defaults and ranges).

Everything outside the regions is left as it is. Keys a catalogue entry may lack are filled in:
`family` as "other", `paper` as "—", `display`, `color` and `marker` left out.

With --check nothing is written: it prints a unified diff of what would change and exits 1
when a region differs from what the binary says (0 when both match). Exit code 2 when the
binary cannot be run or a file lacks its markers.
"""

import argparse
import difflib
import json
import os
import re
import subprocess
import sys

PROG = "gen_docs.py"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REGENERATE = "/usr/bin/python3 scripts/gen_docs.py build/attnbench"

# The families of `list --json`, in the order the tables group them, with the words the figures'
# legends use for them (scripts/attnbench_plots/style.py, FAMILY_NAME).
FAMILIES = {"exact": "exact", "pattern": "sparse pattern", "lowrank": "low-rank / kernel",
            "clustering": "clustering / hashing", "decay": "linear with decay / delta rule",
            "other": "other"}

# The capability flags of `list --json`, as the reference names them (docs/variants.md explains
# each one above the generated region).
FLAGS = [("causal", "causal"), ("cross", "m ≠ n"), ("exact", "exact"),
         ("linear_score", "dot, bilinear"), ("additive", "additive"),
         ("key_padding", "key padding"), ("attn_mask", "attention mask"), ("bf16", "bf16"),
         ("backward", "backward"), ("decode", "decode")]

REGIONS = [("README.md", "variants-table"), ("docs/variants.md", "variants-reference")]


class GenError(Exception):
    pass


def catalogue(binary):
    """The built-in variants as `BINARY list --json` describes them."""
    env = dict(os.environ)
    env.pop("ATTNBENCH_PLUGINS", None)
    try:
        r = subprocess.run([binary, "list", "--json"], capture_output=True, text=True, env=env)
    except OSError as e:
        raise GenError(f"cannot run {binary}: {e.strerror}")
    if r.returncode != 0:
        raise GenError(f"{binary} list --json failed (exit {r.returncode}): {r.stderr.strip()}")
    try:
        data = json.loads(r.stdout)
    except ValueError as e:
        raise GenError(f"{binary} list --json printed no JSON: {e}")
    if isinstance(data, dict):
        data = data.get("variants", [])
    variants = [v for v in data if isinstance(v, dict) and "name" in v and not v.get("plugin")]
    if not variants:
        raise GenError(f"{binary} list --json lists no variants")
    order = list(FAMILIES)
    return sorted(variants, key=lambda v: (order.index(family(v)) if family(v) in order
                                           else len(order), v["name"]))


def family(v):
    return v.get("family") or "other"


def family_label(v):
    return FAMILIES.get(family(v), family(v))


def text(s):
    """Catalogue text as markdown: characters that would start markup are escaped."""
    s = str(s)
    s = re.sub(r"([\\*~|])", r"\\\1", s)
    return re.sub(r"<(?=[A-Za-z/!?])", "&lt;", s)


def paper(v):
    """The citation, arXiv identifiers linked; "—" when there is none."""
    p = (v.get("paper") or "").strip()
    if not p:
        return "—"
    return re.sub(r"arXiv:(\d{4}\.\d{4,5})", r"[arXiv:\1](https://arxiv.org/abs/\1)", text(p))


def yes(flag):
    return "yes" if flag else "no"


def causal(v):
    return "only" if v.get("causal_only") else yes(v.get("causal"))


def number(x):
    x = float(x)
    return str(int(x)) if x.is_integer() else repr(x)


def accepted(p):
    """What a parameter accepts, from its type and range (or choices)."""
    kind = p.get("type", "")
    if "choices" in p:
        return " \\| ".join(f"`{c}`" for c in p["choices"])
    if kind == "bool":
        return "`true` \\| `false`"
    if "range" in p:
        lo, hi = (number(x) for x in p["range"])
        if kind == "int list":
            return f"integers in [{lo}, {hi}] joined by `+`, or `none`"
        return f"[{lo}, {hi}]"
    return ""


def readme_table(variants):
    rows = ["<!-- made by scripts/gen_docs.py from `attnbench list --json`: edit the variants' "
            "registrations, then regenerate -->",
            "",
            "| variant | family | exact | causal | backward | decode | learned inputs | paper |",
            "|---|---|---|---|---|---|---|---|"]
    for v in variants:
        name = f"[`{v['name']}`](docs/variants.md#{v['name']})"
        if v.get("display"):
            name += f" ({text(v['display'])})"
        rows.append(f"| {name} | {family_label(v)} | {yes(v.get('exact'))} | {causal(v)} | "
                    f"{yes(v.get('backward'))} | {yes(v.get('decode'))} | {learned(v)} | "
                    f"{paper(v)} |")
    return "\n".join(rows)


def learned(v):
    """The inputs beyond q, k and v, each with the setting that takes it: "`g`", "`beta`,
    `g` (gated=true)"; "—" for none."""
    names = [f"`{i['name']}`" + (f" ({i['when']})" if i.get("when") else "")
             for i in v.get("inputs") or []]
    return ", ".join(names) or "—"


def reference(variants):
    out = ["<!-- made by scripts/gen_docs.py from `attnbench list --json`: edit the variants' "
           "registrations, then regenerate -->"]
    for v in variants:
        out += ["", f"### {v['name']}", ""]
        if v.get("display"):
            out += [f"**{text(v['display'])}**", ""]
        out += [text(v.get("summary", "")), ""]
        facts = [("family", family_label(v)), ("paper", paper(v)),
                 ("complexity", text(v.get("complexity", "")))]
        if v.get("color") or v.get("marker"):
            style = ", ".join(s for s in (f"colour `{v['color']}`" if v.get("color") else "",
                                          f"marker `{v['marker']}`" if v.get("marker") else "")
                              if s)
            facts.append(("in figures", style))
        out += [f"- {k}: {val}" for k, val in facts] + [""]
        out += ["| " + " | ".join(label for _, label in FLAGS) + " |",
                "|" + "---|" * len(FLAGS),
                "| " + " | ".join(causal(v) if key == "causal" else yes(v.get(key))
                                  for key, _ in FLAGS) + " |"]
        params = v.get("params") or []
        if params:
            out += ["", "| parameter | type | default | accepts | meaning |",
                    "|---|---|---|---|---|"]
            for p in params:
                out.append(f"| `{p.get('name', '')}` | {p.get('type', '')} | "
                           f"`{p.get('default', '')}` | {accepted(p)} | "
                           f"{text(p.get('help', ''))} |")
        else:
            out += ["", "No parameters."]
        inputs = v.get("inputs") or []
        if inputs:
            out += ["", "| input | shape | values | meaning | without it (stand-in) |",
                    "|---|---|---|---|---|"]
            for i in inputs:
                when = f" (with `{i['when']}`)" if i.get("when") else ""
                lo, hi = i.get("range") or [None, None]
                values = ("any" if lo is None and hi is None else
                          f"≤ {number(hi)}" if lo is None else
                          f"≥ {number(lo)}" if hi is None else f"{number(lo)} .. {number(hi)}")
                out.append(f"| `{i.get('name', '')}`{when} | {i.get('shape', '')} | {values} | "
                           f"{text(i.get('help', ''))} | {text(i.get('stand_in', ''))} |")
    return "\n".join(out)


def replace_region(path, doc, region, body):
    begin = f"<!-- generated:{region} begin -->"
    end = f"<!-- generated:{region} end -->"
    i, j = doc.find(begin), doc.find(end)
    if i < 0 or j < 0 or j < i or doc.count(begin) != 1 or doc.count(end) != 1:
        raise GenError(f"{path}: needs one '{begin}' followed by one '{end}'")
    return doc[:i + len(begin)] + "\n" + body + "\n" + doc[j:]


def main():
    ap = argparse.ArgumentParser(
        prog=PROG, description="Regenerate the variant tables of README.md and docs/variants.md "
        "from `BINARY list --json`.")
    ap.add_argument("binary", metavar="BINARY", help="the attnbench binary (e.g. build/attnbench)")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; print a diff and exit 1 if the files are out of date")
    args = ap.parse_args()
    try:
        variants = catalogue(args.binary)
        bodies = {"variants-table": readme_table(variants),
                  "variants-reference": reference(variants)}
        stale = []
        for rel, region in REGIONS:
            path = os.path.join(ROOT, rel)
            try:
                with open(path, encoding="utf-8") as f:
                    old = f.read()
            except OSError as e:
                raise GenError(f"cannot read {rel}: {e.strerror}")
            new = replace_region(rel, old, region, bodies[region])
            if new == old:
                continue
            stale.append(rel)
            if args.check:
                sys.stdout.writelines(difflib.unified_diff(
                    old.splitlines(keepends=True), new.splitlines(keepends=True),
                    fromfile=f"a/{rel}", tofile=f"b/{rel}"))
            else:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
                print(f"{PROG}: rewrote {rel}", file=sys.stderr)
    except GenError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    if args.check and stale:
        print(f"{PROG}: out of date with `{args.binary} list --json`: {', '.join(stale)}; "
              f"regenerate with: {REGENERATE}", file=sys.stderr)
        return 1
    if args.check:
        print(f"{PROG}: README.md and docs/variants.md match `{args.binary} list --json`",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
