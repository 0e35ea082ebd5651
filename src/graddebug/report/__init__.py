"""Reading a run as a person would: :class:`~graddebug.report.report.Report` (frames of a run,
live or loaded), :func:`~graddebug.report.load.load`, digest tables, plots, the HTML page,
terminal tables and the test verdict (``assert_healthy``).

The report layer reads storage (:mod:`graddebug.runs`) and calls the detectors; nothing below it
imports it.
"""
