"""The errors of a calibration: bad input (:class:`CalibrationError`), a bad dump (:class:`DumpError`) and files
that could not be written (:class:`OutputError`); each message names what was wrong."""

from __future__ import annotations


class CalibrationError(ValueError):
    """Bad input to a calibration: indices, a setting (``keep``, ``producers``, a pattern) or layers that break a
    rule; the message names it."""


class DumpError(CalibrationError):
    """A dump that cannot be read, breaks the dump format or does not fit the model; the message names the file."""


class OutputError(CalibrationError):
    """The calibration's files could not be written into its output folder; the message names the folder and the
    file, and nothing of this calibration was left there."""
