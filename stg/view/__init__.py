"""Pictures of a trace set: the timed replay as a Perfetto timeline, plots, a one-page report.

Plots and the report need matplotlib (pip install 'stg[plot]'), imported when one is drawn.
"""

from importlib import import_module

# Imported on first use (PEP 562): the CLI registers the view's commands (stg.view.cli) without
# paying for the replay and the trace reader in every other command.
_EXPORTS = {
    **dict.fromkeys(("Bar", "Gantt", "gantt"), "stg.view.gantt"),
    **dict.fromkeys(("PlotKind", "save_plot"), "stg.view.plots"),
    "write_report": "stg.view.report",
    **dict.fromkeys(("Slice", "SliceKind", "Timeline", "chrome_trace", "record_timeline", "write_timeline"),
                    "stg.view.timeline"),
    "TraceSet": "stg.view.traceset",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'stg.view' has no attribute {name!r}")
