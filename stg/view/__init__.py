"""Pictures of a trace set: the timed replay as a Perfetto timeline, plots, a one-page report."""

from stg.view.timeline import Slice, SliceKind, Timeline, chrome_trace, record_timeline, write_timeline
from stg.view.traceset import TraceSet

__all__ = ["Slice", "SliceKind", "Timeline", "TraceSet", "chrome_trace", "record_timeline", "write_timeline"]
