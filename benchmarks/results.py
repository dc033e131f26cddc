"""Where benchmarks keep their figures: results/<name>.json, written whole, and their tables in
docs/benchmarks.md.

A benchmark saves its rows (`save`), then publishes the markdown table it renders from them
(`publish`): the text between `<!-- BEGIN name -->` and `<!-- END name -->` in docs/benchmarks.md
becomes a line saying how the table was made (the command, the commit, the UTC date, the machine)
and the table. `save` also writes that line's facts beside the JSON (<name>.run.json), so that
`--publish_only` (a flag of every benchmark that imports this module, `run`) renders the tables
again from the JSON at --out without measuring anything, and still names the run that made them.
A table is published only when its JSON lies inside this repository: runs that write elsewhere
(the tests' temporary folders) leave docs/benchmarks.md alone.
"""
import datetime
import fcntl
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

from absl import flags

REPO = pathlib.Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks.md"
#: files the benchmarks themselves write into the repository: they do not make a commit "uncommitted"
WRITTEN_BY_BENCHMARKS = ("docs/benchmarks.md", "docs/img")

flags.DEFINE_bool("publish_only", False, "Measure nothing: render this benchmark's tables in docs/benchmarks.md "
                  "again from the JSON at --out (and the run facts saved beside it).")


def save(path, data):
    """Writes data as JSON to path (creating its folder) and says where; beside it, <stem>.run.json:
    the command, commit, date and machine of this run (`provenance`), which `publish` names."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    run_file(path).write_text(json.dumps(provenance(command_line()), indent=2) + "\n")
    print(f"\nwrote {path}")


def load(path):
    """The JSON a benchmark saved at path."""
    return json.loads(pathlib.Path(path).read_text())


def run_file(path):
    """Where `save` keeps the run facts of the JSON at path."""
    path = pathlib.Path(path)
    return path.with_name(path.stem + ".run.json")


def figure(columns, width=5):
    """A matplotlib figure (no display needed) with a row of `columns` subplots: (fig, axes)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, columns, figsize=(width * columns, 4.5))


def save_figure(fig, path):
    """Writes fig as a PNG to path (creating its folder) and says where."""
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


# -- tables ----------------------------------------------------------------------------------------
def markdown_table(header, rows, align=None):
    """A markdown table: header, a list of column names; rows, lists of cells (any values, written
    with str); align, one of "l"/"r" per column (default: the first column left, the others right)."""
    align = align or ["l"] + ["r"] * (len(header) - 1)
    lines = ["| " + " | ".join(map(str, header)) + " |",
             "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells in a table of {len(header)} columns: {row}")
        lines.append("| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines)


def command_line(argv=None):
    """The command that ran this process (" ".join(sys.argv)), made relative to the repository: the
    interpreter and the script as paths below it (`sudo` in front when run through sudo), without
    --publish_only."""
    argv = list(sys.argv if argv is None else argv)
    python = os.path.abspath(sys.executable)  # not resolved: .venv/bin/python stays itself
    python = os.path.relpath(python, REPO) if python.startswith(str(REPO) + os.sep) else "python"
    script = os.path.abspath(argv[0])
    script = os.path.relpath(script, REPO) if script.startswith(str(REPO) + os.sep) else argv[0]
    args = [a for a in argv[1:] if not re.fullmatch(r"--(no)?publish_only(=\w+)?", a)]
    return " ".join((["sudo"] if os.environ.get("SUDO_USER") else []) + [python, script]
                    + [shlex.quote(a) for a in args])


def _git(*args):
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def machine(cpuinfo="/proc/cpuinfo"):
    """This machine in words: its CPU count and model, with the x86 family and model numbers and the widest vector
    instructions where /proc/cpuinfo gives them (a virtual machine may name only "AMD EPYC", which is several
    generations of different speed: compare figures only within one such description)."""
    fields = {}
    try:
        for line in pathlib.Path(cpuinfo).read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    details = [fields.get("model name")]
    if fields.get("cpu family") and fields.get("model"):
        details.append(f"family {fields['cpu family']} model {fields['model']}")
    flags = fields.get("flags", "").split()
    details.append("AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None)
    details = [d for d in details if d]
    return f"{os.cpu_count()} CPUs" + (f" ({', '.join(details)})" if details else "")


def provenance(command):
    """The facts a published table names: command, commit (and whether the working tree held changes
    beyond the files benchmarks write), UTC date and machine."""
    changes = _git("status", "--porcelain", "--", ".", *(f":(exclude){p}" for p in WRITTEN_BY_BENCHMARKS))
    return dict(command=command, commit=_git("rev-parse", "--short", "HEAD") or "unknown",
                uncommitted=bool(changes), date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine=machine())


def inside_repository(path):
    return pathlib.Path(path).resolve().is_relative_to(REPO)


def publish(name, markdown, command=None, source=None, doc=None):
    """Replaces the text between `<!-- BEGIN name -->` and `<!-- END name -->` in docs/benchmarks.md with a
    line naming the run (command, commit with "+ uncommitted changes" where the working tree had any, UTC
    date, machine) and `markdown` (a section with these markers is added at the end if there is none).

    command: the command that made the table (default: this process's, `command_line`). source: the JSON
    the table was rendered from: where it lies outside this repository nothing is published, and where
    `save` left its run facts beside it, those name the run (the measurement, not this rendering)."""
    if source is not None and not inside_repository(source):
        print(f"not published ({name}): {source} is outside the repository")
        return
    facts = None
    if source is not None and run_file(source).exists():
        facts = load(run_file(source))
    facts = facts or provenance(command or command_line())
    commit = facts["commit"] + (" + uncommitted changes" if facts["uncommitted"] else "")
    made = (f"Made by `{facts['command']}` at commit {commit}, {facts['date']}, on {facts['machine']}.")
    body = f"<!-- BEGIN {name} -->\n{made}\n\n{markdown.strip()}\n<!-- END {name} -->"
    pattern = re.compile(rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->", re.S)
    doc = pathlib.Path(doc or DOC)
    with open(doc, "r+") as f:  # written in place, under a lock: benchmarks may publish at once
        fcntl.flock(f, fcntl.LOCK_EX)
        text = f.read()
        if pattern.search(text):
            text = pattern.sub(lambda _: body, text, count=1)
        else:
            text = text.rstrip("\n") + f"\n\n## {name}\n\n{body}\n"
        f.seek(0)
        f.write(text)
        f.truncate()
    print(f"published {name} in {os.path.relpath(doc)}")


def run(main, publish_from):
    """The function for app.run: main, or with --publish_only, publish_from(the JSON at --out)."""
    def run_main(argv):
        if flags.FLAGS.publish_only:
            return publish_from(load(flags.FLAGS.out))
        return main(argv)
    return run_main


# -- cells -----------------------------------------------------------------------------------------
def times(x):
    """A ratio as "1.23x", "-" for None."""
    return "-" if x is None else f"{x:.2f}x"


def count(x):
    """A count with thousands separators."""
    return f"{x:,.0f}"
