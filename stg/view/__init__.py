"""Pictures of a trace set: the timed replay as a Perfetto timeline, plots, a one-page report.

Plots and the report need matplotlib (pip install 'stg[plot]'), imported when one is drawn.
"""

from stg.view.gantt import Bar, Gantt, gantt
from stg.view.plots import PlotKind, save_plot
from stg.view.report import write_report
from stg.view.timeline import Slice, SliceKind, Timeline, chrome_trace, record_timeline, write_timeline
from stg.view.traceset import TraceSet

__all__ = ["Bar", "Gantt", "PlotKind", "Slice", "SliceKind", "Timeline", "TraceSet", "chrome_trace", "gantt",
           "record_timeline", "save_plot", "write_report", "write_timeline"]
