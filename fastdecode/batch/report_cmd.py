"""`fastdecode report RUN.summary.json|stats.json [-o run.png]`: a run in a few lines of text, or
its per-step statistics drawn (report_plot.py; matplotlib, the `plot` extra). A run report names
the --stats-json file of its run, so either file draws the figure."""
from __future__ import annotations

import argparse
import json
import os
import sys

from fastdecode.batch.report_text import of_document

EXIT_OK, EXIT_USAGE = 0, 2
NO_MATPLOTLIB = "drawing needs matplotlib: pip install matplotlib (or pip install 'fastdecode[plot]')"


class ReportError(Exception):
    pass


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("report", help="a run in text, or drawn as a PNG: batch, KV per R-worker, S vs R, bubbles",
                       description="Print a run's report, or with -o draw its per-step statistics (from "
                                   "`generate --stats-json`) as one PNG. Drawing needs matplotlib "
                                   "(pip install 'fastdecode[plot]').")
    p.add_argument("path", help="a run report (OUTPUT.summary.json) or a --stats-json file")
    p.add_argument("-o", "--output", default=None, help="PNG to write (default: print the text report)")
    p.add_argument("--run", type=int, default=None, metavar="N",
                   help="print run N of a run report's history (its `runs` numbering) instead of the last run")
    return p


def load(path: str) -> dict:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ReportError(f"{path}: cannot read: {e}") from None
    if not isinstance(doc, dict):
        raise ReportError(f"{path}: neither a run report (OUTPUT.summary.json) nor a --stats-json file")
    return doc


def stats_of(path: str, doc: dict) -> dict:
    """The per-step statistics: the document itself, or the --stats-json file its run report names."""
    if isinstance(doc.get("steps"), list) and isinstance(doc.get("summary"), dict):
        return doc
    if "this_run" not in doc and "state" not in doc:
        raise ReportError(f"{path}: neither a run report (OUTPUT.summary.json) nor a --stats-json file")
    named = doc.get("stats_json")
    if not named:
        raise ReportError(f"{path}: the run kept no per-step statistics; run generate with --stats-json FILE "
                          f"and draw that file (or this report)")
    if not os.path.exists(named):
        raise ReportError(f"{path}: names the statistics file {named}, which does not exist")
    stats = load(named)
    if not isinstance(stats.get("steps"), list):
        raise ReportError(f"{named}: not a --stats-json file")
    return stats


def draw(path: str, doc: dict, output: str) -> str:
    stats = stats_of(path, doc)
    try:
        import matplotlib  # noqa: F401  (optional: the plot extra)
    except ImportError:
        raise ReportError(NO_MATPLOTLIB) from None
    from fastdecode.batch.report_plot import PANELS, figure
    try:
        fig = figure(stats)
    except (KeyError, TypeError, IndexError) as e:
        raise ReportError(f"{path}: malformed per-step statistics ({type(e).__name__}: {e})") from None
    try:
        fig.savefig(output, format="png", dpi=100)
    except OSError as e:
        raise ReportError(f"{output}: cannot write: {e}") from None
    return f"{output}: {len(PANELS)} panels over {len(stats['steps'])} steps"


def run(args) -> int:
    try:
        doc = load(args.path)
        if args.output and args.run is not None:
            raise ReportError("--run prints a run of the history as text; the drawing (-o) is of the run "
                              "whose --stats-json file the report names")
        if args.output:
            print(draw(args.path, doc, args.output))
        else:
            try:
                lines = of_document(doc, args.run)
            except ValueError as e:
                raise ReportError(f"{args.path}: {e}") from None
            except (KeyError, TypeError) as e:
                raise ReportError(f"{args.path}: not a complete run summary ({type(e).__name__}: {e})") from None
            print("\n".join(lines))
    except ReportError as e:
        print(f"fastdecode report: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK
