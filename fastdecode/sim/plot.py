"""The figure of a simulated run: `fastdecode report`'s panels (fastdecode/batch/report_plot.py)
over the simulated steps, titled as a simulation. matplotlib is optional, imported only here."""
from __future__ import annotations


def write_png(doc: dict, path: str) -> None:
    """Save the figure of a `fastdecode simulate` document to `path`; ImportError without matplotlib."""
    from fastdecode.batch.report_plot import figure
    fig = figure(doc)
    s, setting = doc["summary"], doc["setting"]
    p50 = s.get("token_latency_p50_s")
    fig.suptitle(f"simulated: {s['output_tokens']} tokens in {s['wall_s']:.1f} s, {s['output_tokens_per_s']:.1f} "
                 f"tokens/s" + (f", p50 {p50 * 1e3:.1f} ms/token" if p50 is not None else "")
                 + f"; {setting['rworkers']} R-workers, depth {setting['pipeline_depth']}, {setting['schedule']}")
    fig.savefig(path, dpi=110)
